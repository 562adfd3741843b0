"""What only serving needs (the runpod SDK, the job loop, the routes, vLLM's app), imported in a
thread while the engine starts, so that the seconds it takes hide behind vLLM's processes starting.

vLLM forks its engine processes (on a GPU, and on the CPU as the worker sets it:
``vllm_adapter/engine_env``). A process forked while another thread is importing a module inherits
that module's import lock, held by a thread the child does not have, and hangs when it imports the
module (seen: an engine's CPU worker stopped at "Starting to load model"). So the thread imports
one module at a time under a lock, and a fork takes that lock first: it waits for the import in
flight, never starts in the middle of one."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading

__all__ = ["SERVING_MODULES", "start"]

log = logging.getLogger(__name__)

# In this order; main() imports them again for use (and so reports a failure).
SERVING_MODULES = ("runpod", "worker.scheduling.job_loop", "worker.routes.serving")
# Past this a fork goes ahead: the import may wait for a lock that the forking thread holds.
FORK_WAIT_SECONDS = 60.0

_importing = threading.RLock()  # held through one import, and by a forking thread through its fork
_forking = threading.local()  # whether this thread's fork holds _importing


def start() -> threading.Thread:
    """The imports, started in a thread of their own; forks wait for the one in flight."""
    _guard_forks()
    thread = threading.Thread(target=_import_all, name="serving-imports", daemon=True)
    thread.start()
    return thread


def _import_all() -> None:
    """Each module in turn, then vLLM's app modules; stops at the first failure, silently."""
    try:
        for name in SERVING_MODULES:
            with _importing:
                importlib.import_module(name)
        with _importing:
            importlib.import_module("worker.vllm_adapter.openai_app").import_app_modules()
    except Exception:  # noqa: BLE001 - main() imports these again and reports the error
        return


@functools.cache
def _guard_forks() -> None:
    """Registered late, once: ``os.fork`` runs the handlers registered last first, so a fork waits
    here before it takes the locks of modules imported earlier (logging's, which an import needs)."""
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


def _before_fork() -> None:
    _forking.held = _importing.acquire(timeout=FORK_WAIT_SECONDS)
    if not _forking.held:
        log.warning("A process is forked while the serving modules are still importing (%.0f s)",
                    FORK_WAIT_SECONDS)


def _after_fork() -> None:
    if getattr(_forking, "held", False):
        _forking.held = False
        _importing.release()
