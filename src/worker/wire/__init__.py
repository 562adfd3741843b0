"""What goes over the wire: error bodies and their two dialects, the body envelope, SSE framing, JSON nested too deep, text fit to leave the worker, the media URLs vLLM may fetch."""
