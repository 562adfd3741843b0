"""worker-vllm's public import path for the names its documentation imports from ``utils``; kept for them."""

from worker.jobs.batching import BatchSize
from worker.wire.errors import create_error_response
from worker.jobs.job_input import JobInput

__all__ = ["BatchSize", "JobInput", "create_error_response"]
