"""Taking jobs: the job loop, the job-take request and adaptive concurrency."""
