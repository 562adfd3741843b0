"""Start-up steps, their retries, and what a worker that could not start does."""
