"""RunPod entry point: ``python src/handler.py``.

Accepted job inputs (``job["input"]``, read by ``jobs/job_input``):

- raw:    ``{"prompt" | "messages", "sampling_params", "stream", "apply_chat_template", "model"}``
          (``model``: a LoRA adapter's name), answered in the seed's tokens format or, with
          ``RAW_JOB_FORMAT=openai``, as worker-vllm 2.24 answers it (``routes/raw_format``)
- OpenAI: ``{"openai_route": "/v1/<route>", "openai_input": <request body>, "method"}`` (or
          worker-vllm 2.24's ``route`` and ``body``)
- both:   ``"timeout"``, and the stream batching knobs ``"max_batch_size", "min_batch_size",
          "batch_size_growth_factor"``; a request parameter beside them (``max_tokens``) is refused,
          any other key ignored with a warning (``engine/sampling.check_top_level``)

Start-up (main process only; vLLM's spawned workers re-import this file as ``__mp_main__``):
check and fetch the model, read and validate all configuration, build the engine
(``startup/steps``), then hand ``handler`` to ``runpod.serverless.start``, so jobs are taken only
once the engine is ready. A start that fails answers every job with the cause for a while, then
exits: status 2 when settings must change, 1 otherwise (``startup/failed_start``).

On a load-balancing endpoint (``config/early_settings.endpoint_kind``) the worker serves HTTP
instead of taking jobs (``load_balancer/``): its port answers ``/ping`` from the first moment, vLLM's
routes and raw jobs (``handler``, on ``/runsync`` and ``/stream``) once the engine is ready, and a
failed start's cause in the same way.

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
import time
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from worker.env_text import env_value
from worker.jobs.deadlines import DeadlinePassed, Deadlines, deadline_error
from worker.jobs.job_input import JobInput
from worker.startup import cpu_info
from worker.startup.process_exit import exit_on_sigterm, stop_then_exit
from worker.wire.dialects import is_anthropic_route
from worker.wire.errors import RequestError, StartupError, error_from_exception, error_response
from worker.wire.redact import mask_log_records, mask_streams

if TYPE_CHECKING:
    from worker.config.early_settings import EndpointKind
    from worker.config.settings import WorkerSettings
    from worker.config.worker_config import WorkerConfig
    from worker.engine.vllm_engine import vLLMEngine
    from worker.load_balancer.server import WorkerServer
    from worker.scheduling.concurrency import Concurrency
    from worker.startup.watchdog import Watchdog

log = logging.getLogger("handler")

# Set at start-up by main(); tests set them to engines they built.
vllm_engine = None
openai_engine = None

# At most this many seconds between a fatal engine error and the exit (time to report jobs).
FATAL_EXIT_DELAY = 3.0
_engine_dead = threading.Event()
deadlines = Deadlines()


def _exit_soon(code: int) -> None:
    """Stop taking jobs now, report the ones in flight, then exit with ``code`` (main() exits with
    it once the SDK returns; the backstop after FATAL_EXIT_DELAY if that takes too long)."""
    if _engine_dead.is_set():
        return
    _engine_dead.set()
    stop_then_exit(code, FATAL_EXIT_DELAY)


def _add_grace_period(grace_period: float) -> None:
    """On SIGTERM or SIGINT, bound the jobs in flight by ``grace_period`` and tell the SDK.

    Called from the SDK's job loop, after the SDK installed its own handlers, which stop taking
    jobs but then wait for the jobs in flight without a limit.
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        sdk_handler = signal.getsignal(sig)

        def on_signal(sig=sig, sdk_handler=sdk_handler) -> None:
            waiting = deadlines.begin_shutdown(grace_period)
            log.info("%s: taking no more jobs; %d in flight get up to %g s to finish",
                     sig.name, waiting, grace_period)
            if callable(sdk_handler):
                sdk_handler(sig, None)

        loop.add_signal_handler(sig, on_signal)


