"""An out-of-memory start, with half of the machine's memory held by another process: tried again
with a lower GPU_MEMORY_UTILIZATION, then answered with both values (the rest of the start-up
failures: tests/endpoint/test_startup_failures.py). It reads the machine's free memory, so it runs
alone (tests/parallel.py), last."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import engine_env
from test_startup_failures import answered, start

# A process that holds memory until its stdin closes, every page written when it is mapped.
HOLD = ("import mmap, sys\n"
        "flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE\n"
        "held = mmap.mmap(-1, int(sys.argv[1]), flags=flags)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n")


def meminfo(field: str) -> int:
    """A figure of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise KeyError(field)


@contextlib.contextmanager
def memory_held(size: int) -> Iterator[subprocess.Popen]:
    """``size`` bytes held by another process while the block runs; released when it ends."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.alone  # no other test may take or free memory meanwhile
def test_an_out_of_memory_start_is_tried_with_less_and_answered_with_what_was_lowered(models, tmp_path):
    """Without KV_CACHE_MEMORY_BYTES, vLLM's CPU worker reserves GPU_MEMORY_UTILIZATION of the
    machine's memory, and refuses to start when less is available. With about half of it held
    elsewhere, neither the worker's 0.95 nor its retry's 0.85 starts."""
    total = meminfo("MemTotal")
    size = meminfo("MemAvailable") - total // 2
    assert size > 0, "less than half of the memory is available before the test"
    with memory_held(size) as holder:
        available = meminfo("MemAvailable")
        endpoint = start(tmp_path, engine_env(models["tiny-llama"], KV_CACHE_MEMORY_BYTES=""))
        try:
            lowered = "GPU_MEMORY_UTILIZATION lowered from 0.95 to 0.85"
            message = answered(endpoint, f"also after a second start with {lowered}: out of memory while the "
                                         "engine started; set GPU_MEMORY_UTILIZATION or MAX_MODEL_LEN lower")
            log = endpoint.log()
            assert f"Engine start failed, trying once more with {lowered}: out of memory" in log
            for tried in ("0.95", "0.85"):  # vLLM's own words, each start's: the log's only
                assert f"is less than desired CPU memory utilization ({tried}, " in log
            assert "desired CPU memory" not in message
            assert endpoint.http.get("/health").json()["workers"]["ready"] == 1  # still answering
        finally:
            endpoint.stop()
    assert holder.returncode is not None and meminfo("MemAvailable") > available + size // 2
