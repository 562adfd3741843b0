"""The job-take request: the runpod SDK's ``rp_job.get_job`` (runpod 1.10.0), reading the answer so
that one job nested too deep for Python's JSON parser fails alone.

The SDK parses a job-take answer (one job, or a batch of them) with ``json.loads``: a job input
nested ~1,000 levels deep raises RecursionError there, which fails the whole batch. RunPod has
already marked its jobs taken, so none of them is ever answered, other callers' jobs included; they
stay in progress until the endpoint's execution timeout. ``take_jobs`` reads the answer with
``wire/nesting.loads`` instead: the same ``json.loads`` for an answer it can parse, and for one it
cannot, each job alone, a job too deep keeping its input as unparsed ``Raw`` text, which the
handler refuses with a 400 (``jobs/job_input``). Everything else is the SDK's, and
``tests/unit/test_job_loop.py`` notices when the SDK's ``get_job`` changes.
"""

from __future__ import annotations

import logging
from typing import Any

from runpod.http_client import ClientSession, TooManyRequests
from runpod.serverless.modules import rp_job

from worker.wire import nesting

log = logging.getLogger(__name__)

__all__ = ["take_jobs"]

# Splitting an answer too deep to parse whole: a batch into its jobs, a job into its fields, and its
# input into its keys (so that the error is in the dialect of the route an OpenAI-route job names).
_LEVELS = 3


async def take_jobs(session: ClientSession, num_jobs: int = 1) -> list[dict[str, Any]] | None:
    """Up to ``num_jobs`` jobs from RunPod's job-take URL (the batch URL for more than one), or None."""
    async with session.get(rp_job._job_get_url(num_jobs)) as response:
        if response.status in (204, 400):  # no job; 400 is expected with FlashBoot (the SDK's words)
            return None
        if response.status == 429:
            raise TooManyRequests(response.request_info, response.history, status=response.status,
                                  message=response.reason)
        response.raise_for_status()
        if response.content_type != "application/json" or response.content_length == 0:
            return None
        body = await response.read()
    try:
        jobs = nesting.loads(body, _LEVELS)
    except ValueError as exc:  # the SDK drops it too, with a debug line
        log.error("The job-take answer is not JSON (%s); no job taken", exc)
        return None
    if isinstance(jobs, dict):  # the single-job API
        if "id" not in jobs or "input" not in jobs:
            raise ValueError("Job has missing field(s): id or input.")
        return [jobs]
    return jobs if isinstance(jobs, list) else None
