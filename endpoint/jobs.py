"""The job store of the local endpoint: queue, states, stream buffers, stop signals. No HTTP.

A job goes IN_QUEUE → IN_PROGRESS (taken by exactly one worker) → COMPLETED | FAILED, or to
CANCELLED from either of the first two, or to TIMED_OUT when it stays IN_PROGRESS longer than the
execution timeout (RunPod's endpoint setting). A job cancelled or timed out in progress is also put
on its worker's stop list, and whatever that worker reports for it afterwards is ignored. Waiters
(long polls, ``runsync``, streams) sleep on one condition that every change notifies.

Workers are known by id, and a restarted worker keeps its id, as on RunPod: the supervisor tells
the store when a process starts under an id (``revive``) and when it exits (``forget``: the jobs it
held fail). Between the two the id is ignored; a long poll of the exited process that is still
under way ends empty, so nothing meant for the next process is handed to the one before it.
For ``/health`` a worker is initializing (started, not called in yet), ready or running (called in
within the alive window; running while it holds a job), unresponsive (silent longer) or
restarting (exited, waiting for its next process); the last two count as RunPod's unhealthy.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from worker.wire.errors import create_error_response

__all__ = ["FINAL", "Job", "JobStore", "Status", "Worker"]


class Status(enum.StrEnum):
    IN_QUEUE = "IN_QUEUE"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"


FINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.TIMED_OUT})


@dataclass
class Job:
    id: str
    input: Any
    status: Status = Status.IN_QUEUE
    worker: str | None = None
    chunks: list[Any] = field(default_factory=list)  # every streamed output, in order
    read: int = 0  # how many chunks /stream has handed out
    output: Any = None
    error: Any = None
    done_reports: int = 0  # job-done calls received, ignored ones included
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def public(self) -> dict[str, Any]:
        """The job as RunPod's /status answers it."""
        now = time.monotonic()
        body: dict[str, Any] = {"id": self.id, "status": str(self.status),
                                "delayTime": round(((self.started or now) - self.created) * 1000)}
        if self.started is not None:
            body["executionTime"] = round(((self.finished or now) - self.started) * 1000)
        if self.worker:
            body["workerId"] = self.worker
        if self.status is Status.COMPLETED:
            body["output"] = self.output
        if self.error is not None:
            body["error"] = self.error
        return body


@dataclass
class Worker:
    """One worker id, across the processes that run under it."""
    processes: int = 0  # started under the id so far (``revive`` counts them)
    gone: bool = False  # its process exited and the next one has not started
    seen: float | None = None  # the current process's last call (None: not called in yet)
    exit_status: int | None = None  # the last exited process's
    restart_at: float | None = None  # while gone: when the next process starts (time.monotonic)

    def state(self, busy: bool, now: float, alive_within: float) -> str:
        """Its state for /health (``busy``: it holds a job in progress)."""
        if self.gone:
            return "restarting"
        if self.seen is None:
            return "initializing"
        if now - self.seen > alive_within:
            return "unresponsive"
        return "running" if busy else "ready"


