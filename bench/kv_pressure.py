"""Item 20: bursts beyond the KV cache, beside ``vllm serve`` (``src/worker/scheduling/concurrency.py``,
``src/worker/engine/admission.py``).

vLLM's load generator (random 64-token prompts, chats) at 64 and 128 concurrent requests, twice as
many requests as streams, SmolLM2 in its own dtype (bfloat16), with the same KV budget on both sides
(``KV_BYTES``: 86 blocks of 128 tokens, 43 requests whole): two loads whose outputs are forced to
``KV_OUTPUT_TOKENS`` (``--ignore-eos``), and one mixed (prompts and ``max_tokens`` drawn ±75 %
around 64 and ``KV_OUTPUT_TOKENS``, outputs ending where the model ends them). Sides: one worker
behind the local endpoint per ``KV_OVERCOMMIT`` value of ``Plan.kv_overcommit`` (its default, 0: the
gate that lets in only what fits whole; 1: about as many as ``vllm serve`` starts), and ``vllm
serve``. Each repetition starts each side afresh and runs every load in turn on it, the sides in the
order A, B, …, then reversed. Figures: TTFT (median, p99), p99 end-to-end latency and output
tokens/s, worker ÷ ``vllm serve``, with the issue's goals; preemptions per load (the worker's from
its controller's trace, ``vllm serve``'s from its /metrics).
"""

from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import load_trace
from bench.common import Plan, Results, in_turn, model_env
from bench.job_start import vllm_bench_result
from bench.servers import Endpoint, Server, VllmServe

ITEM = "20 bursts beyond the KV cache (vllm bench)"
KV_BYTES = "256m"  # SmolLM2 in bfloat16: 11,008 tokens, 86 blocks of 128
KV_OUTPUT_TOKENS = 128
MIXED_RANGE = 0.75  # the mixed load's lengths: uniform within ±75 % of the stated ones
SERVE = "vllm serve"
# The goals (worker ÷ vllm serve, on the median of the repetitions)
GOALS = {"median_ttft_ms": ("median TTFT", "≤", 1.0), "p99_ttft_ms": ("p99 TTFT", "≤", 1.2),
         "p99_e2el_ms": ("p99 end-to-end", "≤", 0.85), "output_throughput": ("output tokens/s", "≥", 1.15)}


@dataclass(frozen=True)
class Load:
    name: str
    streams: int
    prompts: int
    forced: bool = True  # outputs forced to max_tokens (--ignore-eos)

    def run(self, server: Server, model: str, output_tokens: int) -> dict:
        more = () if self.forced else ("--random-range-ratio", str(MIXED_RANGE))
        return vllm_bench_result(server, model, self.streams, self.prompts, output_tokens, more=more,
                                 ignore_eos=self.forced)


LOADS = (Load("64 streams", 64, 128), Load("128 streams", 128, 256), Load("128 streams, mixed", 128, 256, False))
QUICK_LOADS = (Load("16 streams", 16, 32), Load("16 streams, mixed", 16, 32, False))


def run(plan: Plan, results: Results) -> None:
    """Item 20; the quick plan runs the tiny model on a cache of 4 MiB at 16."""
    quick = plan.latency_model == "tiny-llama"
    env = {**model_env(plan.latency_model, plan), "KV_CACHE_MEMORY_BYTES": "4m" if quick else KV_BYTES,
           "DISABLE_LOG_STATS": "false"}  # vllm serve reports its preemptions through its statistics
    env.pop("MAX_CONCURRENCY")
    env.pop("DTYPE", None)  # the model's own (bfloat16), for which the budget is sized
    loads, tokens = (QUICK_LOADS, plan.max_tokens) if quick else (LOADS, KV_OUTPUT_TOKENS)
    for rep in range(plan.reps):
        runs = {_worker(share): lambda share=share: _on_a_fresh_worker({**env, "KV_OVERCOMMIT": str(share)},
                                                                       loads, tokens)
                for share in plan.kv_overcommit}
        runs[SERVE] = lambda: _on_fresh_vllm_serve(env, loads, tokens)
        done = in_turn(rep, runs)
        for i, load in enumerate(loads):
            _record(plan.latency_model, load, {name: by_load[i] for name, by_load in done.items()}, results)


def _worker(share: float) -> str:
    return f"worker, KV_OVERCOMMIT={share:g}"


def _on_a_fresh_worker(env: dict[str, str], loads: tuple[Load, ...], tokens: int) -> list[dict]:
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-pressure-"))
    worker = Endpoint({**env, **load_trace.trace_env(logs)}, logs / "worker.log",
                      handler=load_trace.TRACE_WORKER, job_take_delay=0.0)
    try:
        found = []
        for load in loads:
            since = time.time()
            result = load.run(worker, env["MODEL_NAME"], tokens)
            trace = [s for t in load_trace.read_all(logs, since=since).values() for s in t]
            found.append({**result, "preempted": sum(s.preempted for s in trace)})
        return found
    finally:
        worker.stop()


def _on_fresh_vllm_serve(env: dict[str, str], loads: tuple[Load, ...], tokens: int) -> list[dict]:
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-pressure-"))
    serve = VllmServe(env, logs / "vllm-serve.log")
    try:
        found = []
        for load in loads:
            before = _preemptions(serve)
            result = load.run(serve, env["MODEL_NAME"], tokens)
            found.append({**result, "preempted": _preemptions(serve) - before})
        return found
    finally:
        serve.stop()


def _preemptions(serve: VllmServe) -> int:
    text = httpx.get(serve.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^vllm:num_preemptions_total(?:{[^}]*})? (\S+)$", text,
                                                 re.MULTILINE)))


def _record(model: str, load: Load, runs: dict[str, dict], results: Results) -> None:
    serve = runs[SERVE]
    for name, run in runs.items():
        results.figure(ITEM, model, f"preempted, {name} @{load.name}", "requests").values.append(run["preempted"])
        for key, label in (("median_ttft_ms", "median TTFT"), ("p99_ttft_ms", "p99 TTFT"),
                           ("median_tpot_ms", "median TPOT"), ("p99_e2el_ms", "p99 end-to-end")):
            results.figure(ITEM, model, f"{label}, {name} @{load.name}", "ms").values.append(run[key])
        results.figure(ITEM, model, f"output tokens/s, {name} @{load.name}", "tokens/s").values.append(
            run["output_throughput"])
        if name == SERVE:
            continue
        for key, (label, sense, bound) in GOALS.items():
            results.figure(ITEM, model, f"{label} worker ÷ vllm serve, {name} @{load.name}",
                           goal=(sense, bound)).values.append(run[key] / serve[key])
