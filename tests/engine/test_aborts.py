"""vLLM aborts a job's request within a second when RunPod stops the job (job-stop cancels the
handler's task), when the handler's generator is closed early, and when the job times out: on
the raw path and every generating OpenAI route, streaming and not."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import pytest
from conftest import collect

import handler

LONG = {"max_tokens": 1900, "ignore_eos": True}


def running_requests(engine) -> int:
    return engine.llm.output_processor.get_num_unfinished_requests()


def wait_idle(engine, timeout: float = 1.0) -> float:
    started = time.monotonic()
    while running_requests(engine):
        assert time.monotonic() - started < timeout, "the vLLM request was not aborted"
        time.sleep(0.01)
    return time.monotonic() - started


def jobs(model: str) -> dict[str, dict]:
    """Long-running job inputs per path, without ``stream``: none may end early on an EOS (vLLM's
    Anthropic route drops ignore_eos; greedy, the tiny model emits none there in 1,900 tokens)."""
    chat = [{"role": "user", "content": "Tell me a long story."}]
    return {
        "raw": {"prompt": "x", "sampling_params": LONG},
        "completions": {"openai_route": "/v1/completions",
                        "openai_input": {"model": model, "prompt": "x", **LONG}},
        "chat": {"openai_route": "/v1/chat/completions",
                 "openai_input": {"model": model, "messages": chat, **LONG}},
        "responses": {"openai_route": "/v1/responses",
                      "openai_input": {"model": model, "input": "x", "max_output_tokens": 1900,
                                       "ignore_eos": True}},
        "messages": {"openai_route": "/v1/messages",
                     "openai_input": {"model": model, "messages": chat, "max_tokens": 1900,
                                      "temperature": 0}},
    }


def with_stream(job_input: dict, stream: bool) -> dict:
    if "openai_input" in job_input:
        return {**job_input, "openai_input": {**job_input["openai_input"], "stream": stream}}
    return {**job_input, "stream": stream}


@pytest.fixture(scope="module")
def served(tiny_engine, tiny_openai):
    saved = handler.vllm_engine, handler.openai_engine
    handler.vllm_engine, handler.openai_engine = tiny_engine, tiny_openai
    yield jobs(tiny_openai.served_model_name)
    handler.vllm_engine, handler.openai_engine = saved


async def stop_when_running(engine, job_input: dict) -> None:
    """As the SDK does on job-stop: cancel the task running the job, once vLLM is generating."""
    async def run_job():
        async for _ in handler.handler({"id": "stop-me", "input": job_input}):
            pass

    task = asyncio.create_task(run_job())
    started = time.monotonic()
    while not running_requests(engine):
        assert time.monotonic() - started < 30 and not task.done(), "the job never started"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # well into generation
    assert running_requests(engine), "the request ended before the stop"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def stop_between_items(engine, job_input: dict) -> float:
    """job-stop while the SDK is busy between two items (posting one): the cancellation lands
    outside the handler's generator, which is left suspended, and, as in the SDK, stays
    referenced until the garbage collector finds it (here: never). Returns vLLM's unfinished
    requests 1 s later."""
    received = []

    async def run_job():
        generator_output = handler.handler({"id": "stop-me", "input": job_input})
        try:
            async for item in generator_output:
                received.append(item)
                await asyncio.sleep(3600)  # the SDK posting the item
        except asyncio.CancelledError as exc:
            stopped = exc  # a reference cycle through the traceback keeps this frame alive  # noqa: F841
            raise

    task = asyncio.create_task(run_job())
    while not received:
        await asyncio.sleep(0.01)
    assert running_requests(engine), "the request ended before the stop"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    started = time.monotonic()
    while running_requests(engine) and time.monotonic() - started < 1:
        await asyncio.sleep(0.01)
    return running_requests(engine)


async def close_after_first_item(job_input: dict) -> None:
    items = handler.handler({"id": "close-me", "input": job_input})
    await anext(items)
    await items.aclose()


PATHS = ["raw", "completions", "chat", "responses", "messages"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_job_stop_aborts_the_request(tiny_engine, served, path, stream):
    asyncio.run(stop_when_running(tiny_engine, with_stream(served[path], stream)))
    wait_idle(tiny_engine)


@pytest.mark.parametrize("path", PATHS)
def test_job_stop_between_stream_items_aborts_the_request(tiny_engine, served, path):
    gc.disable()
    try:
        assert asyncio.run(stop_between_items(tiny_engine, with_stream(served[path], True))) == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("path", PATHS)
def test_closing_a_stream_early_aborts_the_request(tiny_engine, served, path):
    asyncio.run(close_after_first_item(with_stream(served[path], True)))
    wait_idle(tiny_engine)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["raw", "completions"])
def test_a_job_past_its_timeout_is_aborted_with_408(tiny_engine, served, path, stream):
    job_input = {**with_stream(served[path], stream), "timeout": 0.5}
    items = collect(handler.handler({"id": "timeout", "input": job_input}))
    assert items[-1]["error"]["code"] == 408 and items[-1]["error"]["param"] == "timeout"
    wait_idle(tiny_engine)
