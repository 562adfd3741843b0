"""Ending the worker's process from within: the runpod SDK told to stop, with a backstop.

SIGTERM to this process makes the SDK stop fetching jobs and finish those it holds, after which
``runpod.serverless.start`` returns and the caller exits with its status. The backstop exits anyway
after a delay, taking along the child processes (the SDK's heartbeat, vLLM's), which an immediate
exit would otherwise leave running.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

__all__ = ["exit_now", "kill_children", "stop_then_exit"]


def stop_then_exit(code: int, backstop_seconds: float) -> None:
    """Tell the SDK to stop (SIGTERM); exit with ``code`` after ``backstop_seconds`` if still running."""
    os.kill(os.getpid(), signal.SIGTERM)
    timer = threading.Timer(backstop_seconds, exit_now, args=(code,))
    timer.daemon = True
    timer.start()


def kill_children() -> None:
    """Kill this process's children (vLLM's engine processes; the SDK's heartbeat)."""
    for child in multiprocessing.active_children():
        child.kill()


def exit_now(code: int) -> None:
    """Exit at once with ``code``, killing the child processes first."""
    kill_children()
    os._exit(code)
