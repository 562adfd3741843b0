"""Ending the worker's process from within: the runpod SDK told to stop, with a backstop.

SIGTERM to this process makes the SDK stop fetching jobs and finish those it holds, after which
``runpod.serverless.start`` returns and the caller exits with its status. The backstop exits anyway
after a delay, taking along the child processes (the SDK's heartbeat, vLLM's), which an immediate
exit would otherwise leave running.

Under the SDK's local API server (``--rp_serve_api``, uvicorn) ``start`` does not return: uvicorn
catches the SIGTERM, stops, puts the previous handler back and raises the signal again, so the
process exits from ``exit_on_sigterm`` (``main()``'s handler), inside ``start``. That handler
therefore exits with the status the worker chose (``set_status``, ``stop_then_exit``), 0 unless
one was chosen: the status the log names, in every mode.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Any, NoReturn

__all__ = ["exit_now", "exit_on_sigterm", "kill_children", "set_status", "stop_then_exit"]

_status = 0  # what a SIGTERM exits with (exit_on_sigterm)


def set_status(code: int) -> None:
    """Make a SIGTERM, the worker's own or RunPod's, exit with ``code``."""
    global _status
    _status = code


def exit_on_sigterm(_signum: int, _frame: Any) -> NoReturn:
    """``main()``'s SIGTERM handler: exit through Python (``finally`` blocks run) with the status set."""
    raise SystemExit(_status)


def stop_then_exit(code: int, backstop_seconds: float) -> None:
    """Tell the SDK to stop (SIGTERM); exit with ``code`` after ``backstop_seconds`` if still running."""
    set_status(code)
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
