"""Names worker-vllm's documentation imports from ``utils``; the code lives in its own modules."""

from worker.jobs.batching import BatchSize
from worker.wire.errors import create_error_response
from worker.jobs.job_input import JobInput

__all__ = ["BatchSize", "JobInput", "create_error_response"]
