"""Names worker-vllm's documentation imports from ``utils``; the code lives in its own modules."""

from batching import BatchSize
from errors import create_error_response
from job_input import JobInput

__all__ = ["BatchSize", "JobInput", "create_error_response"]
