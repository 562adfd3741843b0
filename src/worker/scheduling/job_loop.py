"""The runpod SDK's job loop, specialised so that a job starts when it is taken and a freed slot is
refilled when it frees.

``runpod.serverless.start`` stays the entry point: it builds ``rp_scale.JobScaler``, which
``install()`` points at ``JobLoop``. The SDK's own loop (runpod 1.10.0, ``SDK_VERSION``) polls:

- ``run_jobs`` looks at its queue every 0.1 s, so a taken job waits 0-100 ms before it starts;
- ``get_jobs`` sleeps 1 s whenever every slot is busy, so a freed slot stays empty up to 1 s;
- ``set_scale`` waits for the worker to drain before it applies a new concurrency;
- ``monitor_stop_signals`` pauses 1 s after every empty stop-channel poll, so a job stop may wait
  1 s, and at shutdown the process waits for its poll in progress after the last job has ended.

``JobLoop`` overrides those methods and ``handle_job``, waking on events instead: a taken job
starts at once (before the next job-take request), a finished job wakes the fetcher, and a new
concurrency applies to the next fetch (a raised one, ``wake()``, wakes a full worker's fetcher), and a
stop-channel poll that the server held open and ended empty is made again at once (and is
dropped when the last job ends at shutdown).
The job-take request is the SDK's too, but for how it reads the answer (``job_take``). The rest
(heartbeat, job-stop channel, job handling, result posts, signal handling) is the SDK's.

The overridden methods were read against one SDK version, ``SDK_VERSION`` (the pinned one): with
another installed, ``install()`` leaves the SDK's loop in place and a warning says so. Nothing
checks other versions: ``tests/unit/test_job_loop.py`` fails when the installed version is not
``SDK_VERSION``, or when the source of an SDK function ``JobLoop`` overrides or relies on differs
from the one read (a SHA-256 digest of each, ``SDK_SOURCES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Any

from runpod.http_client import TooManyRequests
from runpod.serverless.modules import rp_job, rp_scale
from runpod.serverless.modules.worker_state import Job, JobsProgress

from worker.scheduling.job_take import take_jobs

log = logging.getLogger(__name__)

SDK_VERSION = "1.10.0"
# A full worker re-reads the concurrency modifier this often while it waits for a slot (a raised
# target also wakes it at once: wake()).
RESCALE_SECONDS = 1.0
# The in-progress file shows a taken or finished job by the next fetch, or after this long at the latest.
PROGRESS_WRITE_SECONDS = 0.1
RATE_LIMITED_SECONDS = 5.0  # RunPod answered 429: back off as the SDK does
# A stop-channel poll held open this long was not answered at once (no spin to guard against); polls
# are repeated for this long in all, well within the SDK's 90 s bound on one.
STOP_POLL_HELD_SECONDS, STOP_POLL_SECONDS = 0.5, 60.0
FETCH_ERROR_SECONDS = 1.0  # any other failed fetch: retry, without spinning


class JobLoop(rp_scale.JobScaler):
    """``JobScaler`` that wakes on events instead of polling."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        # Unbounded: get_jobs never takes more jobs than there are free slots, so the SDK's
        # rebuild of a bounded queue (which waits for the worker to drain) is not needed.
        self.jobs_queue = asyncio.Queue()
        self.job_progress = _ProgressFile(self.job_progress)
        self._tasks: set[asyncio.Task] = set()
        self._fetch_ended = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._drained = asyncio.Event()  # shut down, and the last job has ended
        self._fetching = False  # a job-take request is out: at shutdown, its jobs still run
        self._loop: asyncio.AbstractEventLoop | None = None  # the SDK's, once get_jobs runs
        global _current
        _current = self

    async def set_scale(self) -> None:
        try:
            self.current_concurrency = self.concurrency_modifier(self.current_concurrency)
        except Exception:  # noqa: BLE001 - in the SDK's loop this would end the worker and its jobs
            log.exception("The concurrency modifier failed; keeping %d", self.current_concurrency)

    def kill_worker(self) -> None:
        super().kill_worker()
        self._fetch_ended.set()  # wake run_jobs and get_jobs, so they notice
        self._slot_freed.set()

    async def monitor_stop_signals(self, session: Any) -> None:
        """The SDK's stop-channel loop. It pauses 1 s after every poll that ends empty (against a
        server that answers at once), so a stop signalled in that second waits for it: polls the
        server held open are repeated at once instead (``_held_polls_repeated``). It ends when the
        last job does: the SDK's ``run()`` waits for it before the process exits, and a poll in
        progress may be held open for up to ``stop_signals_fetcher_timeout`` (90 s)."""
        fetch = self.stop_signals_fetcher
        if fetch is not rp_job.get_stop_signals or rp_job._job_stop_url() is not None:
            self.stop_signals_fetcher = functools.partial(_held_polls_repeated, fetch)
        watching = asyncio.ensure_future(super().monitor_stop_signals(session))
        drained = asyncio.ensure_future(self._drained.wait())
        try:
            await asyncio.wait((watching, drained), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            drained.cancel()

    async def get_jobs(self, session: Any) -> None:
        """Take as many jobs as there are free slots and start them; when no slot is free, wait
        until one frees, the concurrency rises (wake()) or RESCALE_SECONDS pass."""
        self._loop = asyncio.get_running_loop()
        while self.is_alive():
            await self.set_scale()
            wanted = self.current_concurrency - self.current_occupancy()
            if wanted <= 0:
                self._slot_freed.clear()
                await _wait(self._slot_freed, RESCALE_SECONDS)
                continue
            pause = 0.0
            self._fetching = True
            try:
                jobs = await asyncio.wait_for(self._take(session, wanted), self.jobs_fetcher_timeout)
            except TooManyRequests:
                pause = RATE_LIMITED_SECONDS
            except TimeoutError:
                pass  # a long poll that ended empty
            except Exception as exc:  # noqa: BLE001 - the platform may fail; the worker keeps asking
                log.error("Taking jobs failed (%s: %s); retrying in %g s", type(exc).__name__, exc,
                          FETCH_ERROR_SECONDS)
                pause = FETCH_ERROR_SECONDS
            else:
                if jobs:
                    self.job_progress.add_all(jobs)
                    for job in jobs:
                        self._start(session, job)
                    log.info("Jobs in progress: %d", len(self._tasks))
            finally:
                self._fetching = False
                self._fetch_ended.set()
            # With no pause, this still yields once: the jobs just started run up to their first
            # wait (their request is in vLLM) before the next job-take request is built.
            await asyncio.sleep(pause)

    async def _take(self, session: Any, wanted: int) -> list[dict[str, Any]] | None:
        # The SDK's fetcher reloads the in-progress set from its file as it builds the request (before
        # it first awaits): written in the same step, the file holds every change so far.
        self.job_progress.flush()
        return await self.jobs_fetcher(session, wanted)

    def _start(self, session: Any, job: dict[str, Any]) -> None:
        # Through the queue only because the SDK's handle_job marks a queue item done.
        self.jobs_queue.put_nowait(job)
        self.jobs_queue.get_nowait()
        task = asyncio.create_task(self.handle_job(session, job))
        self.jobs_tasks[job["id"]] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run_jobs(self, session: Any) -> None:
        """Jobs start where they are taken (get_jobs); at shutdown this waits for the last job-take
        request to end, then for every job in flight."""
        while self.is_alive() or self._fetching:
            self._fetch_ended.clear()
            await self._fetch_ended.wait()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):  # a stopped job is a CancelledError, not an Exception
                log.error("A job failed while the worker shut down: %s", result)
        self.job_progress.flush()
        self._drained.set()

    async def handle_job(self, session: Any, job: dict[str, Any]) -> None:
        try:
            await super().handle_job(session, job)
        finally:  # the SDK's handle_job has removed the job from the in-progress set
            self._slot_freed.set()


