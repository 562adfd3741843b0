"""The processor's description from /proc/cpuinfo, for the libraries that ask py-cpuinfo for it.

The runpod SDK asks py-cpuinfo for the processor's name as it is imported (``rp_debugger``, whose
output alone shows it). py-cpuinfo answers by running itself in a new Python process that times
CPUID in a busy loop: 1.5 s and 1.8 s of CPU on every worker start (a 2-core EPYC), while vLLM's
processes start beside it. ``install`` makes ``cpuinfo.get_cpu_info`` read, from /proc/cpuinfo, the
fields that the SDK and vLLM's usage statistics (off unless the operator turns them on) use.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import cpuinfo

__all__ = ["cpu_info", "install"]

PROC_CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo's name → py-cpuinfo's
_FIELDS = {"model name": "brand_raw", "cpu family": "family", "model": "model", "stepping": "stepping"}


@cache
def _read(path: Path) -> tuple[tuple[str, Any], ...]:
    try:
        first = path.read_text().split("\n\n")[0]  # the first processor's block
    except OSError:
        return ()
    fields = (line.partition(":") for line in first.splitlines())
    return tuple((_FIELDS[key.strip()], int(value) if value.strip().isdigit() else value.strip())
                 for key, _, value in fields if key.strip() in _FIELDS)


def cpu_info(path: Path = PROC_CPUINFO) -> dict[str, Any]:
    """py-cpuinfo's ``get_cpu_info()`` keys that /proc/cpuinfo has: ``count``, ``brand_raw``,
    ``family``, ``model``, ``stepping`` (on x86; elsewhere ``count`` at least)."""
    return {"count": os.cpu_count(), **dict(_read(path))}


def install() -> None:
    """From now on ``cpuinfo.get_cpu_info()`` is ``cpu_info()``: call it before the SDK is imported."""
    cpuinfo.get_cpu_info = cpu_info
