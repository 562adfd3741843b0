"""Serving a load-balancing endpoint: HTTP straight from RunPod's balancer, no job queue."""
