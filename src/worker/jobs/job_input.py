"""``JobInput``: one validated view of ``job["input"]``, for raw and OpenAI-route jobs.

Raw jobs carry ``prompt`` or ``messages`` plus ``sampling_params`` and stream batching knobs;
OpenAI-route jobs carry ``openai_route`` and ``openai_input`` (the HTTP body), or, as worker-vllm
2.24 and later, ``route``, ``body`` and ``method``. Other keys are kept as ``unread_keys``: the
handler refuses a request parameter among them and warns about the rest (``engine/sampling``).
An input nested deeper than ``wire/nesting.MAX_DEPTH`` is refused first. Plain data: no vLLM here.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from worker.wire import nesting
from worker.wire.errors import RequestError

__all__ = ["JobInput", "PromptForm", "prompt_form"]


class JobInput(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    # A message list here is chat, as worker-vllm read it; else a prompt as /v1/completions takes it.
    prompt: str | list[Any] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None  # raw jobs: a LoRA adapter's name (or the served model's)
    stream: bool = False
    apply_chat_template: bool = False
    max_batch_size: int | None = Field(None, ge=1)
    min_batch_size: int | None = Field(None, ge=1)
    batch_size_growth_factor: float | None = Field(None, ge=1, allow_inf_nan=False)
    # worker-vllm >= 2.24 spells these route/body (with method): both shapes are accepted.
    openai_route: str | None = Field(None, validation_alias=AliasChoices("openai_route", "route"))
    openai_input: dict[str, Any] | None = Field(
        None, validation_alias=AliasChoices("openai_input", "body"))
    method: Literal["GET", "POST", "PUT", "DELETE"] | None = None  # else Route.method_for chooses
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)  # seconds; else JOB_TIMEOUT
    # Not an input field: vLLM needs unique ids, so a client cannot choose one.
    _request_id: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex)

    @field_validator("method", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("max_batch_size", "min_batch_size", "batch_size_growth_factor", mode="before")
    @classmethod
    def _zero_means_default(cls, value: Any) -> Any:
        return None if value == 0 else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _a_prompt(cls, value: Any) -> Any:
        if value is None or prompt_form(value) is not None:
            return value
        raise ValueError("expected a string, a list of chat messages (JSON objects), or a prompt as "
                         "/v1/completions takes it: a list of strings, token ids or lists of token ids")

    @model_validator(mode="after")
    def _needs_input(self) -> JobInput:
        if self.openai_route is None and self.prompt is None and self.messages is None:
            raise ValueError("the job input needs 'prompt', 'messages' or 'openai_route'")
        return self

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def unread_keys(self) -> list[str]:
        """The input's keys no field reads."""
        return sorted(self.model_extra or {})

    @property
    def llm_input(self) -> str | list[Any] | None:
        """``messages`` when given (and not null), else ``prompt`` (its form: ``input_form``)."""
        return self.messages if self.messages is not None else self.prompt

    @property
    def input_form(self) -> PromptForm | None:
        """What ``llm_input`` is (``prompt_form``)."""
        return None if self.llm_input is None else prompt_form(self.llm_input)


    @classmethod
    def from_job(cls, job: Any) -> JobInput:
        """Validate a RunPod job; raises RequestError naming the offending field."""
        payload = job.get("input") if isinstance(job, dict) else None
        if nesting.too_deep(payload):  # before anything recurses through it
            raise RequestError(nesting.refusal("the job input"), param="input")
        if not isinstance(payload, dict):
            raise RequestError("the job's 'input' must be a JSON object", param="input")
        try:
            job_input = cls.model_validate(payload)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(map(str, err["loc"]))
            prefix = f"{where}: " if where else ""
            raise RequestError(f"{prefix}{err['msg']}", param=where or None) from None
        if isinstance(job.get("id"), str):  # traceable in vLLM's logs, still unique
            job_input._request_id = f"{job['id']}-{job_input._request_id[:8]}"
        return job_input


PromptForm = Literal["text", "messages", "texts", "token_ids", "token_id_lists"]


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value)


def prompt_form(value: Any) -> PromptForm | None:
    """What a prompt is: a ``text``, chat ``messages`` (a list of objects, or an empty list), or as
    /v1/completions also takes it, ``texts``, ``token_ids`` or ``token_id_lists``; None: none of them."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    if all(isinstance(item, dict) for item in value):
        return "messages"
    if all(isinstance(item, str) for item in value):
        return "texts"
    if _token_ids(value):
        return "token_ids"
    return "token_id_lists" if all(_token_ids(item) for item in value) else None
