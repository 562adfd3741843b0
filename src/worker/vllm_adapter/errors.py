"""What vLLM's exceptions mean to the worker: which end it (the worker must be replaced), which a
request caused, and the HTTP status `vllm serve` answers each with; and ``RefusedRequest``, the
worker's own refusal in vLLM's terms, so that vLLM's app answers it as its own validation errors."""

from __future__ import annotations

from http import HTTPStatus

import msgspec
import torch
from vllm.entrypoints.serve.exception_handling.error_response import (
    create_error_response as vllm_error_response,
)
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

__all__ = ["EngineDeadError", "error_status", "is_fatal", "RefusedRequest", "REQUEST_ERRORS",
           "vllm_error_response"]

# Errors after which the engine cannot serve again: the worker must be replaced.
FATAL_ERRORS: tuple[type[BaseException], ...] = (EngineDeadError, torch.AcceleratorError)
# Errors caused by the request (HTTP 4xx).
REQUEST_ERRORS = (VLLMClientError, ValueError, TypeError, msgspec.ValidationError)


def is_fatal(exc: BaseException) -> bool:
    """True when the engine cannot serve again and the process must be replaced."""
    return isinstance(exc, FATAL_ERRORS)


def error_status(exc: Exception) -> HTTPStatus:
    """What an exception from vLLM means, as `vllm serve` answers it: vLLM's own classification,
    which its API server's exception handlers use, by type (never the message). A
    ``GracefulHTTPError``'s own status (503 for a full queue), 503 for a retryable failure, 422 for
    content vLLM cannot process, 404 for what it does not have, 400 for a request it rejects, 501
    for what it does not implement, else 500."""
    return HTTPStatus(vllm_error_response(exc).error.code)


class RefusedRequest(VLLMValidationError):
    """A request the worker refuses before vLLM sees it: vLLM's app answers its 400 (with the
    parameter), as for its own validation; the raw path reads the same status."""

    def __str__(self) -> str:
        return str(self.args[0])
