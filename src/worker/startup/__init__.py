"""Start-up: its steps, RunPod's fitness checks, retries and time bound, and answers after a failed start."""
