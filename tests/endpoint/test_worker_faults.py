"""Faults under running jobs, through the local endpoint and the real worker loop: a dead engine
makes its worker fail the job and exit non-zero; SIGTERM lets the in-flight job finish."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from test_local_endpoint import LocalEndpoint, descendants, wait_for

LONG = {"prompt": "x", "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}


def worker_pids(endpoint: LocalEndpoint) -> dict[str, int]:
    """Worker id → pid of the endpoint's direct children (the workers), from their environment."""
    pids = {}
    for pid in descendants(endpoint.proc.pid):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as env:
                variables = dict(v.split(b"=", 1) for v in env.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if parent == endpoint.proc.pid and b"RUNPOD_POD_ID" in variables:
            pids[variables[b"RUNPOD_POD_ID"].decode()] = pid
    return pids


def engine_core_of(worker_pid: int) -> int:
    def cmdline(pid: int) -> bytes:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()

    (core,) = [pid for pid in descendants(worker_pid) if cmdline(pid).startswith(b"VLLM::EngineCore")]
    return core


def running_job(endpoint: LocalEndpoint) -> dict:
    job = endpoint.http.post("/run", json={"input": LONG}).json()
    wait_for(lambda: endpoint.http.get(f"/status/{job['id']}").json()["status"] == "IN_PROGRESS", 30)
    return endpoint.http.get(f"/status/{job['id']}").json()


@pytest.fixture(scope="module")
def endpoint(tiny_env, tmp_path_factory):
    local = LocalEndpoint(tiny_env, 2, tmp_path_factory.mktemp("faults") / "endpoint.log")
    yield local
    local.stop()


def exit_status(endpoint: LocalEndpoint, worker: str) -> int | None:
    match = re.search(rf"{worker} exited with status (-?\d+)", endpoint.log())
    return int(match.group(1)) if match else None


def test_a_dead_engine_fails_its_job_and_its_worker_exits_non_zero(endpoint):
    job = running_job(endpoint)
    worker = job["workerId"]
    os.kill(engine_core_of(worker_pids(endpoint)[worker]), signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: endpoint.http.get(f"/status/{job['id']}").json()["status"] == "FAILED", 5)
    assert "EngineCore" in endpoint.http.get(f"/status/{job['id']}").json()["error"]
    wait_for(lambda: exit_status(endpoint, worker) is not None, 5)
    assert exit_status(endpoint, worker) == 1 and time.monotonic() - killed < 5
    assert endpoint.http.get("/health").json()["workers"]["ready"] == 1


def test_sigterm_lets_the_running_job_finish_then_exits_zero(endpoint):
    job = running_job(endpoint)  # on the one worker left
    worker = job["workerId"]
    os.kill(worker_pids(endpoint)[worker], signal.SIGTERM)
    wait_for(lambda: endpoint.http.get(f"/status/{job['id']}").json()["status"] == "COMPLETED", 60)
    assert endpoint.http.get(f"/status/{job['id']}").json()["output"][0]["usage"]["output"] == 1500
    wait_for(lambda: exit_status(endpoint, worker) is not None, 30)
    assert exit_status(endpoint, worker) == 0
