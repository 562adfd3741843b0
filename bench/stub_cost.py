"""Item 4: the worker's own cost per streamed token, with a stub token source and no model.

The stubs stand where vLLM stands: an ``AsyncLLM.generate`` yielding prebuilt one-token delta
outputs (raw jobs), and an ASGI app streaming prebuilt ``chat.completion.chunk`` SSE events, one per
token, as vLLM's app does (OpenAI jobs). Around them runs the worker's real code: ``handler()`` on its
own event loop, the cross-loop bridge, job parsing, sampling parameters, stream batching and item
building, the in-process ASGI client and SSE splitting. The cost per token is the time of the jobs
through ``handler()`` less the time of consuming the same stub streams directly, ÷ tokens. Times are
this process's CPU time (all its threads), which other processes on the machine do not inflate.
"""

from __future__ import annotations

import asyncio
import functools
import time
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from bench.common import Plan, Results, ab, messages

TOKENS = 128  # per job
CONCURRENT = 16  # jobs at a time
CHAT_ROUTE = "/v1/chat/completions"
MODEL = "/models/stub-model"


class StubLLM:
    """``generate`` as AsyncLLM's, yielding one-token DELTA outputs without a model."""

    def __init__(self) -> None:
        from vllm.outputs import CompletionOutput, RequestOutput

        self.outputs = [RequestOutput("stub", None, [0] * 16, None, [CompletionOutput(
            0, f" word{i}", [i], None, None, finish_reason="length" if i == TOKENS - 1 else None)],
            finished=i == TOKENS - 1) for i in range(TOKENS)]

    async def generate(self, prompt, params, request_id, *, lora_request=None) -> AsyncIterator:
        for output in self.outputs:
            await asyncio.sleep(0)  # outputs arrive one engine step at a time
            yield output


def _sse_events() -> list[bytes]:
    """The events vLLM's chat endpoint streams for TOKENS tokens: role, one per token, [DONE]."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )

    def event(delta: DeltaMessage, finish: str | None = None) -> bytes:
        chunk = ChatCompletionStreamResponse(id="chatcmpl-stub", created=0, model=MODEL, choices=[
            ChatCompletionResponseStreamChoice(index=0, delta=delta, logprobs=None, finish_reason=finish)])
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n".encode()

    return [event(DeltaMessage(role="assistant", content="")),
            *(event(DeltaMessage(content=f" word{i}"), "length" if i == TOKENS - 1 else None)
              for i in range(TOKENS)),
            b"data: [DONE]\n\n"]


class StubApp:
    """An ASGI app answering every request with the same SSE stream, one body message per event."""

    def __init__(self) -> None:
        self.events = _sse_events()

    async def __call__(self, scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for event in self.events:
            await asyncio.sleep(0)  # one event per engine step
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard(_message) -> None:
    pass


async def _stub_llm_stream(llm: StubLLM) -> None:
    async for _ in llm.generate(None, None, "stub"):
        pass


async def _stub_app_stream(app: StubApp) -> None:
    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    await app({"type": "http", "method": "POST", "path": CHAT_ROUTE}, receive, _discard)


def _stub_engines(raw_openai_output: bool):
    """A vLLMEngine and an OpenAIvLLMEngine around the stubs, built without a model."""
    from worker.engine.vllm_engine import vLLMEngine
    from worker.engine.background_loop import BackgroundLoop
    from worker.routes.serving import OpenAIvLLMEngine
    from worker.routes.route_table import Route, RouteTable
    from worker.config.settings import load_settings

    settings = load_settings({"RAW_OPENAI_OUTPUT": str(raw_openai_output).lower()})
    tokenizer = types.SimpleNamespace(encode=lambda text, add_special_tokens: [0] * 16)
    engine = vLLMEngine.from_parts(settings, StubLLM(), BackgroundLoop("bench-stub"), tokenizer=tokenizer)
    served = OpenAIvLLMEngine.from_parts(engine, StubApp(), RouteTable([Route(CHAT_ROUTE, frozenset({"POST"}))]))
    return engine, served


def _timed_waves(jobs: int, stream: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[float]]:
    """A coroutine factory timing ``jobs`` streams, CONCURRENT at a time (CPU seconds)."""

    async def run() -> float:
        started = time.process_time()
        for _ in range(jobs // CONCURRENT):
            await asyncio.gather(*(stream() for _ in range(CONCURRENT)))
        return time.process_time() - started

    return run


def _cost_per_token(rep: int, jobs: int, engine, direct: Callable[[], Awaitable[None]],
                    job_input: dict) -> float:
    """µs per token: handler() (on this thread's loop) less the stub alone (on the engine's loop)."""
    import handler

    async def through_handler() -> None:
        async for item in handler.handler({"id": f"stub-{uuid.uuid4()}", "input": job_input}):
            if "error" in item:
                raise RuntimeError(f"handler() failed: {item}")

    worker, bare = ab(rep, lambda: asyncio.run(_timed_waves(jobs, through_handler)()),
                      lambda: engine.loop.run(_timed_waves(jobs, direct)()))
    return (worker - bare) / (jobs // CONCURRENT * CONCURRENT * TOKENS) * 1e6


def run(plan: Plan, results: Results) -> None:
    from vllm.utils.gc_utils import freeze_gc_heap

    import handler

    freeze_gc_heap()  # as the worker's start-up does (vllm_adapter/openai_app.build_openai_app)

    raw_job = {"prompt": "stub", "stream": True, "sampling_params": {"max_tokens": TOKENS}}
    openai_job = {"openai_route": CHAT_ROUTE,
                  "openai_input": {"model": MODEL, "messages": messages(0), "stream": True}}
    for raw_openai_output in (True, False):
        engine, served = _stub_engines(raw_openai_output)
        handler.vllm_engine, handler.openai_engine = engine, served
        cases = {f"OpenAI SSE, RAW_OPENAI_OUTPUT={str(raw_openai_output).lower()}":
                 (functools.partial(_stub_app_stream, served.app), openai_job)}
        if raw_openai_output:  # the raw path does not depend on the setting
            cases["raw jobs"] = (functools.partial(_stub_llm_stream, engine.llm), raw_job)
        try:
            for rep in range(plan.reps + 1):  # the first round warms up
                for name, (direct, job_input) in cases.items():
                    cost = _cost_per_token(rep, plan.stub_jobs, engine, direct, job_input)
                    if rep:
                        results.figure("4 worker cost per token", "stub (no model)", name, "µs",
                                       goal=("≤", 5.0)).values.append(cost)
        finally:
            engine.loop.close()
    handler.vllm_engine = handler.openai_engine = None
