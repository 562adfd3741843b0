"""The concurrency controller on the real engine: vLLM's scheduler feeds it after each step, a
worker full of jobs the engine runs at once is given more, and through the admission gate vLLM runs
what the KV budget holds (whole workers behind the local endpoint:
tests/endpoint/test_adaptive_concurrency.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import pytest
from conftest import LOAD_FEED

import handler
from worker.engine.admission import Admission
from worker.jobs.job_input import JobInput
from worker.scheduling.concurrency import START, Concurrency, KvBudget
from worker.vllm_adapter.admission import gate_requests
from worker.vllm_adapter.raw_jobs import SamplingParams


@contextlib.contextmanager
def observed(jobs: Concurrency, loads: list[dict]):
    LOAD_FEED.observers += [jobs.observe, lambda **load: loads.append(load)]
    try:
        yield
    finally:
        LOAD_FEED.observers.clear()


def run_at_once(count: int, max_tokens: int, prompt: str = "Once upon a time") -> list[list]:
    """``count`` raw jobs at once; ``{i}`` in ``prompt``: the job's index."""

    async def one(i: int) -> list:
        job = {"prompt": prompt.format(i=i), "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
        return [item async for item in handler.handler({"id": f"c-{i}", "input": job})]

    async def every() -> list[list]:
        return await asyncio.gather(*(one(i) for i in range(count)))

    return asyncio.run(every())


def test_a_full_worker_whose_engine_runs_every_job_is_given_more(tiny_engine, monkeypatch):
    monkeypatch.setattr(handler, "vllm_engine", tiny_engine)
    jobs = Concurrency(1, None, held=lambda: handler.deadlines.running)
    jobs.set_cap(tiny_engine.max_concurrency)
    assert (jobs.target, jobs.cap) == (START, 256)  # the worker's max_num_seqs
    loads: list[dict] = []
    with observed(jobs, loads):
        results = run_at_once(40, max_tokens=64)
    assert all(r[0]["usage"]["output"] == 64 for r in results)
    # Every request started and finished once, and vLLM ran all 40 in one batch, none preempted.
    assert sum(load["started"] for load in loads) == sum(load["finished"] for load in loads) == 40
    assert max(load["running"] for load in loads) == 40
    assert not any(load["preempted"] for load in loads)
    assert loads[-1]["running"] == loads[-1]["waiting"] == 0 and loads[-1]["kv_usage"] == 0
    assert max(load["kv_usage"] for load in loads) > 0
    # 40 held ≥ 16, ≥ 24, ≥ 36, each once the jobs held before the last rise run: 54, where 40
    # held no longer fill it.
    assert jobs.target == 54


def test_the_engine_feeds_the_controller_and_keeps_no_prometheus_metrics(tiny_engine):
    # /metrics is not served: vLLM's Prometheus logger would only cost CPU per token.
    assert [type(logger).__name__ for logger in tiny_engine.llm.logger_manager.stat_loggers] == ["LoadTap"]


# --- the admission gate -------------------------------------------------------------------------------


@pytest.fixture
def gated(tiny_engine, monkeypatch):
    """The tiny engine's requests through an admission gate over a budget of ``BUDGET_BLOCKS``, kept
    by a controller the engine's scheduler feeds."""
    jobs = Concurrency(1, 256, held=lambda: 0)
    jobs.set_kv_cache(BUDGET_BLOCKS, BLOCK, tiny_engine.llm.vllm_config.model_config.max_model_len)
    gate = Admission(lambda: jobs.kv)
    monkeypatch.setattr(tiny_engine.llm, "generate", tiny_engine.llm.generate)  # restored afterwards
    gate_requests(tiny_engine.llm, gate.admitted)
    monkeypatch.setattr(handler, "vllm_engine", tiny_engine)
    LOAD_FEED.observers.append(jobs.observe)
    yield jobs.kv, gate
    LOAD_FEED.observers.clear()


BUDGET_BLOCKS, BLOCK = 10, 128  # requests of a few prompt tokens and 64 more: 1 block each


def test_through_the_gate_vllm_runs_what_the_budget_holds_and_every_job_completes(gated):
    budget, gate = gated
    loads: list[dict] = []
    LOAD_FEED.observers.append(lambda **load: loads.append(load))
    results = run_at_once(40, max_tokens=64)
    assert [r[0]["usage"]["output"] for r in results] == [64] * 40
    assert max(load["running"] + load["waiting"] for load in loads) == BUDGET_BLOCKS
    assert sum(load["finished"] for load in loads) == 40
    assert (budget.used, budget.admitted, gate.waiting) == (0, 0, 0)  # every request gave its room back


def test_openai_requests_are_planned_at_their_tokens_and_n(gated, tiny_openai):
    budget, _ = gated
    planned: list[tuple] = []
    need = budget.need
    budget.need = lambda prompt, max_tokens, n=1: planned.append((prompt, max_tokens, n)) or need(
        prompt, max_tokens, n)
    body = {"model": "tiny-lora", "prompt": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 3, "n": 2}
    job = {"id": "gated-openai", "input": {"openai_route": "/v1/completions", "openai_input": body}}

    async def answer() -> list:
        return [item async for item in tiny_openai.generate(JobInput.from_job(job))]

    (completion,) = asyncio.run(answer())
    assert len(completion["choices"]) == 2 and completion["usage"]["completion_tokens"] == 6
    assert planned == [(7, 3, 2)]
    assert (budget.used, budget.admitted) == (0, 0)


def test_a_prefix_the_requests_found_in_vllms_prefix_cache_is_planned_once(gated):
    budget, _ = gated
    prefix = "The lighthouse keeper counted the ships. " * 40
    encode = handler.vllm_engine.tokenizer.encode
    tokens, shared = len(encode(prefix + "Story 0:", add_special_tokens=True)), len(encode(prefix, add_special_tokens=True))
    assert shared >= 2 * BLOCK
    assert budget.need(tokens, 8) == math.ceil((tokens + 8) / BLOCK)  # no request finished yet
    run_at_once(1, max_tokens=8, prompt=prefix + "Story 0:")  # fills vLLM's prefix cache
    run_at_once(9, max_tokens=8, prompt=prefix + "Story {i}:")
    # vLLM reported the prefix's whole blocks found cached: the plan holds them once, beside all.
    own = budget.need(tokens, 8)
    assert budget.prefix_blocks in ((shared - 1) // BLOCK, shared // BLOCK)
    assert own == math.ceil((tokens - budget.prefix_blocks * BLOCK + 8) / BLOCK) < math.ceil((tokens + 8) / BLOCK)


def test_a_job_stopped_while_it_waits_for_room_leaves_its_place(gated):
    budget, gate = gated
    long_job = {"prompt": "Once upon a time", "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}
    short_job = {"prompt": "Once upon a time", "sampling_params": {"max_tokens": 64, "ignore_eos": True}}

    async def until(condition) -> None:
        async with asyncio.timeout(60):
            while not condition():
                await asyncio.sleep(0.01)

    async def run(job_id: str, job: dict) -> list:
        return [item async for item in handler.handler({"id": job_id, "input": job})]

    async def scenario() -> tuple[list, list]:
        # 1,000-token requests: 9 blocks each, one at a time in a budget of 10.
        running = asyncio.create_task(run("stop-0", long_job))
        await until(lambda: budget.admitted == 1)
        waiting = asyncio.create_task(run("stop-1", long_job))  # no room: it waits in the gate
        await until(lambda: gate.waiting == 1)
        waiting.cancel()  # as the SDK cancels a stopped job's task
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        # The request waits on the engine's own loop: the stop reaches it from this one.
        await until(lambda: gate.waiting == 0)
        short = await run("stop-2", short_job)  # 1 block: it fits beside the running one at once
        return await running, short

    first, short = asyncio.run(scenario())
    assert first[0]["usage"]["output"] == 1000 and short[0]["usage"]["output"] == 64
    assert (budget.used, budget.admitted, gate.waiting) == (0, 0, 0)


def test_a_gated_stream_closed_between_outputs_closes_vllms_at_once():
    """A consumer that closes the stream between two outputs (a cancelled job's) closes vLLM's own
    generate with it, whose cleanup aborts the request, rather than leave it to the garbage collector."""
    closed, budget = [], KvBudget(10, BLOCK)

    class Engine:
        async def generate(self, prompt, sampling_params, request_id):
            try:
                for i in range(100):
                    yield i
            finally:
                closed.append(request_id)

    async def scenario() -> None:
        engine = Engine()
        gate_requests(engine, Admission(lambda: budget).admitted)
        outputs = engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=5), "r-1")
        assert await anext(outputs) == 0 and budget.admitted == 1
        await outputs.aclose()
        assert closed == ["r-1"] and budget.admitted == 0

    asyncio.run(scenario())


# --- what the gate refuses: n above MAX_N, and a request larger than the whole cache ---------------


def _completions(tiny_openai, **body) -> dict:
    return {"openai_route": "/v1/completions", "openai_input": {
        "model": tiny_openai.served_model_name, "prompt": "Once upon a time", "ignore_eos": True, **body}}


def _refusal(items: list) -> tuple[int, str | None, str]:
    (item,) = items
    error = item["error"]
    return error["code"], error["param"], error["message"]


def _load_balancer(tiny_engine, tiny_openai):
    """The load-balancing endpoint's app in this process, on the engine's loop as a worker serves it:
    ``call(path, body)`` → (HTTP status, body)."""
    from worker.load_balancer.app import Serving, WorkerApp
    from worker.routes.asgi_client import request

    app = WorkerApp()
    app.serve(Serving(tiny_openai.app, tiny_openai.routes, handler.handler, handler.deadlines,
                      tiny_engine.settings, is_dead=lambda: False, on_death=lambda: None))

    async def answer(path: str, body: dict) -> tuple[int, dict]:
        async with request(app, "POST", path, body, "application/json") as response:
            return response.status, json.loads(b"".join([chunk async for chunk in response.body]))

    return lambda path, body: tiny_engine.loop.run(answer(path, body))


async def _run(job_id: str, job: dict) -> list:
    return [item async for item in handler.handler({"id": job_id, "input": job})]


async def _until(condition) -> None:
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_request_that_can_never_fit_is_refused_at_once_and_nothing_in_flight_is_lost(
            gated, tiny_engine, tiny_openai, monkeypatch):
    budget, gate = gated
    monkeypatch.setattr(handler, "openai_engine", tiny_openai)
    long_job = {"prompt": "Once upon a time", "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}
    never = {  # one sequence of each above the 10 blocks the whole budget holds
        "raw, 1,500 tokens": {"prompt": "Once upon a time", "sampling_params": {"max_tokens": 1500}},
        "raw, n=2, 1,500 tokens": {"prompt": "Once upon a time", "sampling_params": {"n": 2, "max_tokens": 1500}},
        "streamed completions, 1,500 tokens": _completions(tiny_openai, max_tokens=1500, stream=True),
        "completions, 1,500 tokens": _completions(tiny_openai, max_tokens=1500),
    }

    async def scenario() -> tuple[list, list, dict, tuple]:
        running = asyncio.create_task(_run("fit-0", long_job))  # 9 blocks
        await _until(lambda: budget.admitted == 1)
        waiting = asyncio.create_task(_run("fit-1", long_job))  # waits for the first one's room
        await _until(lambda: gate.waiting == 1)
        refused = {case: _refusal(await _run(f"never-{i}", job))
                   for i, (case, job) in enumerate(never.items())}
        during = (budget.admitted, gate.waiting)  # the refusals did not wait for them
        return await running, await waiting, refused, during

    first, second, refused, during = asyncio.run(scenario())
    assert during == (1, 1)
    for case, (code, param, message) in refused.items():
        assert code == 400 and "can never fit the worker's KV cache" in message and param == "max_tokens", case
    assert "one sequence needs about 12 blocks of 128 tokens as planned, and the whole cache holds 10" \
        in refused["raw, n=2, 1,500 tokens"][2]
    assert first[0]["usage"]["output"] == second[0]["usage"]["output"] == 1000  # nothing in flight lost
    assert (budget.used, budget.admitted, gate.waiting) == (0, 0, 0)
    # A load-balancing endpoint's routes and jobs: the same 400, a stream's before it starts.
    call = _load_balancer(tiny_engine, tiny_openai)
    status, body = call("/v1/completions", never["streamed completions, 1,500 tokens"]["openai_input"])
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = call("/runsync", {"input": never["raw, n=2, 1,500 tokens"]})
    assert (status, body["status"]) == (400, "FAILED")
    assert "can never fit" in json.loads(body["error"])["message"]


def test_a_request_whose_sequences_fit_only_one_by_one_waits_then_runs_alone_and_completes(
        gated, tiny_openai, monkeypatch):
    """n=11 sequences of a block each in a budget of 10: each fits, so it is served, not refused (vLLM
    runs a request's sequences as they fit); it enters once the cache is empty."""
    budget, gate = gated
    monkeypatch.setattr(handler, "openai_engine", tiny_openai)
    long_job = {"prompt": "Once upon a time", "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}

    async def scenario() -> tuple[list, list]:
        running = asyncio.create_task(_run("before-wide", long_job))  # 9 blocks
        await _until(lambda: budget.admitted == 1)
        wide = asyncio.create_task(_run("wide", _completions(tiny_openai, n=11, max_tokens=64)))
        await _until(lambda: gate.waiting == 1)
        return await running, await wide

    first, (completion,) = asyncio.run(scenario())
    assert first[0]["usage"]["output"] == 1000
    assert len(completion["choices"]) == 11 and completion["usage"]["completion_tokens"] == 11 * 64
    assert (budget.used, budget.admitted, gate.waiting) == (0, 0, 0)


def test_n_above_max_n_is_refused_naming_it(gated, tiny_engine, tiny_openai, monkeypatch):
    _, gate = gated
    monkeypatch.setattr(gate, "max_n", 4, raising=False)
    monkeypatch.setattr(handler, "openai_engine", tiny_openai)
    jobs = {"raw": {"prompt": "Once upon a time", "sampling_params": {"n": 5, "max_tokens": 2}},
            "completions": _completions(tiny_openai, n=5, max_tokens=2, stream=True)}
    for case, job in jobs.items():
        code, param, message = _refusal(asyncio.run(_run(case, job)))
        assert (code, param) == (400, "n") and message.startswith("n=5 is above MAX_N=4"), case
    call = _load_balancer(tiny_engine, tiny_openai)
    status, body = call("/v1/completions", jobs["completions"]["openai_input"])
    assert status == 400 and body["error"]["message"].startswith("n=5 is above MAX_N=4")
    (item,) = asyncio.run(_run("four", {"prompt": "Once", "sampling_params": {"n": 4, "max_tokens": 2}}))
    assert len(item["choices"]) == 4  # at MAX_N: served
