"""The worker's start, step by step, each failure a ``StartupError`` naming what to change.

0. ``fitness_checks``: RunPod's fitness checks of the host (``startup/fitness``);
1. ``fetch_model``: the hub checks and download of ``model/preflight``, before vLLM is imported
   (its phases told to the start-up watchdog);
2. ``read_config``: every setting, parsed by vLLM's parser (``config/worker_config``, ``ConfigError``);
3. ``start_engine``: vLLM's configuration (``ConfigError``: a combination vLLM rejects, an
   architecture it does not serve, a length that cannot fit the GPUs), then the engine.

A transient failure is tried once more, with its reason logged: a download the network
interrupted (huggingface_hub resumes it), and an engine that ran out of memory with a size the user
did not choose (``engine_failure``: the KV cache cannot hold the model's full length → vLLM fits
max_model_len to the memory; out of memory otherwise → a lower GPU_MEMORY_UTILIZATION). A second
engine start that fails too is answered saying what the worker changed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from worker.wire.errors import StartupError

if TYPE_CHECKING:
    from worker.config.engine_args import ResolvedArgs
    from worker.config.worker_config import WorkerConfig
    from worker.engine.vllm_engine import vLLMEngine
    from worker.model.preflight import Fetched, OnPhase
    from worker.scheduling.concurrency import Concurrency

log = logging.getLogger(__name__)

__all__ = ["RETRIED_UNLESS_CHOSEN", "chose", "engine_failure", "fetch_model", "fitness_checks", "read_config",
           "start_engine"]

RETRY_PAUSE_SECONDS = 3.0  # before a transient failure is tried again
OOM_UTILIZATION_STEP = 0.1  # an out-of-memory start is tried again with this much less memory

T = TypeVar("T")


def _once_more(step: Callable[[], T], what: str) -> T:
    """``step()``, tried a second time after a transient StartupError."""
    try:
        return step()
    except StartupError as failure:
        if not failure.transient:
            raise
        log.warning("%s failed, trying once more in %g s: %s", what, RETRY_PAUSE_SECONDS, failure.logged)
    time.sleep(RETRY_PAUSE_SECONDS)
    return step()


def fitness_checks() -> Callable[[], None]:
    """RunPod's fitness checks (``startup/fitness``) where the runpod SDK would run them, to run as the
    start's first step. Their settings are read now, then the SDK's own run is switched off
    (``hand_over``), before anything can call the SDK, a failed start's answers included."""
    from worker.startup.fitness import check, fitness_settings, hand_over

    try:
        settings = fitness_settings()
    except StartupError as failure:  # a bad value: the start's first step raises it
        return functools.partial(_raise, failure)
    finally:
        hand_over()
    return functools.partial(check, settings) if settings else _nothing


def _raise(failure: StartupError) -> None:
    raise failure


def _nothing() -> None:
    return None


def fetch_model(on_phase: OnPhase) -> tuple[Fetched, Fetched | None] | None:
    """The model's (and another tokenizer repo's) local snapshots, when a hub repo is configured;
    ``on_phase`` is told of each check and download (``Watchdog.enter``)."""
    from worker.config.model_request import model_request
    from worker.model.preflight import prepare

    request = model_request()
    return _once_more(lambda: prepare(request, on_phase), "Model download") if request else None


def read_config(downloaded: tuple[Fetched, Fetched | None] | None) -> WorkerConfig:
    """Every setting (``config/worker_config.load_config``), the model served from ``downloaded``; the
    fitness checks' variables, read in their first step, are known to its near-miss warnings."""
    from worker.config.settings import env_names
    from worker.config.worker_config import load_config
    from worker.startup.fitness import FitnessSettings

    return load_config(downloaded=downloaded, also_read=env_names(FitnessSettings))


# Flags a failed start is retried with lower, unless the user chose them: the console forms leave them
# empty (tests/unit/test_image_metadata.py).
RETRIED_UNLESS_CHOSEN = ("max_model_len", "gpu_memory_utilization")


def chose(args: ResolvedArgs, dest: str) -> bool:
    """Whether a layer above the worker's defaults set ``dest`` (the user's choice)."""
    setting = args.flags.get(dest)
    return setting is not None and setting.given and getattr(args.namespace, dest, None) is not None


