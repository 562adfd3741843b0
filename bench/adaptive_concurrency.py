"""Items 13-16: how many jobs a worker holds (``src/worker/scheduling/concurrency.py``).

13. vLLM's load generator (as item 6) at ``Plan.adaptive_concurrency`` concurrent requests through the
    local endpoint and a worker with its default settings (adaptive) ÷ ``vllm serve``; beside them a worker
    holding worker-vllm's fixed 30 (``MIN_CONCURRENCY`` = ``MAX_CONCURRENCY`` = 30), as before. Both sides
    get a KV cache that holds every request at once (``KV_FOR_ALL``), as a GPU's holds this small model's.
14. Two workers on one endpoint (the tiny model), a burst of ``BURST`` jobs on fresh workers, then another:
    how soon each worker took work, how many each ran, and the steps in which one engine queued jobs while
    the other worker had free slots; jobs held, target and vLLM's waiting requests over time (chart).
15. A KV cache too small for the jobs given (the tiny model, ``SMALL_KV`` bytes): bursts of long
    completions on one worker and on ``vllm serve``: preemptions, output tokens/s, time to first token and
    latency per burst; jobs held and vLLM's running and waiting requests over time (chart).
16. What the controller costs: CPU time per output token of the engine's front end (this process: vLLM's
    output handler and the client) and of its engine core, with the controller's feed ÷ without; with vLLM's
    statistics off (``DISABLE_LOG_STATS``, as the bench runs) and on (vLLM's default), where "before" keeps
    vLLM's Prometheus logger, which the worker now drops.

Items 14 and 15 run the worker under ``bench/trace_worker.py``, which records what its controller saw after
each engine step (``bench/load_trace.py``).
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench import load_trace
from bench.common import REPO, Load, Plan, Results, in_turn, model_env
from bench.job_start import vllm_bench
from bench.servers import Endpoint, Server, VllmServe

ADAPTIVE, FIXED, SERVE = "worker (adaptive)", "worker (fixed 30)", "vllm serve"
KV_FOR_ALL = "2g"  # SmolLM2 in float32: 46 KB a token, 364 blocks of 128: 182 requests of 2 blocks
BURST, BURST_TOKENS = 200, 64  # item 14
SMALL_KV, LONG_TOKENS, LONG_JOBS, LONG_BURSTS = 4 * 2**20, 240, 64, 3  # item 15: 15 requests fit whole
METRICS_SECONDS = 0.25  # item 15: how often vllm serve's gauges are read
LATER_PREEMPTIONS = 4  # item 15: a rise past the limit may preempt a few; preempting in a loop, dozens
COST_CONFIGS = {  # item 16: DISABLE_LOG_STATS, the feed, vLLM's Prometheus logger kept
    "statistics off, no feed": ("true", False, False),
    "statistics off, feed": ("true", True, False),
    "statistics on, Prometheus (before)": ("false", False, True),
    "statistics on, feed, no Prometheus": ("false", True, False)}


def _tiny_env(plan: Plan, **extra: str) -> dict[str, str]:
    """The tiny model with the worker's default concurrency (no MAX_CONCURRENCY)."""
    env = {**model_env("tiny-llama", plan), **extra}
    env.pop("MAX_CONCURRENCY")
    return env


# --- item 13: vllm bench at 16, 64 and 128 --------------------------------------------------------


def goals(plan: Plan, results: Results) -> None:
    model = plan.latency_model
    env = {**model_env(model, plan), "KV_CACHE_MEMORY_BYTES": KV_FOR_ALL}
    env.pop("MAX_CONCURRENCY")
    logs = Path(tempfile.mkdtemp(prefix="bench-concurrency-"))
    servers: dict[str, Server] = {}
    try:
        servers[ADAPTIVE] = Endpoint(env, logs / "adaptive.log")
        fixed = {"MIN_CONCURRENCY": "30", "MAX_CONCURRENCY": "30"}
        servers[FIXED] = Endpoint({**env, **fixed}, logs / "fixed.log")
        servers[SERVE] = VllmServe(env, logs / "vllm-serve.log")
        path, top = env["MODEL_NAME"], max(plan.adaptive_concurrency)
        for server in servers.values():  # first-use costs; the adaptive worker ramps up here (item 14)
            vllm_bench(server, path, top, top, 8)
        for rep in range(plan.reps):
            for n in plan.adaptive_concurrency:
                runs = {name: lambda s=server, n=n: vllm_bench(s, path, n, max(16, 2 * n), plan.max_tokens)
                        for name, server in servers.items()}
                _record_goal_loads(model, n, in_turn(rep, runs), results)
    finally:
        for server in servers.values():
            server.stop()


