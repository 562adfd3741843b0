"""The engine's configuration as vLLM builds it, and what the worker reads from it before the
engine starts: the memory share it may use, a quick memory estimate, the configuration's hash (its
compile cache entry's name), the GPUs visible, the variables vLLM reads, and vLLM's reasons for
rejecting a configuration (the variable or the model's architecture at fault)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import pydantic
import torch
import vllm.envs
from vllm import AsyncEngineArgs
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.models.registry import ModelRegistry
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

__all__ = ["AsyncEngineArgs", "create_engine_config", "engine_config_message",
           "MemoryEstimate", "memory_estimate", "memory_utilization", "refused_variable",
           "unsupported_architectures", "visible_gpu_count", "vllm_env_names",
           "VLLM_RESOLVES_MEMORY_UTILIZATION", "VLLM_VERSION", "VllmConfig"]

VLLM_VERSION = vllm.__version__


def visible_gpu_count() -> int:
    """GPUs this process may use (after CUDA_VISIBLE_DEVICES); 0 on a machine without CUDA/ROCm."""
    return current_platform.device_count() if current_platform.is_cuda_alike() else 0


def create_engine_config(engine_args: AsyncEngineArgs) -> VllmConfig:
    """The engine's configuration, as `vllm serve` creates it (its scheduling defaults).

    Mutates ``engine_args``, as vLLM does."""
    return engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)


# vLLM 0.34 leaves gpu_memory_utilization unset (None) unless given, and resolves it by how it sizes
# the KV cache: 1.0 for its extensible KV cache (sized from the memory free after CUDA graph
# capture; CUDA and ROCm, without kv_cache_memory_bytes), else 0.92. Before 0.34 the default was 0.92.
VLLM_RESOLVES_MEMORY_UTILIZATION = next(
    f.default for f in dataclasses.fields(AsyncEngineArgs) if f.name == "gpu_memory_utilization") is None


def _utilization(cache_config: CacheConfig) -> float:
    """A built configuration's utilization (0.34 resolves an unset one in a property of its own)."""
    return getattr(cache_config, "resolved_gpu_memory_utilization", cache_config.gpu_memory_utilization)


def memory_utilization(engine_args: AsyncEngineArgs) -> float:
    """The share of accelerator memory an engine of ``engine_args`` may use: gpu_memory_utilization,
    or the value vLLM resolves an unset one to (building the configuration to learn it)."""
    if engine_args.gpu_memory_utilization is not None:
        return engine_args.gpu_memory_utilization
    return _utilization(create_engine_config(copy.deepcopy(engine_args)).cache_config)


def engine_config_message(exc: BaseException) -> str:
    """vLLM's reason for rejecting a configuration, without pydantic's boilerplate."""
    if isinstance(exc, pydantic.ValidationError):
        return "; ".join(err["msg"].removeprefix("Value error, ") for err in exc.errors())
    return str(exc) or type(exc).__name__


def vllm_env_names() -> frozenset[str]:
    """The environment variables vLLM itself reads (``vllm.envs``)."""
    return frozenset(vllm.envs.environment_variables)


def refused_variable(exc: BaseException) -> str | None:
    """The vLLM variable of this process that a configuration error is about, if any: from 0.34,
    vLLM refuses a removed variable (``vllm.envs.removed_environment_variables``) and
    VLLM_USE_V2_MODEL_RUNNER other than 1 (Model Runner V1 is gone), naming it first."""
    named = re.match(r"(VLLM_\w+)\b", engine_config_message(exc))
    return named[1] if named and named[1] in os.environ else None


def unsupported_architectures(model: str) -> list[str]:
    """The architectures a local model folder's config.json names when vLLM's registry has none of
    them ([] when it has one, or the folder cannot tell). vLLM may still serve such a model through
    its Transformers backend: ask only once vLLM has rejected the configuration."""
    try:
        architectures = json.loads((Path(model) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    supported = ModelRegistry.get_supported_archs()
    return [] if any(arch in supported for arch in architectures) else list(architectures)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One max-length request's needs against the accelerator memory the engine may use (bytes)."""

    weights: int
    kv_per_token: int
    budget: int

    def fits(self, tokens: int) -> bool:
        return self.weights + self.kv_per_token * tokens <= self.budget

    @property
    def max_tokens(self) -> int:
        return max(0, (self.budget - self.weights) // max(self.kv_per_token, 1))


def memory_estimate(vllm_config: VllmConfig) -> MemoryEstimate | None:
    """Weights and KV cache per token against the GPUs' memory × gpu_memory_utilization, before
    anything loads (None off CUDA/ROCm, or without a local folder whose safetensors give the
    weights' size). Ignores activations and CUDA graphs: a quick bound, not vLLM's profile."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if not current_platform.is_cuda_alike() or model.is_attention_free:
        return None
    weights = sum(f.stat().st_size for f in Path(model.model).glob("*.safetensors"))  # none: not a folder
    if not weights:
        return None
    gpus = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    kv_per_token = (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * gpus
                    * model.get_head_size() * _kv_element_size(vllm_config))
    budget = cache.kv_cache_memory_bytes + weights if cache.kv_cache_memory_bytes else \
        int(current_platform.get_device_total_memory() * _utilization(cache) * gpus)
    return MemoryEstimate(weights, kv_per_token, budget)


def _kv_element_size(vllm_config: VllmConfig) -> int:
    """Bytes per KV cache element: KV_CACHE_DTYPE's, or the model's ("auto")."""
    dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)
    return torch.empty((), dtype=dtype).element_size()
