"""Load through the local endpoint and the real runpod worker loop: mixed raw and OpenAI jobs,
streaming and not, submitted in bursts to one worker with a fixed concurrency of 30. Every job
completes exactly once with well-formed output, the worker fills its 30 slots, and its memory
does not grow across the second half.

CI runs 100 jobs. The long run (figures printed as JSON)::

    LOAD_JOBS=1000 scripts/test.sh tests/endpoint/test_load.py -n 0 -s --timeout=0
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from dataclasses import dataclass, field

import pytest
from conftest import wait_for
from local_endpoint import LocalEndpoint, worker_pids

JOBS = int(os.environ.get("LOAD_JOBS", "100"))
CONCURRENCY = 30
BURST = 50
KINDS = ["raw", "raw-stream", "chat", "chat-stream", "completions-stream", "messages"]


def job_input(kind: str, model: str, tokens: int) -> dict:
    sampling = {"max_tokens": tokens, "ignore_eos": True}
    chat = [{"role": "user", "content": "Tell me a story."}]
    if kind.startswith("raw"):
        return {"prompt": "Once upon a time", "sampling_params": sampling, "stream": kind == "raw-stream"}
    route, body = {
        "chat": ("/v1/chat/completions", {"messages": chat, **sampling}),
        "chat-stream": ("/v1/chat/completions", {"messages": chat, "stream": True,
                                                 "stream_options": {"include_usage": True}, **sampling}),
        "completions-stream": ("/v1/completions", {"prompt": "x", "stream": True,
                                                   "stream_options": {"include_usage": True}, **sampling}),
        "messages": ("/v1/messages", {"messages": chat, "max_tokens": tokens}),
    }[kind]
    return {"openai_route": route, "openai_input": {"model": model, **body}}


def sse_usage(output: list[str]) -> dict:
    """The usage in the last data event of a streamed OpenAI job (RAW_OPENAI_OUTPUT text)."""
    text = "".join(output)
    assert text.endswith("data: [DONE]\n\n")
    events = [json.loads(line[5:]) for line in text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    return events[-1]["usage"]


def output_tokens(kind: str, output: list) -> int:
    """Generated tokens reported by a well-formed output of this kind (asserts its shape)."""
    if kind == "raw":
        (item,) = output
        return item["usage"]["output"]
    if kind == "raw-stream":
        assert all(set(item) == {"choices", "usage"} for item in output)
        return output[-1]["usage"]["output"]
    if kind.endswith("-stream"):
        return sse_usage(output)["completion_tokens"]
    (body,) = output
    if kind == "messages":
        assert body["type"] == "message" and body["content"][0]["type"] == "text"
        return body["usage"]["output_tokens"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    return body["usage"]["completion_tokens"]


@dataclass
class Samples:
    """Worker RSS and the endpoint's queue, sampled while the load runs."""
    rss_mb: list[tuple[int, float]] = field(default_factory=list)  # (jobs finished, MB)
    busy: list[int] = field(default_factory=list)  # jobs held by the worker while others queue
    stop: threading.Event = field(default_factory=threading.Event)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) / 1024


def sample(endpoint: LocalEndpoint, pid: int, samples: Samples) -> None:
    while not samples.stop.wait(0.1):
        jobs = endpoint.http.get("/health").json()["jobs"]
        samples.rss_mb.append((jobs["completed"] + jobs["failed"], rss_mb(pid)))
        if jobs["inQueue"]:
            samples.busy.append(jobs["inProgress"])


def percentile(ordered: list[float], q: float) -> float:
    return round(ordered[round(q * (len(ordered) - 1))], 2)


@pytest.fixture(scope="module")
def endpoint(tiny_env, tmp_path_factory):
    fixed = {"MIN_CONCURRENCY": str(CONCURRENCY), "MAX_CONCURRENCY": str(CONCURRENCY)}  # the job loop's fill, not the controller's choice
    local = LocalEndpoint({**tiny_env, **fixed}, 1,
                          tmp_path_factory.mktemp("load") / "endpoint.log")
    yield local
    local.stop()


def submit_in_bursts(endpoint: LocalEndpoint, model: str) -> dict[str, tuple[str, int]]:
    """Job id → (kind, max_tokens); a burst of BURST jobs every second."""
    jobs = {}
    for i in range(JOBS):
        kind, tokens = KINDS[i % len(KINDS)], 8 + (i * 7) % 57
        job = endpoint.http.post("/run", json={"input": job_input(kind, model, tokens)}).json()
        jobs[job["id"]] = (kind, tokens)
        if (i + 1) % BURST == 0:
            time.sleep(1)
    return jobs


def test_mixed_jobs_in_bursts_complete_exactly_once(endpoint, tiny_env):
    model = tiny_env["MODEL_NAME"]
    base = endpoint.http.get("/health").json()["jobs"]
    samples = Samples()
    sampler = threading.Thread(target=sample, args=(endpoint, worker_pids(endpoint)["local-worker-0"],
                                                    samples))
    sampler.start()
    started = time.monotonic()
    jobs = submit_in_bursts(endpoint, model)

    def finished() -> int:
        now = endpoint.http.get("/health").json()["jobs"]
        return sum(now[k] - base[k] for k in ("completed", "failed", "cancelled"))

    wait_for(lambda: finished() >= JOBS, 60 + JOBS)
    wall = time.monotonic() - started
    samples.stop.set()
    sampler.join()

    statuses = {job_id: endpoint.http.get(f"/status/{job_id}").json() for job_id in jobs}
    assert {s["status"] for s in statuses.values()} == {"COMPLETED"}
    for job_id, (kind, tokens) in jobs.items():
        generated = output_tokens(kind, statuses[job_id]["output"])
        assert generated == tokens or (kind == "messages" and 1 <= generated <= tokens), (kind, generated)
    assert finished() == JOBS  # no job reported twice
    wait_for(lambda: all(f"{job_id} | Finished." in endpoint.log() for job_id in jobs), 10)
    log = endpoint.log()
    assert all(log.count(f"{job_id} | Finished.") == 1 for job_id in jobs)

    peak = max(int(n) for n in re.findall(r"Jobs in progress: (\d+)", log))
    assert peak == CONCURRENCY
    half = [mb for done, mb in samples.rss_mb if done >= JOBS // 2]
    assert half[-1] <= half[0] * 1.10, f"worker RSS grew from {half[0]:.0f} to {half[-1]:.0f} MB"

    latencies = sorted((s["delayTime"] + s["executionTime"]) / 1000 for s in statuses.values())
    executions = sorted(s["executionTime"] / 1000 for s in statuses.values())
    print("load figures:", json.dumps({
        "jobs": JOBS, "wall_s": round(wall, 1), "jobs_per_s": round(JOBS / wall, 2),
        "output_tokens_per_s": round(sum(t for _, t in jobs.values()) / wall),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
        "execution_p50_s": percentile(executions, 0.5), "execution_p99_s": percentile(executions, 0.99),
        "peak_concurrency": peak,
        "mean_held_while_queued": round(statistics.mean(samples.busy), 1) if samples.busy else None,
        "rss_mb": {"start": round(samples.rss_mb[0][1]), "half": round(half[0]),
                   "end": round(half[-1]), "max": round(max(mb for _, mb in samples.rss_mb))},
    }))