def _record_goal_loads(model: str, n: int, loads: dict[str, Load], results: Results) -> None:
    item = "13 concurrency (vllm bench)"
    serve = loads[SERVE]
    for path, load in loads.items():
        results.concurrency_loads.setdefault((model, path, n), []).append(load)
    for path, suffix in ((ADAPTIVE, ""), (FIXED, " (fixed 30, before)")):
        adaptive = path == ADAPTIVE
        results.figure(item, model, f"TTFT worker ÷ vllm serve @{n}{suffix}",
                       goal=("≤", 1.1) if adaptive else None).values.append(loads[path].ttft / serve.ttft)
        results.figure(item, model, f"tokens/s worker ÷ vllm serve @{n}{suffix}",
                       goal=("≥", 1.0) if adaptive else None).values.append(
            loads[path].tokens_per_s / serve.tokens_per_s)


# --- item 14: two workers, one burst ----------------------------------------------------------------


def two_workers(plan: Plan, results: Results) -> None:
    item = "14 two workers, a burst"
    for rep in range(plan.reps):
        logs = Path(tempfile.mkdtemp(prefix="bench-two-workers-"))
        endpoint = Endpoint({**_tiny_env(plan), **load_trace.trace_env(logs, pin_engines=True)},
                            logs / "endpoint.log", handler=load_trace.TRACE_WORKER, workers=2)
        try:
            base = endpoint.base_url.removesuffix("/openai/v1")
            for burst in ("fresh workers", "again"):
                submitted, statuses = load_trace.run_burst(base, BURST, load_trace.raw_job(BURST_TOKENS))
                if wrong := load_trace.failures(statuses, BURST_TOKENS):
                    raise RuntimeError(f"item 14: {len(wrong)} jobs failed, first {wrong[0]}")
                traces = load_trace.read_all(logs, since=submitted)
                if rep == 0:
                    results.series[f"{item}, {burst}"] = {
                        worker: _relative(trace, submitted) for worker, trace in traces.items()}
                first = {w: min(s["delayTime"] for s in statuses if s["workerId"] == w) for w in traces}
                taken = sorted(sum(s["workerId"] == w for s in statuses) for w in traces)
                results.figure(item, "tiny-llama", f"the later worker's first job, {burst}", "ms",
                               goal=("≤", 1000)).values.append(max(first.values()))
                results.figure(item, "tiny-llama", f"jobs the busier worker ran, of {BURST}, {burst}",
                               "jobs").values.append(taken[-1])
                results.figure(item, "tiny-llama",
                               f"steps an engine queued while the other had room, {burst}", "steps",
                               goal=("≤", 0)).values.append(
                    len(load_trace.queued_while_others_had_room(traces)))
        finally:
            endpoint.stop()


def _relative(trace: list[load_trace.Sample], since: float) -> list[tuple]:
    """(seconds since ``since``, held, target, running, waiting, KV usage, preempted) per step."""
    return [(s.at - since, s.held, s.target, s.running, s.waiting, s.kv_usage, s.preempted) for s in trace]


# --- item 15: a small KV cache -----------------------------------------------------------------------


@dataclass(frozen=True)
class Burst:
    wall: float
    tokens_per_s: float
    ttft: float  # median, seconds
    latency: float  # median, seconds
    preempted: int


