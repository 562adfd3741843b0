"""A pytest plugin for the contract run (``scripts/contract.sh`` loads it with ``-p``): vLLM is told
that Triton is present when it is not installed.

From 0.34, vLLM's CPU platform refuses to configure an engine on an x86 CPU without Triton
(``triton-cpu``, which the package registry does not have); 0.33 only warned. The contract check
builds engine configurations but never runs a kernel, so it configures as every machine the worker
ships to does: the GPU image has Triton, and so does a 0.34 CPU machine. Only the flag that vLLM's
platform and config code read when they run (``vllm.triton_utils.HAS_TRITON``) changes; modules that
copied it at import keep their no-Triton fallbacks, so nothing tries to load Triton itself. What
this hides (vLLM's choice of kernels and model runner without Triton) is outside the contract: see
docs/development.md.
"""

from __future__ import annotations

import importlib.util

import pytest

_STATE = {"told": False}


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    import vllm.triton_utils

    if not vllm.triton_utils.HAS_TRITON:
        vllm.triton_utils.HAS_TRITON = True
        _STATE["told"] = True


def pytest_report_header(config: pytest.Config) -> str | None:
    if _STATE["told"]:
        return "contract: Triton is not installed; vLLM is told it is (vllm.triton_utils.HAS_TRITON)"
    return None
