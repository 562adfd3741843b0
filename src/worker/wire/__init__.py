"""What goes over the wire: error bodies and their two dialects, the body envelope, SSE framing, text fit to leave the worker."""