def small_kv(plan: Plan, results: Results) -> None:
    item = "15 small KV cache"
    logs = Path(tempfile.mkdtemp(prefix="bench-small-kv-"))
    # Both sides collect vLLM's statistics: the worker's controller needs them, vllm serve reports
    # its preemptions and load through them (/metrics).
    env = _tiny_env(plan, KV_CACHE_MEMORY_BYTES=str(SMALL_KV), DISABLE_LOG_STATS="false")
    env.pop("DTYPE", None)  # its own (bfloat16), for which SMALL_KV is sized
    bursts: dict[str, list[Burst]] = {}
    worker = Endpoint({**env, **load_trace.trace_env(logs)}, logs / "worker.log",
                      handler=load_trace.TRACE_WORKER)
    try:
        started = time.time()
        bursts[ADAPTIVE] = [_long_burst(worker, lambda: _worker_preempted(logs)) for _ in range(LONG_BURSTS)]
        results.series[f"{item}, {ADAPTIVE}"] = {
            w: _relative(t, started) for w, t in load_trace.read_all(logs, since=started).items()}
    finally:
        worker.stop()
    serve = VllmServe(env, logs / "vllm-serve.log")
    try:
        poller = _MetricsPoller(serve)
        bursts[SERVE] = [_long_burst(serve, poller.preempted) for _ in range(LONG_BURSTS)]
        results.series[f"{item}, {SERVE}"] = {"vllm serve": poller.stop()}
    finally:
        serve.stop()
    _record_bursts(item, bursts, results)


def _record_bursts(item: str, bursts: dict[str, list[Burst]], results: Results) -> None:
    for path, runs in bursts.items():
        results.figure(item, "tiny-llama", f"preempted in the first burst, {path}", "requests").values.append(
            runs[0].preempted)
        results.figure(item, "tiny-llama", f"preempted per later burst, {path}", "requests",
                       goal=("≤", LATER_PREEMPTIONS) if path == ADAPTIVE else None).values.extend(
            burst.preempted for burst in runs[1:])
    pairs = list(zip(bursts[ADAPTIVE][1:], bursts[SERVE][1:], strict=True))
    for name, value in (("output tokens/s", lambda b: b.tokens_per_s), ("median TTFT", lambda b: b.ttft),
                        ("median latency", lambda b: b.latency)):
        results.figure(item, "tiny-llama", f"{name} worker ÷ vllm serve, later bursts").values.extend(
            value(worker) / value(serve) for worker, serve in pairs)


def _long_burst(server: Server, preempted) -> Burst:
    """``LONG_JOBS`` streamed completions of ``LONG_TOKENS`` tokens at once."""
    model = server.env["MODEL_NAME"]

    async def one(client: httpx.AsyncClient) -> tuple[float, float]:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        sent, first, tokens = time.perf_counter(), None, 0
        async with client.stream("POST", "/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["text"]:
                        first = first or time.perf_counter()
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        if tokens != LONG_TOKENS:
            raise RuntimeError(f"item 15: a stream of {tokens} tokens, expected {LONG_TOKENS}")
        return first - sent, time.perf_counter() - sent

    async def every() -> list[tuple[float, float]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                     limits=httpx.Limits(max_connections=LONG_JOBS)) as client:
            return await asyncio.gather(*(one(client) for _ in range(LONG_JOBS)))

    before, began = preempted(), time.perf_counter()
    streams = asyncio.run(every())
    wall = time.perf_counter() - began
    return Burst(wall, LONG_JOBS * LONG_TOKENS / wall, statistics.median(t for t, _ in streams),
                 statistics.median(latency for _, latency in streams), preempted() - before)


def _worker_preempted(logs: Path) -> int:
    return sum(s.preempted for trace in load_trace.read_all(logs).values() for s in trace)


class _MetricsPoller:
    """vllm serve's running and waiting requests, KV-cache usage and preemptions (its /metrics)."""

    GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
              "kv": "vllm:kv_cache_usage_perc", "preempted": "vllm:num_preemptions_total"}

    def __init__(self, server: VllmServe) -> None:
        self.url = server.base_url.removesuffix("/v1") + "/metrics"
        self.began, self.rows = time.time(), []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def read(self) -> dict[str, float]:
        text = httpx.get(self.url, timeout=10).text
        return {name: sum(float(value) for value in re.findall(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text,
                                                               re.MULTILINE))
                for name, metric in self.GAUGES.items()}

    def preempted(self) -> int:
        return int(self.read()["preempted"])

    def _poll(self) -> None:
        while not self._stopped.wait(METRICS_SECONDS):
            got = self.read()
            # (seconds, held, target, running, waiting, KV usage, preempted): vllm serve holds what it got
            self.rows.append((time.time() - self.began, None, None, int(got["running"]), int(got["waiting"]),
                              got["kv"], int(got["preempted"])))

    def stop(self) -> list[tuple]:
        self._stopped.set()
        self._thread.join()
        return self.rows


