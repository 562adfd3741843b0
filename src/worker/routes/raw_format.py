"""Raw jobs in worker-vllm 2.24's format (``RAW_JOB_FORMAT=openai``): a ``prompt`` or ``messages``
job as the request worker-vllm 2.24 and later make of it, to vLLM's own ``/v1/completions`` or
``/v1/chat/completions``, answered by the same in-process app as the OpenAI routes.

The body is ``sampling_params`` with ``stream`` and the ``prompt`` or ``messages``; its ``model`` is the
one ``sampling_params`` names, else the job's ``model`` (a LoRA adapter), else the served model's name.
So ``max_tokens`` defaults to vLLM's default for the route (16 on completions), not to the tokens
format's 100. Beyond worker-vllm: a string ``prompt`` with ``apply_chat_template`` and a ``prompt`` that
is a list of messages are chats (worker-vllm sends both to ``/v1/completions``), and a job with both
``prompt`` and ``messages`` is refused (which to send is ambiguous). Any other ``prompt`` that
``/v1/completions`` takes (a list of strings, token ids, lists of token ids) goes to it as it is.

Answers are the route's: one item, vLLM's JSON, when not streaming; SSE text items of whole events,
the last ``data: [DONE]``, when streaming: one event per item as worker-vllm sends them, unless the
job or the worker sets stream batching (``max_batch_size``, ``min_batch_size``,
``batch_size_growth_factor``; ``DEFAULT_BATCH_SIZE``, ...): then in batches, as on the OpenAI routes.
Plain data: no vLLM here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.jobs.batching import BatchSize
from worker.wire.errors import RequestError

if TYPE_CHECKING:
    from worker.config.settings import WorkerSettings
    from worker.jobs.job_input import JobInput

__all__ = ["BATCHING", "RawRequest", "raw_request"]

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Set on the job or the worker (the console forms leave them empty), they batch an openai-format stream.
BATCHING = ("max_batch_size", "min_batch_size", "batch_size_growth_factor")
ONE_EVENT = BatchSize(1, 1, 1)


@dataclass(frozen=True)
class RawRequest:
    """A raw job as a route job, and how its stream is cut: None as the route's streams are."""

    job: JobInput
    per_event: BatchSize | None


def _route_and_input(job: JobInput) -> tuple[str, dict[str, Any]]:
    if job.prompt is not None and job.messages is not None:
        raise RequestError("the job has both 'prompt' and 'messages': send one (a prompt goes to "
                           "/v1/completions, messages to /v1/chat/completions)", param="messages")
    llm_input, form = job.llm_input, job.input_form
    if form == "messages":
        return CHAT, {"messages": llm_input}
    if job.apply_chat_template:
        if form != "text":
            raise RequestError("apply_chat_template takes a string prompt (or send 'messages'); this "
                               "prompt is a list of prompts or token ids", param="prompt")
        return CHAT, {"messages": [{"role": "user", "content": llm_input}]}
    return COMPLETIONS, {"prompt": llm_input}  # as /v1/completions takes it: texts and token ids too


def raw_request(job: JobInput, served_model: str, settings: WorkerSettings) -> RawRequest:
    """The request worker-vllm 2.24 makes of a raw ``job``; RequestError when it cannot make one."""
    route, llm_input = _route_and_input(job)
    body = {**job.sampling_params, "stream": job.stream, **llm_input}
    body.setdefault("model", job.model or served_model)
    batched = any(getattr(job, knob) is not None for knob in BATCHING) or \
        not settings.model_fields_set.isdisjoint(BATCHING)
    as_route = job.model_copy(update={"openai_route": route, "openai_input": body, "method": "POST"})
    return RawRequest(as_route, None if batched else ONE_EVENT)
