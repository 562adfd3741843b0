"""Adaptive concurrency with whole workers behind the local endpoint: real engines, the real runpod
SDK, jobs through RunPod's job API. Each worker runs under bench/trace_worker.py, which records what
its concurrency controller saw after every engine step (jobs held, target, vLLM's running and
waiting requests, KV-cache usage, requests started, finished and preempted; bench/load_trace.py).

- Two workers share a burst of 200 jobs: both take work at once, and neither lets its engine queue
  jobs while the other has free slots.
- One worker with a KV cache too small for the jobs it is given: the jobs it holds settle at what
  fits, later bursts preempt a few requests at most (the first finds the limit by preempting), and
  every job completes.

``-s`` prints each worker's jobs held and vLLM's waiting requests over time.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import engine_env
from local_endpoint import API_KEY, LocalEndpoint

from bench.load_trace import (TRACE_WORKER, failures, queued_while_others_had_room, raw_job, read_all, report,
                              run_burst, trace_env)
from worker.scheduling.concurrency import GROWTH, START

BLOCK = 128  # tokens per KV-cache block on the CPU


def traced_endpoint(env: dict[str, str], workers: int, folder: Path) -> LocalEndpoint:
    # Two engines on the same two cores would slow each other by seconds at a burst's start.
    return LocalEndpoint({**env, **trace_env(folder, pin_engines=workers > 1)}, workers,
                         folder / "endpoint.log", handler=str(TRACE_WORKER))


def burst(endpoint: LocalEndpoint, count: int, tokens: int) -> tuple[float, list[dict]]:
    submitted, statuses = run_burst(endpoint.base, count, raw_job(tokens),
                                    {"Authorization": f"Bearer {API_KEY}"})
    assert not failures(statuses, tokens), failures(statuses, tokens)[:3]
    return submitted, statuses


# --- two workers, one burst ---------------------------------------------------------------------


BURST, BURST_TOKENS = 200, 64


@pytest.fixture(scope="module")
def two_workers(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("two-workers")
    endpoint = traced_endpoint(engine_env(models["tiny-llama"]), 2, folder)
    yield endpoint, folder
    endpoint.stop()


def test_two_workers_share_a_burst_and_neither_queues_while_the_other_has_room(two_workers):
    endpoint, folder = two_workers
    submitted, statuses = burst(endpoint, BURST, BURST_TOKENS)
    traces = read_all(folder, since=submitted)
    print(f"\n{BURST} jobs at once on two workers:\n{report(traces, submitted)}")
    assert len(traces) == 2
    # Both take work at once: each one's first job started within 1 s of its submission, and each
    # ran at least the jobs it takes before its engine has said anything.
    by_worker = {worker: [s for s in statuses if s["workerId"] == worker] for worker in traces}
    assert all(len(jobs) >= START for jobs in by_worker.values()), {w: len(j) for w, j in by_worker.items()}
    assert all(min(s["delayTime"] for s in jobs) < 1000 for jobs in by_worker.values())
    # Neither engine queues jobs (requests waiting, none starting, PATIENCE steps in a row) while
    # the other worker holds fewer jobs than its target.
    assert not queued_while_others_had_room(traces)


# --- a small KV cache ---------------------------------------------------------------------------


# 32 blocks of 128 tokens, one of them vLLM's null block; a job of 11 prompt tokens and 240 more
# ends on its 2nd block: 15 fit whole, 31 fit as they start (vLLM admits a request whose prompt fits).
KV_BYTES, LONG_TOKENS, LONG_JOBS = 4 * 2**20, 240, 64


@pytest.fixture(scope="module")
def small_kv_worker(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("small-kv")
    env = engine_env(models["tiny-llama"], KV_CACHE_MEMORY_BYTES=str(KV_BYTES))
    endpoint = traced_endpoint(env, 1, folder)
    yield endpoint, folder
    endpoint.stop()


# Fails about one run in two, at 56593c5 as now: the first burst finds the limit by preempting,
# and when the target has not fallen to what fits by its end, the second burst is taken whole
# and preempted again. Admitting what fits without probing is issue 30, which removes this mark.
@pytest.mark.xfail(strict=False, reason="issue 30: the first burst probes the KV limit by preempting")
def test_on_a_small_kv_cache_the_jobs_held_settle_at_what_fits(small_kv_worker):
    endpoint, folder = small_kv_worker
    kv_tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", endpoint.log())[1].replace(",", ""))
    first_submitted, first = burst(endpoint, LONG_JOBS, LONG_TOKENS)
    second_submitted, _ = burst(endpoint, LONG_JOBS // 2, LONG_TOKENS)
    prompt = first[0]["output"][0]["usage"]["input"]
    blocks = kv_tokens // BLOCK - 1  # less vLLM's null block: as many requests fit as they start
    fits = blocks // math.ceil((prompt + LONG_TOKENS) / BLOCK)
    (trace,) = read_all(folder).values()
    preempted_first = sum(s.preempted for s in trace if first_submitted <= s.at < second_submitted)
    later = [s for s in trace if s.at >= second_submitted]
    preempted_later = sum(s.preempted for s in later)
    print(f"\n{LONG_JOBS}, then {LONG_JOBS // 2} jobs of {prompt}+{LONG_TOKENS} tokens on {kv_tokens} tokens "
          f"of KV cache ({fits} fit whole):\n{report({'worker': trace}, first_submitted, every=1.0)}\n"
          f"preempted: {preempted_first} in the first burst, {preempted_later} in the second")
    # The first burst finds the limit by preemption. After it, a round's KV peak can still
    # underestimate what requests of different ages need, so a rise may pass the limit by a job or
    # two and cost a preemption or so before the target falls back (a run saw 16, 1, then 15).
    assert preempted_first > 0
    assert preempted_later <= preempted_first // 4
    # Held jobs stay near what fits whole, well below what fits as they start (vLLM admits a request
    # whose prompt fits: what `vllm serve` would run), and settle there, not collapsed.
    assert max(s.held for s in later) <= fits * GROWTH < blocks
    assert fits // 2 <= later[-1].target <= fits * GROWTH
