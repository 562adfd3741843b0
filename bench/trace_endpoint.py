"""Runs the local endpoint with time stamps on its job path: ``TRACE_FILE=f python bench/trace_endpoint.py
[python -m endpoint's arguments]``.

Items 7-9 of the bench need the endpoint's side of a job to the microsecond (its ``/status`` times are
whole milliseconds of ``time.monotonic``), without changing the endpoint: this wraps an OpenAI request's
arrival (``openai`` entered), the job's submission, its hand-over to a worker (``take`` returns it), the
worker's first job-stream and its job-done posts (received) and the first SSE write to the client
(written), appending ``stage job_id time.time()`` lines to ``TRACE_FILE`` as ``bench/trace_worker.py``
does, then runs ``python -m endpoint``'s ``main()``.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from aiohttp import web  # noqa: E402
from endpoint import __main__ as cli  # noqa: E402
from endpoint.app import Endpoint  # noqa: E402
from endpoint.jobs import JobStore  # noqa: E402

from bench.trace_worker import stamp  # noqa: E402

_received: contextvars.ContextVar[float] = contextvars.ContextVar("received")
_job: contextvars.ContextVar[str | None] = contextvars.ContextVar("job", default=None)


def _wrap_openai(openai):
    @functools.wraps(openai)
    async def traced(self, request):
        """Marks this request's context (one connection may carry several requests)."""
        tokens = _received.set(time.time()), _job.set(None)
        try:
            return await openai(self, request)
        finally:
            _received.reset(tokens[0])
            _job.reset(tokens[1])
    return traced


def _wrap_submit(submit):
    @functools.wraps(submit)
    async def traced(self, job_input):
        job = await submit(self, job_input)
        if (received := _received.get(None)) is not None:  # an OpenAI request: its handler's task
            stamp("endpoint_received", job.id, received)
            _job.set(job.id)
        stamp("submitted", job.id)
        return job
    return traced


def _wrap_take(take):
    @functools.wraps(take)
    async def traced(self, worker, count, timeout):
        jobs = await take(self, worker, count, timeout)
        for job in jobs:
            stamp("taken", job.id)
        return jobs
    return traced


def _wrap_report(stage: str, report):
    @functools.wraps(report)
    async def traced(self, request):
        stamp(stage, request.match_info["job_id"])
        return await report(self, request)
    return traced


def _wrap_write(write):
    @functools.wraps(write)
    async def traced(self, data):
        await write(self, data)
        if (job_id := _job.get()) is not None:
            stamp("sse_written", job_id)
    return traced


def install() -> None:
    Endpoint.openai = _wrap_openai(Endpoint.openai)
    Endpoint.job_stream = _wrap_report("stream_received", Endpoint.job_stream)
    Endpoint.job_done = _wrap_report("done_received", Endpoint.job_done)
    JobStore.submit = _wrap_submit(JobStore.submit)
    JobStore.take = _wrap_take(JobStore.take)
    web.StreamResponse.write = _wrap_write(web.StreamResponse.write)


if __name__ == "__main__":
    install()
    cli.main()
