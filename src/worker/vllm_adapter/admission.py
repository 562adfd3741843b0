"""The admission gate's hook into vLLM's engine: every request reaches ``engine/admission`` with its
size (prompt tokens, max_tokens, n) before vLLM sees it, and holds its place until it has ended. A
refusal is vLLM's own 400 (``errors.RefusedRequest``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, aclosing

from vllm import SamplingParams
from vllm.outputs import RequestOutput
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.async_llm import AsyncLLM

from worker.vllm_adapter.errors import RefusedRequest
from worker.wire.errors import RequestError

__all__ = ["Admitted", "gate_requests", "prompt_tokens"]


# ``admitted(prompt_tokens, max_tokens, n)``: called as a request reaches vLLM, raising RequestError
# for one the worker refuses; its place (None: straight to vLLM), entered before vLLM sees the request
# and left when it has ended (``engine/admission.Admission.admitted``).
Admitted = Callable[[int, int | None, int], AbstractAsyncContextManager[None] | None]


def gate_requests(llm: AsyncLLM, admitted: Admitted) -> None:
    """Every ``llm.generate`` (the raw path's, and vLLM's serving classes', which call the engine
    client they were given: this llm) asks ``admitted`` with the request's size when it is called,
    before vLLM's serving starts a response (a refusal is then its 400, streamed or not), enters its
    place before vLLM sees the request, and leaves it when the request has ended, however it ends."""
    generate = llm.generate

    def generate_once_admitted(prompt, sampling_params: SamplingParams, request_id: str,
                               *args, **kwargs) -> AsyncIterator[RequestOutput]:
        try:
            place = admitted(prompt_tokens(prompt), sampling_params.max_tokens, sampling_params.n)
        except RequestError as refused:
            raise RefusedRequest(str(refused), parameter=refused.param) from None
        if place is None:  # not gated: no layer between the caller and vLLM
            return generate(prompt, sampling_params, request_id, *args, **kwargs)
        return _through(place, lambda: generate(prompt, sampling_params, request_id, *args, **kwargs))

    llm.generate = generate_once_admitted


async def _through(place: AbstractAsyncContextManager[None],
                   start: Callable[[], AsyncIterator[RequestOutput]]) -> AsyncIterator[RequestOutput]:
    """vLLM's outputs, from inside ``place``: vLLM sees the request once it is entered."""
    async with place, aclosing(start()) as outputs:  # closed with this one: vLLM aborts it now
        async for output in outputs:
            yield output


def prompt_tokens(prompt) -> int:
    """A prompt's tokens as ``AsyncLLM.generate`` gets it: a request vLLM's renderer built, a dict of
    token ids or embeddings, an encoder-decoder pair (the decoder's: the encoder's output is not in
    the KV cache's blocks); 0 for a text prompt or a streamed input (not tokenized yet)."""
    if isinstance(prompt, EngineCoreRequest):
        prompt = {"prompt_token_ids": prompt.prompt_token_ids, "prompt_embeds": prompt.prompt_embeds}
    if not isinstance(prompt, dict):
        return 0
    if "decoder_prompt" in prompt:
        return prompt_tokens(prompt["decoder_prompt"] or {})
    if prompt.get("prompt_token_ids") is not None:
        return len(prompt["prompt_token_ids"])
    embeds = prompt.get("prompt_embeds")
    return len(embeds) if embeds is not None else 0
