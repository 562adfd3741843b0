"""JobLoop (src/worker/scheduling/job_loop.py): pinned to the runpod SDK it specialises, and its wake-up logic.

The logic tests run the real JobLoop with the SDK's own test hooks (``jobs_fetcher`` and
``jobs_handler`` in the config, honoured when no RunPod job URL is set) standing for RunPod.
They count event-loop turns, not seconds: a job must start, and a freed slot must be refilled,
within a few turns, where the SDK's own loop sleeps 0.1 s or 1 s.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import pickle
import threading
from importlib.metadata import version

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from runpod.serverless import worker
from runpod.serverless.modules import rp_job, rp_scale
from runpod.serverless.modules.worker_state import JobsProgress

from worker.jobs.job_input import JobInput
from worker.scheduling import job_loop, job_take
from worker.wire.errors import RequestError

# SHA-256 of the source of each SDK function JobLoop overrides or relies on (and rp_job.get_job,
# which job_take.take_jobs copies), as read for runpod 1.10.0. A change means JobLoop must be read
# against the new code again.
SDK_SOURCES = {
    "JobScaler.__init__": "a6f8e34dff6a9dce",
    "JobScaler.current_occupancy": "b2aea650fe668006",
    "JobScaler.get_jobs": "e08b2e0cfb262643",
    "JobScaler.handle_job": "41942f20a816b244",
    "JobScaler.kill_worker": "863effbe007ad0f9",
    "JobScaler.monitor_stop_signals": "3bf52c6dcde159b4",
    "JobScaler.run": "f6c6b5f871b94c72",
    "JobScaler.run_jobs": "74cd623de98ef8b4",
    "JobScaler.set_scale": "e137f173c456d41b",
    "rp_job.get_job": "8ce238208ca5261a",
    "rp_job._job_get_url": "08b9c30905c64480",
    "rp_job._job_stop_url": "8f3407fceaf421fe",
    "JobsProgress._load_state": "ad13f28f271d3ff4",
    "JobsProgress._save_state": "19150356a474a85a",
    "JobsProgress.get_job_list": "ae30123a31e10b4d",
    "worker.run_worker": "f7e8275a7c9c33df",
}
_OWNERS = {"worker": worker, "rp_job": rp_job, "JobsProgress": JobsProgress}


def _digest(name: str) -> str:
    owner, attr = name.split(".")
    obj = getattr(job_loop.JobLoop.__mro__[1] if owner == "JobScaler" else _OWNERS[owner], attr)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def test_the_installed_sdk_is_the_one_job_loop_was_written_for():
    assert version("runpod") == job_loop.SDK_VERSION, (
        f"runpod {version('runpod')} is installed, JobLoop was written for {job_loop.SDK_VERSION}: "
        "read src/worker/scheduling/job_loop.py against the new SDK's rp_scale.JobScaler, then update SDK_VERSION")


@pytest.mark.parametrize("name", sorted(SDK_SOURCES))
def test_the_sdk_code_job_loop_overrides_is_unchanged(name):
    assert _digest(name) == SDK_SOURCES[name], (
        f"runpod's {name} changed: read src/worker/scheduling/job_loop.py against it, then update SDK_SOURCES")


def test_install_points_the_sdk_at_job_loop_only_when_enabled_and_pinned(monkeypatch, caplog):
    monkeypatch.setattr(rp_scale, "JobScaler", rp_scale.JobScaler)  # restored after the test
    monkeypatch.setattr(rp_scale, "get_job", rp_job.get_job)
    sdk_scaler = rp_scale.JobScaler
    monkeypatch.setattr(job_loop, "version", lambda _name: "9.9.9")
    with caplog.at_level(logging.WARNING):
        assert job_loop.install() is False and rp_scale.JobScaler is sdk_scaler
    assert "written for runpod 1.10.0, this is 9.9.9" in caplog.text and rp_scale.get_job is rp_job.get_job
    monkeypatch.setattr(job_loop, "version", lambda _name: job_loop.SDK_VERSION)
    # The SDK's own loop (JOB_LOOP=sdk) takes jobs as JobLoop does.
    assert job_loop.install(enabled=False) is False and rp_scale.JobScaler is sdk_scaler
    assert rp_scale.get_job is job_take.take_jobs
    assert job_loop.install() is True and rp_scale.JobScaler is job_loop.JobLoop


def test_a_job_too_deep_to_parse_fails_alone_and_the_rest_of_its_batch_is_taken(monkeypatch):
    """The SDK's job-take reader fails the whole batch (RunPod has marked its jobs taken: none would
    be answered); ``take_jobs`` reads the others, and the handler refuses the deep one alone."""
    deep = "[" * 5000 + "]" * 5000
    answer = ('[{"id": "a", "input": {"prompt": "x"}}, {"id": "b", "input": {"x": %s}}, '
              '{"id": "c", "input": {}}]')

    async def take(fetch):
        app = web.Application()
        app.router.add_get("/job-take-batch/w", lambda _request: web.Response(
            text=answer % deep, content_type="application/json"))
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            monkeypatch.setattr(rp_job, "JOB_GET_URL", str(server.make_url("/job-take/w?gpu=x")))
            return await fetch(session, 3)

    with pytest.raises(RecursionError):
        asyncio.run(take(rp_job.get_job))
    first, deep_job, last = asyncio.run(take(job_take.take_jobs))
    assert first == {"id": "a", "input": {"prompt": "x"}} and last == {"id": "c", "input": {}}
    assert deep_job["id"] == "b"
    with pytest.raises(RequestError, match="the job input is nested more than 128 levels deep") as refused:
        JobInput.from_job(deep_job)
    assert refused.value.status == 400 and refused.value.param == "input"


class Platform:
    """RunPod's side for one JobLoop: a job queue the fetcher long-polls, and jobs that run until
    the test lets them finish."""

    def __init__(self, concurrency: int, failures: int = 0) -> None:
        self.concurrency = concurrency
        self.failures = failures  # the first fetches fail, as an unreachable platform does
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.running: dict[str, asyncio.Event] = {}
        self.finished: list[str] = []
        self.asked: list[int] = []  # how many jobs each fetch asked for

    async def fetch(self, _session, count: int) -> list[dict]:
        JobsProgress().get_job_list()  # as the SDK's fetcher does: reloads the set from its file
        if self.failures:
            self.failures -= 1
            raise ConnectionError("platform unreachable")
        self.asked.append(count)
        jobs = [await self.queue.get()]
        while len(jobs) < count and not self.queue.empty():
            jobs.append(self.queue.get_nowait())
        return jobs

    async def handle(self, _session, _config, job: dict) -> None:
        self.running[job["id"]] = release = asyncio.Event()
        try:
            await release.wait()
            self.finished.append(job["id"])
        finally:  # stopped or finished
            del self.running[job["id"]]

    def submit(self, *ids: str) -> None:
        for job_id in ids:
            self.queue.put_nowait({"id": job_id, "input": {}})

    def loop(self) -> job_loop.JobLoop:
        return job_loop.JobLoop({"handler": None, "jobs_fetcher": self.fetch, "jobs_handler": self.handle,
                                 "concurrency_modifier": lambda _current: self.concurrency})


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.fixture(autouse=True)
def jobs_file(tmp_path, monkeypatch):
    """The SDK's in-progress job file, in a temporary folder rather than the working directory."""
    monkeypatch.setattr(JobsProgress, "_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(JobsProgress, "_STATE_FILE", str(tmp_path / "jobs.pkl"))
    JobsProgress().clear()


def run_with_loop(concurrency: int, scenario, failures: int = 0) -> Platform:
    async def main() -> Platform:
        platform = Platform(concurrency, failures)
        scaler = platform.loop()
        runner = asyncio.create_task(scaler.run())
        await turns()
        try:
            await asyncio.wait_for(scenario(platform, scaler), 30)
        finally:
            scaler.kill_worker()
            for release in platform.running.values():
                release.set()
            platform.submit("unblock-fetch")  # the last fetch returns; its job runs, then run() ends
            await turns()
            for release in list(platform.running.values()):
                release.set()
            await asyncio.wait_for(runner, 30)
        return platform

    return asyncio.run(main())


def test_a_taken_job_starts_within_a_few_loop_turns():
    async def scenario(platform: Platform, _scaler) -> None:
        for job_id in ("a", "b", "c"):
            platform.submit(job_id)
            await turns()
            assert job_id in platform.running

    run_with_loop(4, scenario)


def test_a_full_worker_refills_a_freed_slot_at_once_and_never_holds_more_than_its_concurrency():
    async def scenario(platform: Platform, scaler) -> None:
        platform.submit(*(f"j{i}" for i in range(5)))
        await turns()
        assert sorted(platform.running) == ["j0", "j1"] and scaler.current_occupancy() == 2
        platform.running["j0"].set()
        await turns(10)
        assert sorted(platform.running) == ["j1", "j2"]
        assert platform.finished == ["j0"] and scaler.current_occupancy() == 2

    platform = run_with_loop(2, scenario)
    assert platform.asked[:2] == [2, 1]  # a fetch asks for the free slots, no more


def test_a_new_concurrency_applies_to_the_next_fetch_without_draining():
    async def scenario(platform: Platform, _scaler) -> None:
        platform.submit(*(f"j{i}" for i in range(8)))
        await turns()
        assert len(platform.running) == 2
        platform.concurrency = 5
        await asyncio.sleep(job_loop.RESCALE_SECONDS * 1.5)  # a full worker re-reads the modifier
        assert len(platform.running) == 5  # the two first jobs still run: nothing drained
        assert {"j0", "j1"} <= set(platform.running)
        platform.concurrency = 1
        for job_id in ("j0", "j1", "j2", "j3"):
            platform.running[job_id].set()
        await turns(10)
        assert len(platform.running) == 1  # j4 runs; nothing new until it ends

    run_with_loop(2, scenario)


def test_a_raised_concurrency_wakes_a_full_worker_at_once_from_another_thread():
    async def scenario(platform: Platform, _scaler) -> None:
        platform.submit(*(f"j{i}" for i in range(4)))
        await turns()
        assert len(platform.running) == 1
        platform.concurrency = 3
        waking = threading.Thread(target=job_loop.wake)  # the engine's thread calls it
        waking.start()
        waking.join()
        await turns(10)  # well before RESCALE_SECONDS
        assert len(platform.running) == 3

    run_with_loop(1, scenario)


@pytest.mark.parametrize(("held", "polls"), [(0.06, 5), (0.0, 1)])
def test_a_stop_poll_held_open_and_ended_empty_is_made_again_at_once(monkeypatch, held, polls):
    # The SDK pauses 1 s after every empty poll; only polls answered at once should wait for it.
    monkeypatch.setattr(job_loop, "STOP_POLL_HELD_SECONDS", 0.05)
    asked = []

    async def stop_signals(_session) -> list[str]:
        asked.append(1)
        await asyncio.sleep(held)
        return []

    async def scenario(_platform: Platform, scaler) -> None:
        scaler.stop_signals_fetcher = stop_signals
        watching = asyncio.create_task(scaler.monitor_stop_signals(None))
        await asyncio.sleep(0.3)  # well before the SDK's 1 s pause ends
        watching.cancel()
        assert len(asked) >= polls if held else len(asked) == polls

    run_with_loop(1, scenario)


def test_at_shutdown_run_ends_with_the_last_job_not_with_a_stop_poll_held_open():
    # The SDK's run() waits for the stop-channel loop, which waits for its poll in progress: the
    # process stayed up that long after its jobs (up to a minute, with held polls repeated).
    async def main() -> None:
        platform = Platform(2)
        scaler = platform.loop()

        async def stop_signals(_session) -> list[str]:  # a server that holds every poll open 20 s
            await asyncio.sleep(20)
            return []

        scaler.stop_signals_fetcher = stop_signals
        runner = asyncio.create_task(scaler.run())
        platform.submit("a", "b")
        await turns()
        scaler.kill_worker()  # SIGTERM: both jobs are in their grace period
        await turns()
        assert not runner.done()
        for release in list(platform.running.values()):
            release.set()
        await asyncio.wait_for(runner, 5)
        assert sorted(platform.finished) == ["a", "b"]

    asyncio.run(main())


def test_at_shutdown_jobs_in_flight_and_jobs_of_the_last_fetch_finish_and_nothing_more_is_taken():
    async def scenario(platform: Platform, scaler) -> None:
        platform.submit("running")
        await turns()
        scaler.kill_worker()
        platform.submit("from-the-last-fetch", "never")
        await turns()
        assert sorted(platform.running) == ["from-the-last-fetch", "running"]

    platform = run_with_loop(2, scenario)
    assert sorted(platform.finished) == ["from-the-last-fetch", "running"]
    assert "never" not in platform.finished


def test_a_stopped_job_frees_its_slot_and_the_others_keep_running():
    async def scenario(platform: Platform, scaler) -> None:
        platform.submit("a", "b", "c")
        await turns()
        assert sorted(platform.running) == ["a", "b"]
        assert await scaler.stop_job("a")
        await turns(10)
        assert sorted(platform.running) == ["b", "c"] and "a" not in platform.finished

    run_with_loop(2, scenario)


def test_a_failing_fetch_is_retried_after_a_pause_and_the_worker_keeps_serving(monkeypatch, caplog):
    monkeypatch.setattr(job_loop, "FETCH_ERROR_SECONDS", 0.01)

    async def scenario(platform: Platform, _scaler) -> None:
        platform.submit("after-the-failures")
        while "after-the-failures" not in platform.running:
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR):
        platform = run_with_loop(1, scenario, failures=2)
    assert platform.asked[:1] == [1]
    assert caplog.text.count("Taking jobs failed (ConnectionError: platform unreachable)") == 2


