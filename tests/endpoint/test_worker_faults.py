"""Faults under running jobs, through the local endpoint and the real worker loop, on one worker:
a dead engine makes its worker fail the job and exit non-zero, and the endpoint replaces it, as
RunPod does; SIGTERM lets in-flight jobs finish within the grace period, aborts the rest with an
error, and exits zero."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from conftest import descendants, wait_for
from local_endpoint import API_KEY, HF_TOKEN, LocalEndpoint, worker_pids

# n=4: ~11 s on these machines, well past the grace period even on a machine twice as fast
LONG = {"prompt": "x", "sampling_params": {"max_tokens": 1900, "ignore_eos": True, "n": 4}}
SHORT = {"prompt": "x", "sampling_params": {"max_tokens": 40, "ignore_eos": True}}
GRACE = 4.0


def engine_core_of(worker_pid: int) -> int:
    def cmdline(pid: int) -> bytes:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read()

    (core,) = [pid for pid in descendants(worker_pid) if cmdline(pid).startswith(b"VLLM::EngineCore")]
    return core


def running_job(endpoint: LocalEndpoint, job_input: dict = LONG) -> dict:
    job = endpoint.http.post("/run", json={"input": job_input}).json()
    wait_for(lambda: endpoint.http.get(f"/status/{job['id']}").json()["status"] == "IN_PROGRESS", 30)
    return endpoint.http.get(f"/status/{job['id']}").json()


@pytest.fixture(scope="module")
def endpoint(tiny_env, tmp_path_factory):
    """One worker (so that both jobs of the SIGTERM test are on it), everything logging at DEBUG,
    with secrets set (checked by the last test)."""
    debug = {"LOG_LEVEL": "DEBUG", "RUNPOD_DEBUG_LEVEL": "DEBUG", "VLLM_LOGGING_LEVEL": "DEBUG"}
    local = LocalEndpoint({**tiny_env, **debug, "SHUTDOWN_GRACE_PERIOD": str(GRACE), "HF_TOKEN": HF_TOKEN},
                          1, tmp_path_factory.mktemp("faults") / "endpoint.log")
    yield local
    local.stop()


def exit_status(endpoint: LocalEndpoint, worker: str) -> int | None:
    """How the worker's latest process exited (None: it has not exited)."""
    found = re.findall(rf"{worker} exited with status (-?\d+)", endpoint.log())
    return int(found[-1]) if found else None


JOBS: list[str] = []  # every job these tests ran


def test_a_dead_engine_fails_its_job_and_its_worker_exits_non_zero(endpoint):
    job = running_job(endpoint)
    JOBS.append(job["id"])
    worker = job["workerId"]
    os.kill(engine_core_of(worker_pids(endpoint)[worker]), signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: endpoint.http.get(f"/status/{job['id']}").json()["status"] == "FAILED", 5)
    assert "EngineCore" in endpoint.http.get(f"/status/{job['id']}").json()["error"]
    # The worker's own backstop exits 3 s after the fatal error; 10 s leaves room for a loaded machine.
    wait_for(lambda: exit_status(endpoint, worker) is not None, 10)
    assert exit_status(endpoint, worker) == 1 and time.monotonic() - killed < 10
    assert re.search(rf"{worker} exited with status 1 after [\d.]+ s; restarting in 1 s \(restart 1\)",
                     endpoint.log())
    # Replaced: the same worker id serves again once its new engine is up.
    wait_for(lambda: endpoint.http.get("/health").json()["workers"]["ready"] == 1, 300)
    assert endpoint.log().count(f"{worker} exited") == 1


def test_sigterm_finishes_jobs_within_the_grace_period_aborts_the_rest_then_exits_zero(endpoint):
    long = running_job(endpoint)  # both on the one worker (replaced by the test above)
    short = running_job(endpoint, SHORT)
    JOBS.extend([long["id"], short["id"]])
    worker = long["workerId"]
    assert short["workerId"] == worker
    os.kill(worker_pids(endpoint)[worker], signal.SIGTERM)
    signalled = time.monotonic()

    def status(job):
        return endpoint.http.get(f"/status/{job['id']}").json()

    wait_for(lambda: status(long)["status"] == "FAILED", GRACE + 3)
    assert time.monotonic() - signalled >= GRACE - 0.5
    assert "SHUTDOWN_GRACE_PERIOD" in status(long)["error"] and "503" in status(long)["error"]
    assert status(short)["status"] == "COMPLETED" and status(short)["output"][0]["usage"]["output"] == 40
    wait_for(lambda: exit_status(endpoint, worker) == 0, 30)


def test_no_secret_in_any_log_line_or_job_error_at_debug(endpoint):
    """Runs last: the endpoint's and the worker's output, both its processes (engine death and
    shutdown included)."""
    statuses = [endpoint.http.get(f"/status/{job_id}").text for job_id in JOBS]
    endpoint.stop()
    log = endpoint.log()
    assert "DEBUG" in log and "EngineCore" in log and "Finished." in log and len(statuses) == 3
    for text in [log, *statuses]:
        assert HF_TOKEN not in text and API_KEY not in text