class _ProgressFile:
    """The SDK's in-progress set (``JobsProgress``), whose file the heartbeat process reads, written
    less often. ``JobsProgress`` rewrites the file under a lock on every add and remove (0.4-2 ms on
    the event loop here), so jobs taken or finished together delay the next fetch by the sum. Here
    changes are written together: before the next fetch (which must see them, as the SDK's fetcher
    reloads the set from the file) or ``PROGRESS_WRITE_SECONDS`` later, whichever comes first."""

    def __init__(self, jobs: JobsProgress) -> None:
        self._jobs = jobs
        self._pending: asyncio.TimerHandle | None = None

    def add_all(self, jobs: list[dict[str, Any]]) -> None:
        for job in jobs:
            set.add(self._jobs, Job(id=job["id"]))
        self._changed()

    def remove(self, job: dict[str, Any]) -> None:  # the SDK's handle_job calls this
        set.discard(self._jobs, Job(id=job["id"]))
        self._changed()

    def get_job_count(self) -> int:  # the SDK's current_occupancy calls this
        return len(self._jobs)

    def flush(self) -> None:
        """Write the changes not yet written."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
            self._jobs._save_state()

    def _changed(self) -> None:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(PROGRESS_WRITE_SECONDS, self.flush)


async def _held_polls_repeated(fetch: Callable[[Any], Awaitable[list[str]]], session: Any) -> list[str]:
    """``fetch(session)`` (the stop channel's long poll), repeated while the server holds each poll
    open (``STOP_POLL_HELD_SECONDS``) and ends it empty, for up to ``STOP_POLL_SECONDS``."""
    loop = asyncio.get_running_loop()
    until = loop.time() + STOP_POLL_SECONDS
    while True:
        began = loop.time()
        stops = await fetch(session)
        if stops or loop.time() - began < STOP_POLL_HELD_SECONDS or loop.time() > until:
            return stops


_current: JobLoop | None = None  # the process's job loop, once runpod.serverless.start built it


def wake() -> None:
    """Make a full worker read the concurrency modifier now (it rose); from any thread."""
    job_loop = _current
    if job_loop is not None and job_loop._loop is not None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the worker is stopping
            job_loop._loop.call_soon_threadsafe(job_loop._slot_freed.set)


async def _wait(event: asyncio.Event, timeout: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass


def install(enabled: bool = True) -> bool:
    """Make ``runpod.serverless.start`` run ``JobLoop``; True when it will. Either loop takes jobs
    with ``job_take.take_jobs`` (a job nested too deep fails alone) under the SDK it was read against."""
    installed = version("runpod")
    if installed == SDK_VERSION:
        rp_scale.get_job = take_jobs  # what JobScaler.__init__ makes its jobs_fetcher
    if not enabled:
        log.info("Job loop: the runpod SDK's own (JOB_LOOP=sdk)")
        return False
    if installed != SDK_VERSION:
        log.warning("Job loop: the runpod SDK's own, which polls (up to 0.1 s before a job starts, "
                    "1 s before a freed slot is refilled): JobLoop was written for runpod %s, "
                    "this is %s", SDK_VERSION, installed)
        return False
    rp_scale.JobScaler = JobLoop
    log.info("Job loop: JobLoop (a taken job starts at once, a freed slot is refilled when it frees)")
    return True
