"""Start-up: its steps, the serving modules imported beside the engine's start, RunPod's fitness checks,
retries and time bound, and answers after a failed start."""
