"""Start-up steps, their retries and their time bound, and what a worker that could not start does."""
