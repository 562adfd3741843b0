"""The serving modules imported beside the engine's start (``startup/serving_imports``), and forks
(vLLM's engine processes) that wait for the import in flight: a process forked in the middle of an
import hangs when it imports that module. A real worker forking its engine: tests/worker/test_process.py."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time

import pytest

from worker.startup import serving_imports

SLOW_SECONDS = 2.0


def test_the_modules_imported_beside_the_engine_start_exist():
    """The thread stops at the first that fails to import, silently (main() reports it)."""
    assert [name for name in serving_imports.SERVING_MODULES if importlib.util.find_spec(name) is None] == []


@pytest.fixture
def slow_module(tmp_path, monkeypatch):
    """A module whose import takes SLOW_SECONDS, the thread's first; its name. The next is missing:
    the thread stops there (vLLM's app modules are not imported here)."""
    name = f"slow_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / f"{name}.py").write_text(f"import time\ntime.sleep({SLOW_SECONDS})\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(serving_imports, "SERVING_MODULES", (name, f"{name}_missing"))
    yield name
    sys.modules.pop(name, None)


def fork_mid_import(name: str) -> tuple[int, float]:
    """Starts the imports, forks once the module's import is under way; the child imports the
    module and exits 0 if it was complete. The child's pid, and how long the fork took."""
    serving_imports.start()
    while name not in sys.modules:  # present from the start of its import
        time.sleep(0.01)
    began = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if importlib.import_module(name).DONE else 1)
        finally:
            os._exit(1)
    return pid, time.monotonic() - began


def exit_status(pid: int, seconds: float) -> int | None:
    """The child's exit status, or None if it still runs after ``seconds`` (then killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_a_fork_waits_for_the_import_in_flight_and_its_child_imports_the_module(slow_module):
    pid, forking = fork_mid_import(slow_module)
    assert exit_status(pid, 30) == 0  # a child forked mid-import hangs here (killed: None)
    assert forking > SLOW_SECONDS / 2  # the rest of the module's import, waited for


def test_past_its_bound_a_fork_goes_ahead_and_says_so(slow_module, monkeypatch, caplog):
    """The import may itself wait for a lock the forking thread holds: a fork never waits forever."""
    monkeypatch.setattr(serving_imports, "FORK_WAIT_SECONDS", 0.1)
    with caplog.at_level(logging.WARNING, serving_imports.__name__):
        pid, forking = fork_mid_import(slow_module)
    assert forking < SLOW_SECONDS / 2
    assert exit_status(pid, SLOW_SECONDS + 1) is None  # the hang the wait prevents, killed here
    assert "still importing" in caplog.text
