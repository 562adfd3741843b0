"""worker-vllm's public import path for the names its documentation imports from ``utils``; kept for them."""

from worker.jobs.batching import BatchSize
from worker.jobs.job_input import JobInput
from worker.wire.errors import create_error_response

__all__ = ["BatchSize", "JobInput", "create_error_response"]
