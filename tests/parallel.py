"""How the suite runs in two processes (pytest-xdist: ``-n 2`` in pyproject.toml).

Most of a start (an engine, a worker, an endpoint) is one process importing vLLM on one core, so
two starts at a time use both cores. tests/conftest.py calls these from its hooks:

- ``GroupScheduling``, ``order``: the tests of a group run in one process: a module's (its
  module-scoped endpoints and engines start once), or all of tests/engine's (the session's engines
  start once). A process takes the next group when it is nearly done with its own: the longest
  groups first (``FIRST``), then the rest, then ``LAST``, then the short unit modules, to fill the
  end. (pytest-xdist's own ``--dist loadgroup`` marks a group in an item's node id, which pytest 9
  no longer reads.)
- ``one_at_a_time``: a test marked ``alone`` (one that measures the whole machine, its free memory)
  runs while no other test runs but unit tests (they start nothing and hold little memory): the
  other process waits before its next test that is not one. Such a test's module is in ``LAST``,
  handed out when the other process is about to run the unit tests, where it waits for nothing.

Engines keep vLLM's CPU settings (``VLLM_CPU_OMP_THREADS_BIND=0-1``): pinned to a core each, one
process's engine still shared its core with the other's starts, and a timed-out job's abort once
waited past 30 s.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from xdist.scheduler import LoadScopeScheduling

ENGINES = "tests/engine/"  # its modules share the session's engines (tests/conftest.py)
FIRST = (ENGINES, "tests/endpoint/test_compile_cache_volume.py", "tests/image/test_image.py",
         "tests/endpoint/test_startup_failures.py", "tests/endpoint/test_model_downloads.py",
         "tests/endpoint/test_adaptive_concurrency.py", "tests/worker/test_process.py")
FILLERS = "tests/unit/"
LAST = ("tests/endpoint/test_memory_held_start.py",)
# The processes of one run share these files (the first process to configure names them).
LOCKS = "TESTS_ONE_AT_A_TIME_LOCKS"


def group(nodeid: str) -> str:
    """The group of a test: tests/engine, or its module."""
    module = nodeid.split("::")[0]
    return ENGINES if module.startswith(ENGINES) else module


def _rank(name: str) -> tuple[int, int]:
    if name in FIRST:
        return 0, FIRST.index(name)
    if name in LAST:
        return 2, LAST.index(name)
    return (3 if name.startswith(FILLERS) else 1), 0


def order(items: list[pytest.Item]) -> None:
    """The tests in the order their groups are handed out in (``--no-loadscope-reorder``): FIRST's,
    the others as collected, LAST's, the unit modules."""
    items.sort(key=lambda item: _rank(group(item.nodeid)))  # stable: as collected within a rank


class GroupScheduling(LoadScopeScheduling):
    """pytest-xdist's scheduling by scope, a scope being a ``group``."""

    def _split_scope(self, nodeid: str) -> str:
        return group(nodeid)


_MADE: list[str] = []  # the lock folder, in the process that made it


def configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs while no test but unit tests runs (the other process waits)")
    if not os.environ.get(LOCKS):  # the controller, or a run without xdist: before any process starts
        _MADE.append(tempfile.mkdtemp(prefix="tests-locks-"))
        os.environ[LOCKS] = _MADE[0]


def unconfigure() -> None:
    for folder in _MADE:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def one_at_a_time(item: pytest.Item) -> Iterator[None]:
    """Holds the run's lock while ``item`` runs (set-up and tear-down included): shared by every test
    but the unit tests, exclusive for an ``alone`` one. An exclusive request holds the turnstile while
    it waits, so that no other test starts meanwhile (flock alone would let shared holders take turns
    for ever)."""
    if item.nodeid.startswith(FILLERS):
        yield
        return
    folder = os.environ[LOCKS]
    with (open(os.path.join(folder, "turnstile"), "a") as turnstile,
          open(os.path.join(folder, "tests"), "a") as lock):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