class JobStore:
    def __init__(self, execution_timeout: float | None = 600.0) -> None:
        self.execution_timeout = execution_timeout  # seconds IN_PROGRESS; None: no limit
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.stops: dict[str, set[str]] = {}  # worker → jobs it must stop
        self.workers: dict[str, Worker] = {}
        self.counts = {status: 0 for status in FINAL}
        self._deadlines: dict[str, asyncio.Task] = {}  # job in progress → its execution timeout
        self._changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        """Wait until ``predicate()`` holds (True) or ``timeout`` passes (False; None: no limit)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
                return True
            except TimeoutError:
                return predicate()

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    async def submit(self, job_input: Any) -> Job:
        job = Job(id=f"local-{uuid.uuid4()}", input=job_input)
        self.jobs[job.id] = job
        self.queue.append(job.id)
        await self._notify()
        return job

    def _seen(self, worker: str) -> Worker:
        """The worker that called in (a worker the supervisor did not start counts from its first call)."""
        record = self.workers.setdefault(worker, Worker())
        if not record.gone:
            record.seen = time.monotonic()
        return record

    def is_gone(self, worker: str) -> bool:
        return worker in self.workers and self.workers[worker].gone

    def called_in(self, worker: str) -> bool:
        """Whether the worker's latest process has called in (still true once it has exited)."""
        return worker in self.workers and self.workers[worker].seen is not None

    async def _poll(self, worker: str, predicate, timeout: float) -> bool:
        """A worker's long poll, until ``predicate()`` holds or ``timeout`` passes; False (answer
        nothing) when its process has exited or been replaced meanwhile."""
        record = self._seen(worker)
        processes = record.processes
        if record.gone:
            return False
        await self.wait_for(predicate, timeout)
        return not record.gone and record.processes == processes

    async def take(self, worker: str, count: int, timeout: float) -> list[Job]:
        """Up to ``count`` queued jobs for ``worker``, waiting up to ``timeout`` for the first."""
        if not await self._poll(worker, lambda: bool(self.queue), timeout):
            return []
        taken = []
        while self.queue and len(taken) < count:
            job = self.jobs[self.queue.popleft()]
            job.status, job.worker, job.started = Status.IN_PROGRESS, worker, time.monotonic()
            if self.execution_timeout is not None:
                self._deadlines[job.id] = asyncio.create_task(self._expire(job, self.execution_timeout))
            taken.append(job)
        return taken

    async def _expire(self, job: Job, after: float) -> None:
        """Time a job out ``after`` seconds in progress (unless it ends first: this task is cancelled)."""
        await asyncio.sleep(after)
        del self._deadlines[job.id]  # first: _end cancels the deadline it finds, and this is it
        job.error = (f"the job ran longer than the endpoint's execution timeout of {after:g} s and "
                     "was stopped (python -m endpoint --execution-timeout SECONDS; 0: no limit)")
        self._stop(job)
        self._end(job, Status.TIMED_OUT)
        await self._notify()

    def _stop(self, job: Job) -> None:
        """Put a job in progress on its worker's stop list (the runpod SDK then cancels it)."""
        self.stops.setdefault(job.worker, set()).add(job.id)

    def _end(self, job: Job, status: Status) -> None:
        """Make a job final (the caller notifies the waiters)."""
        job.status, job.finished = status, time.monotonic()
        self.counts[status] += 1
        if deadline := self._deadlines.pop(job.id, None):
            deadline.cancel()

    def _reported(self, job_id: str, worker: str) -> Job | None:
        """The job a worker reports on, unless it is no longer that worker's to report."""
        record = self._seen(worker)
        job = self.jobs.get(job_id)
        if record.gone or job is None or job.worker != worker or job.status is not Status.IN_PROGRESS:
            return None
        return job

    async def stream(self, job_id: str, worker: str, output: Any) -> None:
        if job := self._reported(job_id, worker):
            job.chunks.append(output)
            await self._notify()

    async def finish(self, job_id: str, worker: str, result: dict[str, Any]) -> None:
        """Record job-done: ``{"output": ...}`` or ``{"error": ...}``."""
        if job_id in self.jobs:
            self.jobs[job_id].done_reports += 1
        if not (job := self._reported(job_id, worker)):
            return
        if result.get("error") is not None:
            job.error = result["error"]
            self._end(job, Status.FAILED)
        else:
            job.output = result.get("output")
            self._end(job, Status.COMPLETED)
        await self._notify()

    async def cancel(self, job_id: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None or job.final:
            return job
        if job.status is Status.IN_QUEUE:
            self.queue.remove(job.id)
        else:
            self._stop(job)
        self._end(job, Status.CANCELLED)
        await self._notify()
        return job

    async def stop_signals(self, worker: str, timeout: float) -> list[str]:
        if not await self._poll(worker, lambda: bool(self.stops.get(worker)), timeout):
            return []
        return sorted(self.stops.pop(worker, set()))

    async def purge(self) -> int:
        removed = len(self.queue)
        for job_id in list(self.queue):
            await self.cancel(job_id)
        return removed

    def revive(self, worker: str) -> None:
        """A process starts under ``worker``'s id (its first, or the next after ``forget``): the id
        is accepted again, initializing until the new process calls in."""
        record = self.workers.setdefault(worker, Worker())
        record.processes += 1
        record.gone, record.seen, record.restart_at = False, None, None

    async def forget(self, worker: str, status: int | None = None, restart_in: float | None = None) -> None:
        """A worker's process exited with ``status``, the next one due in ``restart_in`` seconds:
        jobs it held fail (it can no longer report them), its stop list goes with it, and whatever
        it still sends is ignored until ``revive``."""
        record = self.workers.setdefault(worker, Worker())
        record.gone, record.exit_status = True, status
        record.restart_at = None if restart_in is None else time.monotonic() + restart_in
        self.stops.pop(worker, None)
        for job in self.jobs.values():
            if job.worker == worker and job.status is Status.IN_PROGRESS:
                job.error = str(create_error_response(f"worker {worker} exited", "WorkerLost", 500)["error"])
                self._end(job, Status.FAILED)
        await self._notify()

    def ping(self, worker: str) -> None:
        self._seen(worker)

    def health(self, alive_within: float) -> dict[str, Any]:
        """RunPod's /health answer, plus ``local``: each worker's state and restarts."""
        now = time.monotonic()
        busy = {j.worker for j in self.jobs.values() if j.status is Status.IN_PROGRESS}
        states = {w: r.state(w in busy, now, alive_within) for w, r in self.workers.items()}
        count = Counter(states.values())
        # RunPod's answer has no field for timed-out jobs: they count as failed.
        failed = self.counts[Status.FAILED] + self.counts[Status.TIMED_OUT]
        return {
            "jobs": {"completed": self.counts[Status.COMPLETED], "failed": failed,
                     "cancelled": self.counts[Status.CANCELLED], "inQueue": len(self.queue),
                     "inProgress": sum(j.status is Status.IN_PROGRESS for j in self.jobs.values()),
                     "retried": 0},
            "workers": {"idle": count["ready"], "running": count["running"],
                        "ready": count["ready"] + count["running"], "initializing": count["initializing"],
                        "unhealthy": count["restarting"] + count["unresponsive"], "throttled": 0},
            "local": {w: self._detail(r, states[w], now) for w, r in self.workers.items()},
        }

    @staticmethod
    def _detail(record: Worker, state: str, now: float) -> dict[str, Any]:
        restart_in = None
        if state == "restarting" and record.restart_at is not None:
            restart_in = round(max(0.0, record.restart_at - now), 1)
        return {"state": state, "restarts": max(0, record.processes - 1),
                "lastExitStatus": record.exit_status, "restartIn": restart_in}
