"""Items 2, 3 and 5: the ``openai`` SDK against the worker (local endpoint) and against ``vllm serve``.

2. Streaming chat at each concurrency, worker and ``vllm serve`` measured alternately.
3. A fresh worker per repetition: the first request after it takes jobs ÷ the median of the next ones.
5. The same fresh workers' start-up, split into phases.

Both servers run the same model with the same engine flags; requests are identical (temperature 0,
ignore_eos, a fixed max_tokens, usage in the last chunk).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

import openai

from bench.common import (VLLM_SERVE, WARM_UP_TOKENS, WORKER, Load, Plan, Results, Stream, ab, messages,
                          model_env, run_load)
from bench.servers import Endpoint, VllmServe


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)


async def chat(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int) -> Stream:
    stream = Stream()
    chunks = await client.chat.completions.create(
        model=model, messages=messages(i), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    tokens = 0
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            stream.got(1)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return stream.done(tokens)


def load(base_url: str, model: str, n: int, max_tokens: int) -> Load:
    """``n`` concurrent streaming chats; a new client (and event loop) per load."""

    async def run() -> Load:
        async with openai_client(base_url) as client:
            return await run_load(n, lambda i, tokens: chat(client, model, i, tokens), max_tokens)

    return asyncio.run(run())


def first_request_ratio(base_url: str, model: str, plan: Plan) -> float:
    """Latency of the first request ÷ the median of the ``plan.followups`` after it (sequential)."""

    async def run() -> float:
        async with openai_client(base_url) as client:
            latencies = [(await chat(client, model, i, plan.first_max_tokens)).latency
                         for i in range(plan.followups + 1)]
        return latencies[0] / statistics.median(latencies[1:])

    return asyncio.run(run())


def _record_start_up(endpoint: Endpoint, model: str, results: Results) -> None:
    start_up = endpoint.start_up
    steps = {"process start → taking jobs": start_up.total,
             "python + handler.py imports": start_up.python,
             **{f"main(): {name}": seconds for name, seconds in start_up.phases.items()},
             "runpod SDK start": start_up.sdk}
    for name, seconds in steps.items():
        results.figure("5 start-up", model, name, "s").values.append(seconds)


def run(model: str, plan: Plan, results: Results) -> None:
    env = model_env(model, plan)
    name = env["MODEL_NAME"]  # both servers serve the model under its path
    logs = Path(tempfile.mkdtemp(prefix=f"bench-{model}-"))
    serve = VllmServe(env, logs / "vllm-serve.log")
    endpoint = None
    try:
        # Also warms up this process's openai SDK, so item 3's first request pays only the worker's costs.
        load(serve.base_url, name, max(plan.concurrency), WARM_UP_TOKENS)
        for rep in range(plan.reps):
            if endpoint is not None:
                endpoint.stop()
            endpoint = Endpoint(env, logs / f"endpoint-{rep}.log")
            _record_start_up(endpoint, model, results)
            results.figure("3 first request", model, f"first ÷ median of next {plan.followups}",
                           goal=("≤", 1.2)).values.append(first_request_ratio(endpoint.base_url, name, plan))
        load(endpoint.base_url, name, max(plan.concurrency), WARM_UP_TOKENS)
        for rep in range(plan.load_reps(model)):
            for n in plan.concurrency:
                worker, vllm = ab(rep, lambda n=n: load(endpoint.base_url, name, n, plan.max_tokens),
                                  lambda n=n: load(serve.base_url, name, n, plan.max_tokens))
                results.add_load(model, WORKER, n, worker)
                results.add_load(model, VLLM_SERVE, n, vllm)
                goal = n in plan.openai_goal_concurrency
                results.figure("2 OpenAI path", model, f"tokens/s worker ÷ vllm serve @{n}",
                               goal=("≥", 1.0) if goal else None).values.append(
                    worker.tokens_per_s / vllm.tokens_per_s)
                results.figure("2 OpenAI path", model, f"TTFT worker ÷ vllm serve @{n}",
                               goal=("≤", 1.1) if goal else None).values.append(worker.ttft / vllm.ttft)
    finally:
        for server in (endpoint, serve):
            if server is not None:
                server.stop()