def test_a_failing_concurrency_modifier_keeps_the_last_concurrency(caplog):
    async def scenario(platform: Platform, scaler) -> None:
        platform.submit("a", "b", "c")
        await turns()
        scaler.concurrency_modifier = lambda _current: 1 // 0
        platform.running["a"].set()
        await turns(10)
        assert sorted(platform.running) == ["b", "c"] and scaler.current_concurrency == 2

    with caplog.at_level(logging.ERROR):
        run_with_loop(2, scenario)
    assert "The concurrency modifier failed; keeping 2" in caplog.text


def test_the_heartbeats_job_file_is_written_once_per_batch_and_never_brings_back_a_finished_job(
        tmp_path, monkeypatch):
    writes = []
    save = JobsProgress._save_state
    monkeypatch.setattr(JobsProgress, "_save_state", lambda self: (writes.append(1), save(self)))

    def listed() -> set[str]:
        with open(tmp_path / "jobs.pkl", "rb") as file:  # what the heartbeat process reads
            return {str(job) for job in pickle.load(file)}

    async def written() -> None:
        await asyncio.sleep(job_loop.PROGRESS_WRITE_SECONDS)
        await turns()

    async def scenario(platform: Platform, scaler) -> None:
        writes.clear()
        platform.submit("a", "b", "c")
        await turns()
        await written()
        assert listed() == {"a", "b", "c"} and len(writes) == 1
        platform.running["b"].set()  # its slot frees: the next fetch starts, reloading the file
        await turns()
        assert "b" not in listed() and scaler.current_occupancy() == 2
        platform.submit("d")
        await turns()
        await written()
        assert listed() == {"a", "c", "d"} and scaler.current_occupancy() == 3

    run_with_loop(3, scenario)
