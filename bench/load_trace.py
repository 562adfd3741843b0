"""What a worker's concurrency controller saw, step by step (``LOAD_TRACE_FILE`` of
``bench/trace_worker.py``), and bursts of raw jobs through the local endpoint's job API: shared by
the bench's items 14-15 and tests/endpoint/test_adaptive_concurrency.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import REPO  # (puts src/ on the path)
from worker.scheduling.concurrency import PATIENCE

TRACE_WORKER = REPO / "bench" / "trace_worker.py"
HANDLER = REPO / "src" / "handler.py"


def trace_env(folder: Path, pin_engines: bool = False) -> dict[str, str]:
    """The environment that makes ``TRACE_WORKER`` run the worker and record a trace per worker in
    ``folder`` (``<worker id>.trace``); ``pin_engines``: each worker's engine on a core of its own."""
    return {"TRACE_TARGET": str(HANDLER), "LOAD_TRACE_FILE": str(folder / "{worker}.trace"),
            **({"TRACE_PIN_ENGINE": "1"} if pin_engines else {})}


@dataclass(frozen=True)
class Sample:
    """What one worker's controller saw after one engine step."""

    at: float  # time.time()
    held: int
    target: int
    running: int
    waiting: int
    kv_usage: float
    started: int
    finished: int
    preempted: int


def read(path: Path, since: float = 0.0) -> list[Sample]:
    """The samples of one trace file, from ``since`` on."""
    rows = [line.split() for line in path.read_text().splitlines()]
    found = [Sample(float(r[0]), *map(int, r[1:5]), float(r[5]), *map(int, r[6:])) for r in rows]
    return [sample for sample in found if sample.at >= since]


def read_all(folder: Path, since: float = 0.0) -> dict[str, list[Sample]]:
    """Every worker's samples, by worker id."""
    return {path.stem: read(path, since) for path in sorted(folder.glob("*.trace"))}


def at(trace: list[Sample], when: float) -> Sample | None:
    """The worker's latest sample at ``when``."""
    earlier = [sample for sample in trace if sample.at <= when]
    return earlier[-1] if earlier else None


def stalls(trace: list[Sample]) -> list[Sample]:
    """Samples ending ``PATIENCE`` steps in a row with requests waiting and none starting: the
    engine queued jobs (the controller's own reading)."""
    found, run = [], 0
    for sample in trace:
        run = run + 1 if sample.waiting and not (sample.started or sample.preempted) else 0
        if run >= PATIENCE:
            found.append(sample)
    return found


def queued_while_others_had_room(traces: dict[str, list[Sample]]) -> list[tuple[str, Sample]]:
    """Steps where a worker's engine queued jobs while another worker held fewer than its target."""
    found = []
    for worker, trace in traces.items():
        others = [t for w, t in traces.items() if w != worker]
        for stall in stalls(trace):
            if any((there := at(other, stall.at)) and there.held < there.target for other in others):
                found.append((worker, stall))
    return found


def report(traces: dict[str, list[Sample]], since: float, every: float = 0.25) -> str:
    """Each worker's jobs held / target and vLLM's waiting requests, every ``every`` seconds."""
    end = max(sample.at for trace in traces.values() for sample in trace)
    lines = ["    t  " + "  ".join(f"{worker:>24}" for worker in traces)]
    moment = since
    while moment <= end + every:
        cells = [f"held {s.held:3}/{s.target:<3} waiting {s.waiting:3}" if (s := at(trace, moment))
                 else " " * 24 for trace in traces.values()]
        lines.append(f"{moment - since:6.2f} " + "  ".join(cells))
        moment += every
    return "\n".join(lines)


def raw_job(max_tokens: int) -> dict:
    return {"prompt": "Once upon a time", "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}


def run_burst(base: str, count: int, job: dict,
              headers: dict[str, str] | None = None) -> tuple[float, list[dict]]:
    """``count`` jobs submitted at once to the endpoint at ``base`` (``…/v2/<id>``): when they were
    submitted (time.time()), and each one's final ``/status``, in order."""

    async def burst() -> tuple[float, list[dict]]:
        async with httpx.AsyncClient(base_url=base, timeout=120, headers=headers,
                                     limits=httpx.Limits(max_connections=count)) as client:
            submitted = time.time()
            answers = await asyncio.gather(*(client.post("/run", json={"input": job}) for _ in range(count)))
            ids = [answer.json()["id"] for answer in answers]
            statuses: dict[str, dict] = {}
            while len(statuses) < count:
                for job_id in set(ids) - set(statuses):
                    status = (await client.get(f"/status/{job_id}")).json()
                    if status["status"] not in ("IN_QUEUE", "IN_PROGRESS"):
                        statuses[job_id] = status
                await asyncio.sleep(0.2)
            return submitted, [statuses[job_id] for job_id in ids]

    return asyncio.run(burst())


def failures(statuses: list[dict], tokens: int) -> list[dict]:
    """The jobs that did not complete with ``tokens`` output tokens."""
    return [s for s in statuses if s["status"] != "COMPLETED" or s["output"][0]["usage"]["output"] != tokens]
