"""Item 20: under KV pressure, beside ``vllm serve`` (``src/worker/scheduling/concurrency.py``,
``src/worker/engine/admission.py``).

vLLM's load generator (as item 6: random 64 tokens in, ``KV_OUTPUT_TOKENS`` out, ``--ignore-eos``,
``KV_PROMPTS`` chats) at ``KV_CONCURRENCY`` concurrent requests, SmolLM2 in its own dtype (bfloat16),
with the same KV budget on both sides (``KV_BYTES``: 86 blocks of 128 tokens, about 43 requests whole):
one worker behind the local endpoint with no added job-take delay, one with ``TAKE_DELAY`` s (RunPod's
queue is a network round trip away), and ``vllm serve``. Each repetition starts each side afresh and
runs each concurrency in turn on it: the first run's burst meets an engine that has seen no request
yet. Figures: median TTFT, p99 end-to-end latency and output tokens/s, worker ÷ ``vllm serve``;
preemptions per run (the worker's from its controller's trace, ``vllm serve``'s from its /metrics).
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import httpx

from bench import load_trace
from bench.common import Plan, Results, in_turn, model_env
from bench.job_start import vllm_bench_result
from bench.servers import Endpoint, Server, VllmServe

ITEM = "20 under KV pressure (vllm bench)"
KV_BYTES = "256m"  # SmolLM2 in bfloat16: 11,008 tokens, 86 blocks of 128
KV_CONCURRENCY, KV_PROMPTS, KV_OUTPUT_TOKENS = (64, 128), 128, 128
TAKE_DELAY = 0.1  # seconds: an assumed RunPod job-take round trip
SERVE = "vllm serve"
QUICK_CONCURRENCY = (16,)


def _workers() -> dict[str, float]:
    """The worker's sides: name → the endpoint's job-take delay."""
    return {"worker, 0 ms job take": 0.0, f"worker, {TAKE_DELAY * 1000:.0f} ms job take": TAKE_DELAY}


def run(plan: Plan, results: Results) -> None:
    """Item 20; the quick plan runs the tiny model on a cache of 4 MiB at 16."""
    quick = plan.latency_model == "tiny-llama"
    env = {**model_env(plan.latency_model, plan), "KV_CACHE_MEMORY_BYTES": "4m" if quick else KV_BYTES,
           "DISABLE_LOG_STATS": "false"}  # vllm serve reports its preemptions through its statistics
    env.pop("MAX_CONCURRENCY")
    env.pop("DTYPE", None)  # the model's own (bfloat16), for which the budget is sized
    load = (QUICK_CONCURRENCY, plan.max_tokens) if quick else (KV_CONCURRENCY, KV_OUTPUT_TOKENS)
    for rep in range(plan.reps):
        runs = {name: lambda delay=delay: _on_a_fresh_worker(env, delay, *load)
                for name, delay in _workers().items()}
        runs[SERVE] = lambda: _on_fresh_vllm_serve(env, *load)
        done = in_turn(rep, runs)
        for i, n in enumerate(load[0]):
            _record(plan.latency_model, n, {name: by_n[i] for name, by_n in done.items()}, results)


def _on_a_fresh_worker(env: dict[str, str], delay: float, concurrency: tuple[int, ...],
                       output_tokens: int) -> list[dict]:
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-pressure-"))
    worker = Endpoint({**env, **load_trace.trace_env(logs)}, logs / "worker.log",
                      handler=load_trace.TRACE_WORKER, job_take_delay=delay)
    try:
        found = []
        for n in concurrency:
            since = time.time()
            result = _bench(worker, env, n, output_tokens)
            trace = [s for t in load_trace.read_all(logs, since=since).values() for s in t]
            found.append({**result, "preempted": sum(s.preempted for s in trace),
                          "held": max(s.held for s in trace), "running": max(s.running for s in trace)})
        return found
    finally:
        worker.stop()


def _on_fresh_vllm_serve(env: dict[str, str], concurrency: tuple[int, ...], output_tokens: int) -> list[dict]:
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-pressure-"))
    serve = VllmServe(env, logs / "vllm-serve.log")
    try:
        found = []
        for n in concurrency:
            before = _preemptions(serve)
            result = _bench(serve, env, n, output_tokens)
            found.append({**result, "preempted": _preemptions(serve) - before})
        return found
    finally:
        serve.stop()


def _bench(server: Server, env: dict[str, str], n: int, output_tokens: int) -> dict:
    return vllm_bench_result(server, env["MODEL_NAME"], n, KV_PROMPTS, output_tokens)


def _preemptions(serve: VllmServe) -> int:
    text = httpx.get(serve.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^vllm:num_preemptions_total(?:{[^}]*})? (\S+)$", text,
                                                 re.MULTILINE)))


def _record(model: str, n: int, runs: dict[str, dict], results: Results) -> None:
    serve = runs[SERVE]
    for name, run in runs.items():
        results.figure(ITEM, model, f"preempted, {name} @{n}", "requests").values.append(run["preempted"])
        for key, label in (("median_ttft_ms", "median TTFT"), ("p99_ttft_ms", "p99 TTFT"),
                           ("median_tpot_ms", "median TPOT"), ("p99_e2el_ms", "p99 end-to-end")):
            results.figure(ITEM, model, f"{label}, {name} @{n}", "ms").values.append(run[key])
        results.figure(ITEM, model, f"output tokens/s, {name} @{n}", "tokens/s").values.append(
            run["output_throughput"])
        if name == SERVE:
            continue
        results.figure(ITEM, model, f"most jobs held, {name} @{n}", "jobs").values.append(run["held"])
        results.figure(ITEM, model, f"most requests vLLM ran, {name} @{n}", "requests").values.append(
            run["running"])
        for key, label, goal in (("median_ttft_ms", "median TTFT", ("≤", 1.1)),
                                 ("p99_e2el_ms", "p99 end-to-end", ("≤", 1.0)),
                                 ("output_throughput", "output tokens/s", ("≥", 1.0))):
            results.figure(ITEM, model, f"{label} worker ÷ vllm serve, {name} @{n}", goal=goal).values.append(
                run[key] / serve[key])
        results.figure(ITEM, model, f"preemptions worker ÷ vllm serve, {name} @{n}",
                       goal=("≤", 0.1)).values.append(run["preempted"] / max(1, serve["preempted"]))
