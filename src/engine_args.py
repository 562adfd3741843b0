"""worker-vllm's import path for ``get_engine_args``; the worker itself calls ``resolve_args``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from worker.config.engine_args import resolve_args

if TYPE_CHECKING:
    from vllm import AsyncEngineArgs

__all__ = ["get_engine_args"]


def get_engine_args(env: Mapping[str, str] | None = None) -> AsyncEngineArgs:
    """vLLM's ``AsyncEngineArgs`` from every configuration layer (the environment by default)."""
    return resolve_args(env).engine_args
