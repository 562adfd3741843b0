"""A worker that could not start answers its jobs with the cause, then exits.

RunPod restarts a worker that exits, over and over while jobs wait, and the callers see only
``IN_QUEUE``. So after a start-up failure the worker takes jobs as usual and fails each one at once
with the cause: HTTP 503 in the route's dialect (OpenAI's, or Anthropic's on ``/v1/messages``), the
same error item on raw jobs. It does so for STARTUP_FAILURE_ANSWER_SECONDS (default 120), which
drains the queue so that the endpoint can scale down, then exits, so that RunPod replaces it: a new
worker tries the start again (the cause may have been fixed meanwhile, or been transient). The exit
status is 2 when settings must change, else 1; with 0 seconds the worker exits at once. The log
names the status (``exit 2``), in every mode: when the window begins, and when it ends.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any, NoReturn

from worker.startup.process_exit import set_status, stop_then_exit
from worker.wire.dialects import is_anthropic_route
from worker.wire.errors import ConfigError, ErrorPayload, StartupError, error_response

log = logging.getLogger(__name__)

__all__ = ["exit_status", "failure_item", "serve"]

ANSWER_CONCURRENCY = 16  # jobs answered at once: each takes no time
EXIT_BACKSTOP_SECONDS = 10.0  # after the SIGTERM that ends the window, exit even if the SDK hangs


def exit_status(failure: StartupError) -> int:
    """2: the configuration must change (a configuration error, or a failure naming settings);
    1: anything else."""
    return 2 if isinstance(failure, ConfigError) or failure.variables else 1


def failure_item(failure: StartupError, job: Any) -> ErrorPayload:
    """The error a job gets from a worker that could not start."""
    job_input = job.get("input") if isinstance(job, dict) else None
    route = job_input.get("openai_route") if isinstance(job_input, dict) else None
    anthropic = isinstance(route, str) and is_anthropic_route(route)
    return error_response(HTTPStatus.SERVICE_UNAVAILABLE, failure.refusal, anthropic=anthropic)


def _end_window(status: int) -> None:
    log.error("Stopping after the answer window (STARTUP_FAILURE_ANSWER_SECONDS): exit %d", status)
    stop_then_exit(status, EXIT_BACKSTOP_SECONDS)


def serve(failure: StartupError, seconds: float) -> NoReturn:
    """Answer every job with ``failure`` for ``seconds``, then exit (at once when 0)."""
    status = exit_status(failure)
    if seconds <= 0:
        log.error("No answer window (STARTUP_FAILURE_ANSWER_SECONDS=0): exit %d", status)
        sys.exit(status)
    import runpod

    from worker.scheduling import job_loop

    async def handler(job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        log.warning("Job %s: answered with the start-up failure", job.get("id"))
        yield failure_item(failure, job)

    log.error("Answering every job with this failure for %g s (STARTUP_FAILURE_ANSWER_SECONDS), then exiting "
              "with status %d so that RunPod replaces the worker", seconds, status)
    # Under uvicorn (--rp_serve_api) a SIGTERM, RunPod's or the window's own, ends the process in
    # main()'s SIGTERM handler, inside the SDK: the sys.exit below is not reached.
    set_status(status)
    window = threading.Timer(seconds, _end_window, args=(status,))
    window.daemon = True
    window.start()
    job_loop.install()
    runpod.serverless.start({"handler": handler, "concurrency_modifier": lambda _: ANSWER_CONCURRENCY,
                             "return_aggregate_stream": True})
    sys.exit(status)