def _engine_for(job_input: JobInput) -> Any:
    """The engine serving a job: the OpenAI routes' for a route, and for a raw job in worker-vllm
    2.24's format (RAW_JOB_FORMAT=openai); else the raw path's."""
    if job_input.openai_route is not None:
        return openai_engine
    if vllm_engine is not None and vllm_engine.settings.raw_job_format == "openai":
        return openai_engine
    return vllm_engine


async def handler(job: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    try:
        job_input = JobInput.from_job(job)
    except RequestError as exc:
        yield error_from_exception(exc, anthropic=_asks_anthropic(job))
        return
    engine = _engine_for(job_input)
    anthropic = is_anthropic_route(job_input.openai_route)  # errors in the route's dialect
    if engine is None:
        what = f"route {job_input.openai_route!r}" if job_input.openai_route else "raw jobs"
        yield error_response(HTTPStatus.BAD_REQUEST, f"this worker does not serve {what}",
                             anthropic=anthropic)
        return
    settings = engine.settings
    timeout, limit = settings.timeout_for(job_input.timeout)
    try:
        from worker.engine.sampling import check_top_level  # loaded already: the engine runs on it

        check_top_level(job_input, settings.raw_job_format, job.get("id"))
        async for item in deadlines.bound(engine.generate(job_input), timeout):
            yield item
    except DeadlinePassed as passed:
        yield deadline_error(f"Job {job.get('id')}", passed, timeout, settings.shutdown_grace_period,
                             anthropic, limit)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one structured error
        from worker.vllm_adapter.errors import error_status, is_fatal  # loaded already: the engine runs on it

        if is_fatal(exc):
            log.critical("Engine is dead (%s): exit 1, so that RunPod replaces this worker", exc)
            _exit_soon(1)
        else:
            log.warning("Job %s failed: %s", job.get("id"), exc)
        yield error_from_exception(exc, error_status(exc), anthropic=anthropic)


def _asks_anthropic(job: dict[str, Any]) -> bool:
    """Whether a job that failed validation named an Anthropic route (its error's dialect)."""
    job_input = job.get("input") if isinstance(job, dict) else None
    route = job_input.get("openai_route") if isinstance(job_input, dict) else None
    return isinstance(route, str) and is_anthropic_route(route)


def _configure_logging() -> None:
    # A URL's credentials (HF_ENDPOINT's) are masked in every line this process and vLLM's write.
    mask_streams()
    mask_log_records()
    logging.basicConfig(level=(env_value("LOG_LEVEL", os.environ) or "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _concurrency(settings: WorkerSettings, jobs: Concurrency, resizes_busy: bool) -> Callable[[int], int]:
    """The SDK's concurrency modifier: the controller's target. Its first call, in the SDK's job
    loop, adds the grace period. ``resizes_busy``: the job loop applies a new number to a worker
    holding jobs (``job_loop.JobLoop``); the SDK's own waits until the worker is empty, so it gets
    a new number only when the worker holds none."""
    grace_added = False

    def concurrency(current: int) -> int:
        nonlocal grace_added
        if not grace_added:
            _add_grace_period(settings.shutdown_grace_period)
            grace_added = True
        return jobs.target if resizes_busy or not deadlines.running else current

    return concurrency


def start_engine(config: WorkerConfig, *, warm_up: bool = True) -> tuple[vLLMEngine, Concurrency]:
    """The engine, and the concurrency controller its scheduler feeds (how many jobs to hold), whose
    KV budget the engine's admission gate keeps (which requests vLLM runs)."""
    from worker.engine.admission import Admission
    from worker.engine.vllm_engine import vLLMEngine
    from worker.scheduling.concurrency import Concurrency

    settings = config.settings
    jobs = Concurrency(settings.min_concurrency, settings.max_concurrency, held=lambda: deadlines.running,
                       take_latency=settings.job_take_latency, kv_overcommit=settings.kv_overcommit)
    # A fixed number needs no scheduler statistics (which cost the engine some CPU per token), and
    # no KV budget: the jobs held all go to vLLM, as worker-vllm's do (the gate refuses n > MAX_N).
    gate = Admission(lambda: jobs.kv, settings.max_n)
    engine = vLLMEngine(config, warm_up=False, on_load=None if jobs.fixed else jobs.observe,
                        admitted=gate.admitted)
    jobs.set_cap(engine.max_concurrency)
    if not jobs.fixed and (kv_cache := engine.kv_cache):  # else requests pass the gate uncounted
        jobs.set_kv_cache(*kv_cache)
    if warm_up:
        engine.warm_up().result()
    return engine, jobs


def _start(phase: Callable[[str], None], watchdog: Watchdog,
           check_fitness: Callable[[], None]) -> tuple[WorkerConfig, Concurrency, str]:
    """Everything start-up does before jobs are taken (``startup/steps``), in the watchdog's phases;
    sets the engines."""
    global vllm_engine, openai_engine
    from worker.engine.compile_cache import EngineStart
    from worker.startup import serving_imports
    from worker.startup.steps import fetch_model, read_config
    from worker.startup.steps import start_engine as start_with_retry

    check_fitness()  # RunPod's checks, before the worker takes any memory or disk
    phase("checks")
    # Before vLLM is imported: a bad repo or token is answered in seconds.
    downloaded = fetch_model(watchdog.enter)
    phase("model")
    watchdog.enter("load")
    from worker.vllm_adapter.engine_env import CACHE_ENTRY_DIRS, cache_root
    from worker.vllm_adapter.engine_notes import engine_phase

    watchdog.engine_phase = engine_phase
    config = read_config(downloaded)
    phase("config")
    cache = EngineStart.begin(Path(cache_root()), CACHE_ENTRY_DIRS, config.volume_cache)
    phase("cache")
    # What only serving needs is imported while vLLM's processes start (not at the top:
    # vLLM's spawned processes re-import this file).
    serving_imports.start()
    vllm_engine, jobs = start_with_retry(config, lambda cfg: start_engine(cfg, warm_up=False))
    phase("engine")
    watchdog.enter("warm-up")
    from worker.routes.serving import OpenAIvLLMEngine
    from worker.scheduling import job_loop

    jobs.on_raise = job_loop.wake
    cache_state = cache.end(vllm_engine.compiles)
    warming = vllm_engine.warm_up()  # beside building the app: both wait on vLLM's processes
    openai_engine = OpenAIvLLMEngine(vllm_engine)
    warming.result()
    phase("serving")
    return vllm_engine.config, jobs, cache_state


def _bind_ports(kind: EndpointKind) -> WorkerServer | None:
    """On a load-balancing endpoint, the HTTP server, answering ``/ping`` from now on."""
    if not kind.load_balancer:
        return None
    from worker.load_balancer.server import WorkerServer

    log.info("Serving HTTP: a load-balancing endpoint (%s)", kind.reason)
    try:
        return WorkerServer(kind)
    except OSError as exc:  # nothing can answer callers: say why in the log
        log.critical("Cannot listen on port %d (PORT) or %d (PORT_HEALTH): %s", kind.port, kind.health_port, exc)
        sys.exit(1)


def _answer_failure(failure: StartupError, server: WorkerServer | None) -> NoReturn:
    """Answer every job or request with ``failure`` for a while, then exit with its status."""
    from worker.config.early_settings import failure_answer_seconds
    from worker.startup import failed_start

    seconds = failure_answer_seconds()
    if server is None or seconds <= 0:
        failed_start.serve(failure, seconds)
    status = failed_start.exit_status(failure)
    server.answer_failure(failure, seconds, status)
    sys.exit(status)


def _serve_http(server: WorkerServer, settings: WorkerSettings) -> None:
    """Serve the routes and raw jobs over HTTP until SIGTERM (``load_balancer/server``)."""
    from worker.load_balancer.app import Serving
    from worker.vllm_adapter.engine import is_dead

    server.serve(Serving(openai_engine.app, openai_engine.routes, handler, deadlines, settings,
                         is_dead=lambda: is_dead(vllm_engine.llm), on_death=lambda: _exit_soon(1)),
                 vllm_engine.loop)


def _take_jobs(config: WorkerConfig, jobs: Concurrency) -> None:
    """Take jobs from RunPod's queue until SIGTERM (the runpod SDK's loop)."""
    import runpod

    from worker.scheduling import job_loop

    resizes_busy = job_loop.install(config.settings.job_loop == "worker")
    runpod.serverless.start({
        "handler": handler,
        "concurrency_modifier": _concurrency(config.settings, jobs, resizes_busy),
        "return_aggregate_stream": True,
    })


# The one .env the worker reads: beside ``src/`` (the checkout's root; ``/.env`` in the image), wherever
# the process runs (the local endpoint's workers run in a temporary folder).
ENV_FILE = Path(__file__).resolve().parent.parent / ".env"


def load_env_file(path: Path = ENV_FILE) -> bool:
    """Load ``path`` (``ENV_FILE``) into the environment, for local development; a variable already
    set wins. No upward search and no working-directory lookup: one place in the checkout, the local
    endpoint and the image. Whether the file was there."""
    from dotenv import load_dotenv

    return load_dotenv(path, override=False)


def set_up_process() -> None:
    """What comes before anything else: py-cpuinfo's probe replaced before the runpod SDK asks it
    (startup/cpu_info), then the .env read, then logging set up (LOG_LEVEL may be in the .env)."""
    cpu_info.install()
    load_env_file()
    _configure_logging()


def main() -> None:
    set_up_process()
    # SIGTERM exits through Python, so the ``finally`` below shuts vLLM down. The runpod SDK's job
    # loop replaces this handler with its own; uvicorn (--rp_serve_api) re-raises the SIGTERM it
    # handled once it has stopped, which would otherwise kill the process on the spot. There this
    # handler ends the process, inside the SDK: it exits with the status the worker chose (a failed
    # start's, a dead engine's), not 0, else the log's "exit 2" would be a 0 (process_exit).
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    phases, mark = {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name], mark = now - mark, now

    from worker.config.early_settings import endpoint_kind, startup_timeout
    from worker.startup.steps import fitness_checks
    from worker.startup.watchdog import Watchdog

    check_fitness = fitness_checks()  # the worker runs the SDK's checks itself, before it loads anything

    watchdog = Watchdog(startup_timeout(), clock=time.perf_counter, started=mark)  # from main()'s start
    phase("imports")
    server = None
    try:
        kind = endpoint_kind()
        server = _bind_ports(kind)
        config, jobs, cache_state = watchdog.run(lambda: _start(phase, watchdog, check_fitness))
    except StartupError as failure:
        log.error("Worker could not start: %s", failure.logged)
        _answer_failure(failure, server)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the callers are told
        log.exception("Worker startup failed")
        if vllm_engine is not None:  # it failed after the engine started: stop vLLM's processes
            vllm_engine.shutdown()
        _answer_failure(StartupError(f"an unexpected {type(exc).__name__} during start-up (the worker's log "
                                     "has its traceback)", detail=str(exc)), server)
    log.info("Worker ready: %s; start-up %s; compile cache %s",
             f"serving HTTP on port {kind.port}" if server else
             f"taking {jobs.floor} to {jobs.cap} concurrent jobs, {jobs.target} at first",
             " ".join(f"{name}={seconds:.2f}s" for name, seconds in phases.items()), cache_state)
    try:
        if server:
            _serve_http(server, config.settings)
        else:
            _take_jobs(config, jobs)
    finally:  # both return after SIGTERM: stop vLLM's processes rather than orphan them
        vllm_engine.shutdown()
    if _engine_dead.is_set():
        sys.exit(1)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a vLLM process spawned by this worker: note why it fails to start
    from worker.vllm_adapter.engine_notes import note_engine_failures

    mask_streams()  # as in the worker's process, which a forked one inherits
    mask_log_records()
    note_engine_failures(in_engine_process=True)
