"""The two error dialects of the job routes: which routes speak Anthropic's, and each dialect's
error type for an HTTP status (and back).

Plain data, no vLLM: the local endpoint shares it to turn a failed job back into the HTTP error
the worker described.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["anthropic_status", "anthropic_type", "is_anthropic_route", "openai_type"]

# OpenAI-style type names (as the openai SDK names its exceptions).
OPENAI_TYPES: Mapping[int, str] = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 408: "TimeoutError", 413: "RequestTooLargeError",
    422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
    501: "NotImplementedError", 503: "ServiceUnavailableError",  # 501: vLLM's name (the SDK has none)
}

# Anthropic's error types (https://docs.anthropic.com/en/api/errors), one per status, so that a
# status survives the trip through a job's error text, which carries only the type.
ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error",
}
_ANTHROPIC_STATUS = {name: status for status, name in ANTHROPIC_TYPES.items()}


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def anthropic_type(status: int) -> str:
    return ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_status(error_type: str | None) -> int:
    return _ANTHROPIC_STATUS.get(error_type or "", 500)


def is_anthropic_route(route: str | None) -> bool:
    """Routes answered in Anthropic's dialect: the Messages API and its sub-routes."""
    return route is not None and (route == "/v1/messages" or route.startswith("/v1/messages/"))
