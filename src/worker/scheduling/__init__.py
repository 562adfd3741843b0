"""Taking jobs: the job loop and adaptive concurrency."""
