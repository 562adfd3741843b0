"""The local endpoint replaces a worker that exits, as RunPod does: the real ``python -m endpoint``
with a stub worker (tests/stub_worker.py, the real runpod SDK loop) that exits with status 2 at its
first two starts. The endpoint serves throughout: it logs each exit with its back-off (1 s, 2 s,
then 4 s), ``/health`` shows the worker restarting, a job submitted meanwhile completes once the
worker serves, a worker killed later is replaced under its id (its job failed, its processes and
working directory gone), and SIGTERM during a back-off stops the endpoint without a restart."""

from __future__ import annotations

import os
import re
import signal

import pytest
from conftest import REPO, alive, descendants, wait_for
from local_endpoint import HealthSampler, LocalEndpoint, worker_pids

STUB = str(REPO / "tests" / "stub_worker.py")
WORKER = "local-worker-0"
# Counts its starts in $FLAKY_RUNS; the first two exit with status 2 (as a configuration error does).
FLAKY = """
import os, runpy, sys
from pathlib import Path

runs = Path(os.environ["FLAKY_RUNS"])
run = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(run))
if run <= 2:
    sys.exit(2)
runpy.run_path(os.environ["FLAKY_STUB"], run_name="__main__")
"""
EXIT_LINE = re.compile(rf"^endpoint: {WORKER} exited with status (-?\d+) after (\d+\.\d) s; "
                       r"restarting in (\d+) s \(restart (\d+)\)$", re.MULTILINE)


@pytest.fixture(scope="module")
def runs_file(tmp_path_factory):
    return tmp_path_factory.mktemp("flaky") / "runs"


@pytest.fixture(scope="module")
def endpoint(runs_file, tmp_path_factory):
    folder = tmp_path_factory.mktemp("restarts")
    handler = folder / "flaky_worker.py"
    handler.write_text(FLAKY)
    # Not waiting for the worker, which exits at its first two starts: only for the endpoint to serve.
    local = LocalEndpoint({"FLAKY_RUNS": str(runs_file), "FLAKY_STUB": STUB}, 1,
                          folder / "endpoint.log", handler=str(handler), ready_timeout=None)
    yield local
    local.stop()


def exits(endpoint: LocalEndpoint) -> list[tuple[int, int, int]]:
    """(status, back-off seconds, restart number) of each exit the endpoint logged."""
    return [(int(status), int(wait), int(restart))
            for status, _, wait, restart in EXIT_LINE.findall(endpoint.log())]


def expected_waits(endpoint: LocalEndpoint) -> list[int]:
    """The back-offs for the logged run lengths: 1 s, doubling up to 30 s, and 1 s again after a run
    of 60 s (here 1, 2, 4, 8, unless a machine is slow enough for a run between tests to last 60 s)."""
    waits: list[int] = []
    for _, up, _, _ in EXIT_LINE.findall(endpoint.log()):
        waits.append(1 if not waits or float(up) >= 60 else min(30, waits[-1] * 2))
    return waits


def status(endpoint: LocalEndpoint, job_id: str) -> dict:
    return endpoint.http.get(f"/status/{job_id}").json()


def test_a_worker_failing_at_start_is_restarted_after_1_s_then_2_s_and_a_queued_job_completes(
        endpoint, runs_file):
    sampler = HealthSampler(endpoint)
    try:
        job = endpoint.http.post("/run", json={"input": {"chunks": 2}}).json()
        wait_for(lambda: "worker(s) ready" in endpoint.log(), 120)
        wait_for(lambda: status(endpoint, job["id"])["status"] == "COMPLETED", 60)
    finally:
        samples = [s for s in sampler.stop() if WORKER in s["local"]]  # once the supervisor has begun
    log = endpoint.log()
    assert exits(endpoint) == [(2, 1, 1), (2, 2, 2)] and runs_file.read_text() == "3"
    assert (log.index("OpenAI API:") < log.index(f"{WORKER} exited") < log.index("1 worker(s) ready")
            and log.index("1 worker(s) ready") > log.rindex(f"{WORKER} exited"))
    assert status(endpoint, job["id"])["workerId"] == WORKER
    assert status(endpoint, job["id"])["output"] == [{"chunk": 0}, {"chunk": 1}]

    # While it waited to restart, the worker was unhealthy and the job queued.
    waiting = [s for s in samples if s["local"][WORKER]["state"] == "restarting"]
    assert {s["local"][WORKER]["restarts"] for s in waiting} == {0, 1}  # both back-offs seen
    for sample in waiting:
        assert sample["workers"] == {"idle": 0, "running": 0, "ready": 0, "initializing": 0,
                                     "unhealthy": 1, "throttled": 0}
        assert sample["local"][WORKER]["lastExitStatus"] == 2
        assert 0 <= sample["local"][WORKER]["restartIn"] <= 2
        assert sample["jobs"]["inQueue"] + sample["jobs"]["completed"] == 1
    assert any(s["jobs"]["inQueue"] == 1 for s in waiting)
    restarts = [s["local"][WORKER]["restarts"] for s in samples]
    assert restarts == sorted(restarts)  # in order
    # Read after the job completed (the sampler's last answer may have been asked for before).
    final = endpoint.http.get("/health").json()
    assert final["local"][WORKER] == {"state": "ready", "restarts": 2, "lastExitStatus": 2, "restartIn": None}
    assert final["workers"]["ready"] == 1 and endpoint.proc.poll() is None


def test_a_worker_killed_later_fails_its_job_and_is_replaced_under_its_id(endpoint):
    job = endpoint.http.post("/run", json={"input": {"chunks": 2, "seconds": 60}}).json()
    wait_for(lambda: status(endpoint, job["id"])["status"] == "IN_PROGRESS", 30)
    (pid,) = worker_pids(endpoint).values()
    group = descendants(pid) | {pid}  # with the SDK's heartbeat process, left behind by SIGKILL
    workdir = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, signal.SIGKILL)

    wait_for(lambda: len(exits(endpoint)) == 3, 30)
    assert exits(endpoint)[2] == (-9, expected_waits(endpoint)[2], 3)  # its third exit in a row
    assert status(endpoint, job["id"])["status"] == "FAILED"
    assert f"worker {WORKER} exited" in status(endpoint, job["id"])["error"]
    assert endpoint.http.get("/health").json()["local"][WORKER]["lastExitStatus"] == -9
    wait_for(lambda: not any(map(alive, group)) and not os.path.exists(workdir), 10)

    wait_for(lambda: endpoint.http.get("/health").json()["workers"]["ready"] == 1, 60)
    (new_pid,) = worker_pids(endpoint).values()
    assert new_pid != pid and os.readlink(f"/proc/{new_pid}/cwd") != workdir
    assert endpoint.http.get("/health").json()["local"][WORKER]["restarts"] == 3
    answer = endpoint.http.post("/runsync", json={"input": {"chunks": 1}}).json()
    assert answer["status"] == "COMPLETED" and answer["workerId"] == WORKER
    assert endpoint.proc.poll() is None


def test_sigterm_during_a_back_off_stops_the_endpoint_without_a_restart(endpoint, runs_file):
    started = int(runs_file.read_text())
    (pid,) = worker_pids(endpoint).values()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(exits(endpoint)) == 4, 30)
    assert exits(endpoint)[3] == (-9, expected_waits(endpoint)[3], 4)  # a back-off under way
    assert endpoint.stop() == 0
    assert endpoint.log().rstrip().endswith("endpoint: stopping workers")
    assert int(runs_file.read_text()) == started  # the pending restart never happened