# --- item 16: what the feed costs ----------------------------------------------------------------------


def cost(plan: Plan, results: Results) -> None:
    item = "16 controller cost"
    model = "tiny-llama"  # the smallest model (_tiny_env): the front end's share of the work is largest
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in COST_CONFIGS}
    for rep in range(plan.reps):
        runs = {name: lambda name=name: _cost_child(name, plan) for name in COST_CONFIGS}
        for name, value in in_turn(rep, runs).items():
            measured[name].append(value)
    # The feed runs in the front end; the engine core's share of the engine's CPU (~90 %) varies by
    # more than the whole front end's between runs, so the cost is the front end's increase.
    off, fed = measured["statistics off, no feed"], measured["statistics off, feed"]
    results.figure(item, model, "front end's CPU the feed adds ÷ the engine's CPU, per token",
                   goal=("≤", 0.01)).values.extend(
        (b["front"] - a["front"]) / a["total"] for a, b in zip(off, fed, strict=True))
    before = measured["statistics on, Prometheus (before)"]
    now = measured["statistics on, feed, no Prometheus"]
    results.figure(item, model, "front end's CPU per token, now ÷ before, statistics on (vLLM's default)"
                   ).values.extend(b["front"] / a["front"] for a, b in zip(before, now, strict=True))
    for name, values in measured.items():
        results.figure(item, model, f"front end's CPU per output token, {name}", "µs").values.extend(
            value["front"] for value in values)
    results.figure(item, model, "the engine's CPU per output token, statistics off, no feed", "µs"
                   ).values.extend(value["total"] for value in off)


def _cost_child(config: str, plan: Plan) -> dict[str, float]:
    argv = [sys.executable, "-m", "bench.adaptive_concurrency", "cost", config, plan.dtype or ""]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"item 16 ({config}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_cost(config: str, dtype: str) -> dict[str, float]:
    """In a process of its own: one engine, 64 streams of 128 tokens, three times; the median CPU time
    per output token of this process (the front end) and of all (with the engine core)."""
    import psutil

    from worker.vllm_adapter import engine as adapter_engine
    from bench.handler_overhead import EnginePaths
    from handler import start_engine
    from worker.config.worker_config import load_config

    disable_log_stats, feed, prometheus = COST_CONFIGS[config]
    if prometheus:
        adapter_engine._drop_prometheus = lambda llm: None
    env = _tiny_env(Plan(dtype=dtype or None), DISABLE_LOG_STATS=disable_log_stats)
    if not feed:
        env.update(MIN_CONCURRENCY="64", MAX_CONCURRENCY="64")  # fixed: no feed
    engine, _ = start_engine(load_config(env))
    try:
        paths, me = EnginePaths(engine), psutil.Process()
        paths.direct(64, 8)
        front, total = [], []
        for _ in range(3):
            processes = [me, *me.children(recursive=True)]
            before = [p.cpu_times() for p in processes]
            paths.direct(64, 128)
            spent = [sum(after[:2]) - sum(b[:2]) for after, b in
                     zip((p.cpu_times() for p in processes), before, strict=True)]
            front.append(spent[0] / (64 * 128) * 1e6)
            total.append(sum(spent) / (64 * 128) * 1e6)
        return {"front": statistics.median(front), "total": statistics.median(total)}
    finally:
        engine.shutdown()


# --- the part ----------------------------------------------------------------------------------------------


def run(plan: Plan, results: Results) -> None:
    """Items 13-16."""
    goals(plan, results)
    two_workers(plan, results)
    small_kv(plan, results)
    cost(plan, results)


if __name__ == "__main__" and sys.argv[1:2] == ["cost"]:
    print(json.dumps(_measure_cost(*sys.argv[2:4])))
