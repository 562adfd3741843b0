"""The worker's errors and the one error payload a job yields.

Exception tree::

    WorkerError                      what the worker raises on purpose for a start or a job to fail
    ├── StartupError                 the worker cannot start: every job is answered with it
    │   └── ConfigError              bad configuration, found before the model loads
    └── RequestError                 a job that cannot be served; the worker keeps serving
        └── (status 400 unless set)  e.g. a bad field in the job input

Two deliberate exceptions stay outside it, as neither reaches a caller as it is:
``jobs/deadlines.DeadlinePassed``, which the handler turns into a 408 or 503 error item, and
``model/download_model.BakeError``, the image's bake step's (build time, with only its own files).
Other exceptions (vLLM's) are classified by type, never by message, in the adapter
(``vllm_adapter/errors.error_status``, ``is_fatal``): this module imports no vLLM, so the
modules that raise the worker's errors do not pull in vLLM and torch.

A failed job yields exactly one ``{"error": {...}}`` item (OpenAI's error shape, or Anthropic's on
``/v1/messages``). The runpod SDK fails the job with ``str()`` of the inner ``error`` value as its
error text, so that value is a ``JsonDict`` whose ``str()`` is JSON: RunPod clients get a
parseable error, in-process callers plain dicts. The local endpoint builds its error bodies here too.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from worker.wire.dialects import anthropic_type, openai_type
from worker.wire.redact import answer_text, served_text


class WorkerError(Exception):
    """Base of the worker's own exceptions."""


class StartupError(WorkerError):
    """The worker cannot start; the message says why, in words, and what to change.

    ``detail``: what only the log gets, beside the message: local paths, the hub's URL, an
    exception's own text (a caller sees ``answer``). ``variables``: the settings to change, when
    known. ``transient``: the same start may succeed when tried again (an interrupted download,
    memory that was short once); ``retry`` holds the engine flags to try it with, by dest (empty:
    the same ones), and ``change`` what they change, in the words of the settings
    (``GPU_MEMORY_UTILIZATION lowered from 0.95 to 0.85``)."""

    def __init__(self, message: str, *, detail: str | None = None, variables: tuple[str, ...] = (),
                 transient: bool = False, retry: dict[str, object] | None = None, change: str = "") -> None:
        super().__init__(message)
        self.detail = detail
        self.variables = variables
        self.transient = transient
        self.retry = retry or {}
        self.change = change

    @property
    def answer(self) -> str:
        """What a caller is told: the message, URL credentials masked, any local path left to the log."""
        return answer_text(str(self))

    @property
    def refusal(self) -> str:
        """What every job and request of a worker that could not start is answered with."""
        return f"the worker could not start: {self.answer}"

    @property
    def logged(self) -> str:
        """What the log gets: the message and its detail (the log masks URL credentials itself)."""
        return f"{self} [{self.detail}]" if self.detail else str(self)


class ConfigError(StartupError):
    """Configuration that cannot work: named variable, value and what was expected."""


class RequestError(WorkerError):
    """A job the worker refuses, with the offending field when there is one."""

    def __init__(self, message: str, *, param: str | None = None,
                 status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class JsonDict(dict):
    """A dict whose ``str()`` is JSON (the runpod SDK reports errors with ``str()``)."""

    def __str__(self) -> str:
        return json.dumps(self)


class ErrorPayload(JsonDict):
    """An error item, ``{"error": {...}, ...}``; the inner error also prints as JSON."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self["error"] = JsonDict(self["error"])


def error_item(error: dict, *, anthropic: bool = False) -> ErrorPayload:
    """An error object in its dialect's envelope: Anthropic's ``{"type": "error", "error": ...}``,
    else OpenAI's ``{"error": ...}``."""
    return ErrorPayload(type="error", error=error) if anthropic else ErrorPayload(error=error)


def create_error_response(message: str, err_type: str | None = None,
                          status_code: int = HTTPStatus.BAD_REQUEST,
                          param: str | None = None) -> ErrorPayload:
    """OpenAI's error item, ``{"error": {"message", "type", "param", "code"}}`` (name kept from
    worker-vllm's ``utils``)."""
    return error_item({
        "message": message,
        "type": err_type or openai_type(status_code),
        "param": param,
        "code": int(status_code),
    })


def anthropic_error(status: int, message: str) -> ErrorPayload:
    """Anthropic's error object, ``{"type": "error", "error": {"type", "message"}}``."""
    return error_item({"type": anthropic_type(status), "message": message}, anthropic=True)


def error_response(status: int, message: str, *, param: str | None = None,
                   anthropic: bool = False) -> ErrorPayload:
    """An error item in the job's dialect: Anthropic's on ``/v1/messages``, else OpenAI's."""
    if anthropic:
        return anthropic_error(status, message)
    return create_error_response(message, status_code=status, param=param)


def error_from_exception(exc: BaseException, status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR, *,
                         anthropic: bool = False) -> ErrorPayload:
    """Map any exception to the payload, keeping its message (another's than the worker's with this
    machine's paths masked, ``served_text``) and parameter; ``status`` is what the exception means
    (a ``RequestError`` carries its own)."""
    if isinstance(exc, RequestError):
        status = exc.status
    param = getattr(exc, "param", None) or getattr(exc, "parameter", None)
    message = str(exc) or type(exc).__name__
    if not isinstance(exc, WorkerError):
        message = served_text(message)
    return error_response(status, message, param=param, anthropic=anthropic)
