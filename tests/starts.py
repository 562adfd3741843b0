"""What the suite started and what each start cost, for the lines it ends with (tests/conftest.py's
``pytest_terminal_summary``): engines in this process, ``vllm serve`` servers, worker processes,
local endpoints (and the workers under them) and images; and the seconds each folder's tests took
(their set-up, call and tear-down, summed). The suite's budget is in docs/development.md; these
lines are where its growth shows."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["by_folder", "merge", "record", "step", "summary", "timed", "to_send"]

KINDS = ("engines", "vllm serve", "worker processes", "endpoints", "images")
_SECONDS: dict[str, list[float]] = defaultdict(list)
_WORKERS: list[int] = []  # under each endpoint
_FOLDERS: dict[str, float] = defaultdict(float)  # tests/<folder> → seconds of its tests' steps


def record(kind: str, seconds: float, workers: int = 0) -> None:
    """One start of ``kind`` (one of KINDS) that took ``seconds``; an endpoint's with its workers."""
    assert kind in KINDS, kind
    _SECONDS[kind].append(seconds)
    if workers:
        _WORKERS.append(workers)


@contextmanager
def timed(kind: str, workers: int = 0) -> Iterator[None]:
    """Records the block as one start of ``kind``, failed or not."""
    started = time.monotonic()
    try:
        yield
    finally:
        record(kind, time.monotonic() - started, workers)


def step(nodeid: str, seconds: float) -> None:
    """A test's set-up, call or tear-down took ``seconds``."""
    _FOLDERS[nodeid.split("/")[1] if nodeid.count("/") > 1 else nodeid] += seconds


def by_folder() -> str:
    """``seconds by folder: endpoint 900, engine 400, ...`` (two processes at once: more than the wall)."""
    parts = [f"{folder} {seconds:.0f}" for folder, seconds in sorted(_FOLDERS.items(), key=lambda f: -f[1])]
    return "seconds by folder (steps summed): " + ", ".join(parts)


def to_send() -> dict:
    """This process's starts, for the process that reports (pytest-xdist's controller)."""
    return {"seconds": dict(_SECONDS), "workers": list(_WORKERS)}


def merge(sent: dict) -> None:
    """Adds another process's starts (``to_send``) to this one's."""
    for kind, seconds in sent.get("seconds", {}).items():
        _SECONDS[kind].extend(seconds)
    _WORKERS.extend(sent.get("workers", []))


def summary() -> str:
    """``started: 3 engines in 61 s, 40 endpoints (52 workers) in 700 s, ...``: every kind started."""
    parts = []
    for kind in KINDS:
        if seconds := _SECONDS.get(kind):
            workers = f" ({sum(_WORKERS)} workers)" if kind == "endpoints" else ""
            parts.append(f"{len(seconds)} {kind}{workers} in {sum(seconds):.0f} s")
    return "started: " + (", ".join(parts) if parts else "nothing")
