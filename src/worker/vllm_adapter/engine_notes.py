"""Notes from vLLM's engine processes to the worker's: why one failed to start (its exception, read
as out of memory or a KV cache too small, which a retry with less memory may fix) and that the
weights are loaded (for the start-up watchdog). Each process writes them through the log record
factory; the worker reads them back from files named by its environment."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
import types
from contextlib import suppress
from pathlib import Path

import torch

from worker.env_text import env_value
from worker.wire.redact import mask_urls

__all__ = ["ENGINE_FAILURE_FILE_ENV", "engine_failure", "engine_phase", "ENGINE_PHASE_FILE_ENV",
           "failure_note", "note_engine_failures", "WEIGHTS_LOADED_LOGS"]

# vLLM's engine processes report a failed start only in their log ("EngineCore failed to start"):
# the worker's main process sees "Engine core initialization failed. See root cause above". Each of
# them notes the first exception it logs in this file, which the worker reads to tell the caller;
# and, in another, the end of their weights' load (``engine_phase``), for the start-up watchdog.
ENGINE_FAILURE_FILE_ENV = "WORKER_ENGINE_FAILURE_FILE"
ENGINE_PHASE_FILE_ENV = "WORKER_ENGINE_PHASE_FILE"
# Where vLLM raises when the KV cache cannot hold one request of max_model_len.
_KV_CACHE_CHECKS = frozenset({"check_enough_kv_cache_memory", "_check_enough_kv_cache_memory"})
# Where vLLM raises a ValueError when less memory is free at start than gpu_memory_utilization asks
# for (the raising function's qualified name): its GPU worker's check (0.32 to 0.34), and 0.32's CPU
# worker's. 0.33 moved the CPU one into CPUWorker.determine_available_memory, whose other
# ValueErrors a lower utilization does not fix (a KV_CACHE_MEMORY_BYTES too large; weights that fill
# the reservation): not classified.
_MEMORY_CHECKS = frozenset({"request_memory", "CPUWorker.__init__"})
# torch's CPU allocator fails with a plain RuntimeError: its text is the only mark.
_CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"
# vLLM 0.34's extensible KV cache commits memory through the GPU driver: every driver error is a
# RuntimeError raised in this module, with the driver's own text ("out of memory" for CUDA's and
# HIP's out-of-memory error).
_GPU_DRIVER_MODULE = "vmm_driver.py"
# vLLM's log lines (their templates) that say an engine process has loaded the weights: its
# default loader's, and the GPU model runner's (other loaders log neither; the phase then stays
# ``load``). The contract check looks for them in vLLM's source.
WEIGHTS_LOADED_LOGS = frozenset({"Loading weights took %.2f seconds",
                                 "Model loading took %s GiB memory and %.6f seconds"})


def failure_note(exc: BaseException) -> dict:
    """What the worker is told of an engine process's exception: ``type``, ``message``,
    ``out_of_memory`` (memory ran short: a lower gpu_memory_utilization may start) and
    ``kv_cache_too_small`` (the KV cache cannot hold one request of max_model_len)."""
    codes = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return {"type": type(exc).__name__, "message": mask_urls(str(exc)),
            "out_of_memory": _out_of_memory(exc, codes[-1] if codes else None),
            "kv_cache_too_small": any(code.co_name in _KV_CACHE_CHECKS for code in codes)}


def _out_of_memory(exc: BaseException, raised_in: types.CodeType | None) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    module, function = (Path(raised_in.co_filename).name, raised_in.co_qualname) if raised_in else ("", "")
    if isinstance(exc, RuntimeError):
        return _CPU_ALLOCATOR_FAILED in str(exc) or (
            module == _GPU_DRIVER_MODULE and "out of memory" in str(exc).lower())
    return isinstance(exc, ValueError) and function in _MEMORY_CHECKS


def _note_failure(exc: BaseException) -> None:
    """Write ``exc``'s ``failure_note`` to ENGINE_FAILURE_FILE_ENV's file (read now: each start attempt
    has its own), unless a process noted a failure there first."""
    path = env_value(ENGINE_FAILURE_FILE_ENV, os.environ)
    if not path:
        return
    note = failure_note(exc)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # noted already: the first failure is the cause
        return
    with os.fdopen(fd, "w") as file:
        json.dump(note, file)


def _note_phase(phase: str) -> None:
    """Write ``phase`` and the time to ENGINE_PHASE_FILE_ENV's file (each start attempt has its own)."""
    if path := env_value(ENGINE_PHASE_FILE_ENV, os.environ):
        with suppress(OSError):
            Path(path).write_text(json.dumps({"phase": phase, "at": time.time()}))


def note_engine_failures(*, in_engine_process: bool) -> None:
    """Note the first exception vLLM logs at ERROR in its engine processes ("EngineCore failed to
    start", with the exception), and the end of the weights' load. Through the log record factory:
    vLLM's own logging config, which each engine process applies again, drops any handler added to
    its loggers. Installed in the worker's process before the engine starts (a forked engine process
    inherits it; the worker's own records are not noted), and in a spawned one at import of the
    worker's main module."""
    skip_pid = None if in_engine_process else os.getpid()
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "notes_engine_failures", False):
        return

    def noting(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if not record.name.startswith("vllm") or os.getpid() == skip_pid:
            return record
        if record.levelno >= logging.ERROR and record.exc_info and record.exc_info[1] is not None:
            _note_failure(record.exc_info[1])
        elif record.msg in WEIGHTS_LOADED_LOGS:
            _note_phase("compile")
        return record

    noting.notes_engine_failures = True
    logging.setLogRecordFactory(noting)


def engine_failure() -> dict | None:
    """What an engine process noted (``failure_note``)."""
    path = env_value(ENGINE_FAILURE_FILE_ENV, os.environ)
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def engine_phase() -> tuple[str, float] | None:
    """The phase the engine's processes noted for this start attempt (``compile``: the weights are
    loaded), and the seconds since; None before they note one."""
    path = env_value(ENGINE_PHASE_FILE_ENV, os.environ)
    try:
        note = json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):  # none yet, or being written
        return None
    return (note["phase"], max(0.0, time.time() - note["at"])) if note else None
