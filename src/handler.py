"""RunPod entry point: ``python src/handler.py``.

Accepted job inputs (``job["input"]``):

- raw:    ``{"prompt" | "messages", "sampling_params", "stream", "apply_chat_template",
          "max_batch_size", "min_batch_size", "batch_size_growth_factor"}``
- OpenAI: ``{"openai_route": "/v1/<route>", "openai_input": <request body>}``

Start-up (main process only; vLLM's spawned workers re-import this file as ``__mp_main__``):
read and validate all configuration, build the engine, then hand ``handler`` to
``runpod.serverless.start``, so jobs are taken only once the engine is ready. A configuration
error exits with status 2 before the model loads; any other start-up failure with status 1.

A failing job yields one ``{"error": {...}}`` item and the worker keeps serving, unless the
engine itself is dead: then the worker exits with status 1 and RunPod replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from errors import ConfigError, RequestError, create_error_response, error_from_exception, is_fatal
from job_input import JobInput

log = logging.getLogger("handler")

# Set at start-up by main(); tests set them to engines they built.
vllm_engine = None
openai_engine = None

# At most this many seconds between a fatal engine error and the exit (time to report jobs).
FATAL_EXIT_DELAY = 3.0
_engine_dead = threading.Event()


def _exit_soon(code: int) -> None:
    """Stop taking jobs now, report the ones in flight, then exit with ``code``.

    SIGTERM makes the runpod SDK stop fetching jobs and finish (here: fail) those it holds;
    main() then exits with ``code``. The timer is the backstop if that takes too long.
    """
    if _engine_dead.is_set():
        return
    _engine_dead.set()
    os.kill(os.getpid(), signal.SIGTERM)
    timer = threading.Timer(FATAL_EXIT_DELAY, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


async def handler(job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    try:
        job_input = JobInput.from_job(job)
    except RequestError as exc:
        yield error_from_exception(exc)
        return
    engine = openai_engine if job_input.openai_route else vllm_engine
    if engine is None:
        what = f"route {job_input.openai_route!r}" if job_input.openai_route else "raw jobs"
        yield create_error_response(f"this worker does not serve {what}")
        return
    timeout = job_input.timeout or engine.settings.job_timeout
    try:
        # On expiry the job's generator is cancelled, which aborts its vLLM request.
        async with asyncio.timeout(timeout):
            async for item in engine.generate(job_input):
                yield item
    except TimeoutError:
        log.warning("Job %s ran past its %s s timeout; aborted", job.get("id"), timeout)
        yield create_error_response(f"the job ran past its timeout of {timeout:g} s and was aborted",
                                    status_code=HTTPStatus.REQUEST_TIMEOUT, param="timeout")
    except Exception as exc:  # noqa: BLE001 - every failure becomes one structured error
        if is_fatal(exc):
            log.critical("Engine is dead (%s); exiting so RunPod replaces this worker", exc)
            _exit_soon(1)
        else:
            log.warning("Job %s failed: %s", job.get("id"), exc)
        yield error_from_exception(exc)


def _configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    global vllm_engine, openai_engine
    _configure_logging()
    from dotenv import load_dotenv

    load_dotenv()  # ./.env for local development; never overrides the real environment
    import runpod  # here, not at the top: vLLM's spawned processes re-import this file

    from engine import vLLMEngine
    from openai_engine import OpenAIvLLMEngine
    from settings import load_config

    try:
        config = load_config()
    except ConfigError as exc:
        log.error("Worker configuration error: %s", exc)
        sys.exit(2)
    try:
        vllm_engine = vLLMEngine(config)
        openai_engine = OpenAIvLLMEngine(vllm_engine)
    except Exception:
        log.exception("Worker startup failed")
        sys.exit(1)
    log.info("Worker ready: taking up to %d concurrent jobs", config.settings.max_concurrency)
    try:
        runpod.serverless.start({
            "handler": handler,
            "concurrency_modifier": lambda _current: config.settings.max_concurrency,
            "return_aggregate_stream": True,
        })
    finally:  # the SDK returns after SIGTERM: stop vLLM's processes rather than orphan them
        vllm_engine.shutdown()
    if _engine_dead.is_set():
        sys.exit(1)


if __name__ == "__main__":
    main()