def engine_failure(exc: BaseException, note: dict | None, args: ResolvedArgs) -> StartupError:
    """A failed engine start as a StartupError; transient (with the flags to retry with, and what they
    change) when memory was short for a size the user did not choose. ``note``: what vLLM's engine
    process logged. The exception's own text (vLLM's figures, paths, URLs) goes to the log only:
    callers get its kind."""
    from worker.vllm_adapter.engine_config import memory_utilization

    cause = f"{note['type']}: {note['message']}" if note else f"{type(exc).__name__}: {exc}"
    if note and note["kv_cache_too_small"]:
        return StartupError(
            "the KV cache cannot hold one request of max_model_len (vLLM's figures are in the worker's "
            "log); set MAX_MODEL_LEN lower, or give the KV cache more memory (GPU_MEMORY_UTILIZATION, "
            "KV_CACHE_MEMORY_BYTES)", detail=cause,
            variables=("MAX_MODEL_LEN", "GPU_MEMORY_UTILIZATION", "KV_CACHE_MEMORY_BYTES"),
            transient=not chose(args, "max_model_len"), retry={"max_model_len": -1},
            change="MAX_MODEL_LEN=-1 (vLLM fitting the length to the memory)")
    if note and note["out_of_memory"]:
        before = memory_utilization(args.engine_args)  # vLLM 0.34 resolves an unset one
        lower = round(before - OOM_UTILIZATION_STEP, 2)
        return StartupError(
            "out of memory while the engine started; set GPU_MEMORY_UTILIZATION or MAX_MODEL_LEN "
            "lower, or use GPUs with more memory (or more of them: TENSOR_PARALLEL_SIZE)", detail=cause,
            variables=("GPU_MEMORY_UTILIZATION", "MAX_MODEL_LEN", "TENSOR_PARALLEL_SIZE"),
            transient=not chose(args, "gpu_memory_utilization") and lower > 0,
            retry={"gpu_memory_utilization": lower},
            change=f"GPU_MEMORY_UTILIZATION lowered from {before} to {lower}")
    kind = note["type"] if note else type(exc).__name__
    return StartupError(f"the engine failed to start ({kind}; the worker's log has vLLM's error)",
                        detail=cause)


def _after_retry(failure: StartupError, retried: StartupError) -> StartupError:
    """``failure`` of the second start that ``retried`` asked for, however it failed: it says what the
    worker changed, and names that setting (``retry``'s flags by their env names)."""
    changed = (dest.upper() for dest in retried.retry)
    return type(failure)(f"also after a second start with {retried.change}: {failure}",
                         detail=failure.detail, variables=tuple(dict.fromkeys((*failure.variables, *changed))))


def _with_flags(config: WorkerConfig, changes: dict[str, object], reason: str) -> WorkerConfig:
    """``config`` with engine flags changed for a retry (shown as such in its summary)."""
    from worker.config.arg_parser import Setting

    engine_args = copy.deepcopy(config.args.engine_args)
    flags = dict(config.args.flags)
    for dest, value in changes.items():
        setattr(engine_args, dest, value)
        flags[dest] = Setting(dest, (), f"retry after {reason}", value)
    args = dataclasses.replace(config.args, engine_args=engine_args, flags=flags)
    return dataclasses.replace(config, args=args)


def _start_once(config: WorkerConfig, build: Callable[[WorkerConfig], T], note_dir: Path,
                attempt: int) -> T:
    from worker.vllm_adapter.engine_notes import (ENGINE_FAILURE_FILE_ENV, ENGINE_PHASE_FILE_ENV,
                                                  engine_failure as noted_failure, note_engine_failures)

    os.environ[ENGINE_FAILURE_FILE_ENV] = str(note_dir / f"attempt-{attempt}.json")
    os.environ[ENGINE_PHASE_FILE_ENV] = str(note_dir / f"attempt-{attempt}-phase.json")
    note_engine_failures(in_engine_process=False)
    try:
        return build(config)
    except StartupError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to start is answered on the jobs
        raise engine_failure(exc, noted_failure(), config.args) from exc


def start_engine(config: WorkerConfig,
                 build: Callable[[WorkerConfig], tuple[vLLMEngine, Concurrency]]
                 ) -> tuple[vLLMEngine, Concurrency]:
    """``build(config)``, tried once more with the failure's ``retry`` flags when it is transient."""
    with tempfile.TemporaryDirectory(prefix="engine-start-") as note_dir:
        try:
            return _start_once(config, build, Path(note_dir), 1)
        except StartupError as failure:
            if not failure.transient:
                raise
            log.warning("Engine start failed, trying once more with %s: %s", failure.change, failure.logged)
            retry = _with_flags(config, failure.retry, "running out of memory")
            try:
                started = _start_once(retry, build, Path(note_dir), 2)
            except StartupError as again:
                raise _after_retry(again, failure) from again
            log.info("Engine started on the second try, with %s", failure.change)
            return started
