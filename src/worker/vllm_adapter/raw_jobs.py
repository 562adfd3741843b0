"""What a raw job hands vLLM, in vLLM's own types: its sampling parameters (the fields a job may
set, validated as vLLM validates them), the fields of the request bodies vLLM's routes take (which
a raw job in the openai format may carry), and the chat template its messages are rendered with."""

from __future__ import annotations

import msgspec
from vllm import SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.renderers.chat_utils import load_chat_template
from vllm.sampling_params import RequestOutputKind

__all__ = ["load_chat_template", "make_sampling_params", "REQUEST_FIELDS", "RequestOutputKind", "SAMPLING_FIELDS",
           "SamplingParams"]

# SamplingParams fields a job may set: the public ones, less those the worker controls.
_WORKER_CONTROLLED = frozenset({"output_kind", "skip_clone", "output_text_buffer_length"})
SAMPLING_FIELDS = frozenset(
    name for name in SamplingParams.__struct_fields__
    if not name.startswith("_") and name not in _WORKER_CONTROLLED
)


# The fields of the request bodies vLLM's completions and chat completions routes take.
REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def make_sampling_params(fields: dict, output_kind: RequestOutputKind) -> SamplingParams:
    """Typed, validated SamplingParams from JSON (msgspec checks types, vLLM the ranges)."""
    return msgspec.convert({**fields, "output_kind": output_kind.value}, SamplingParams)
