"""The one module that imports vLLM (and torch), where vLLM's moved or renamed names are resolved.

Everything here is vLLM 0.32's own API, re-exported under stable names, plus the few helpers
whose shape depends on vLLM's internals (the CLI parser, sampling-parameter validation). Two other
modules change with vLLM by design, without importing it: ``config/arg_parser`` reviews each of
``vllm serve``'s flags and ``routes/route_table`` each of its app's routes, so that a new flag or
route is noticed (by the tests and the contract check) instead of silently served or ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import importlib
import json
import logging
import os
import re
import socket
import time
import traceback
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, contextmanager, suppress
from http import HTTPStatus
from pathlib import Path

import aiohttp
import msgspec
import pydantic
import requests
import torch
import torch._dynamo.config
import urllib3
import vllm.envs
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
from vllm.config import CacheConfig, CompilationMode, VllmConfig
from vllm.connections import HTTPConnection

try:  # vLLM 0.34 hashes a configuration's compile factors; VllmConfig.compute_hash is gone
    from vllm.config.utils import hash_config as config_hash
except ImportError:  # vLLM 0.32, 0.33
    def config_hash(vllm_config: VllmConfig) -> str:
        return vllm_config.compute_hash()

try:  # vLLM 0.33 moved the serve CLI's arguments from launchers/ to common/
    from vllm.entrypoints.common.cli_args import (
        FrontendArgs,
        make_arg_parser,
        propagate_flash_late_interaction,
        validate_parsed_serve_args,
    )
except ModuleNotFoundError:  # vLLM 0.32
    from vllm.entrypoints.launchers.cli_args import (
        FrontendArgs,
        make_arg_parser,
        propagate_flash_late_interaction,
        validate_parsed_serve_args,
    )
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.exception_handling.error_response import (
    create_error_response as _vllm_error_response,
)
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard, ModelPermission
from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolverRegistry
from vllm.model_executor.models.registry import ModelRegistry
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.pooling_params import PoolingParams
from vllm.reasoning import ReasoningParserManager
from vllm.renderers.chat_utils import load_chat_template
from vllm.sampling_params import RequestOutputKind
from vllm.tasks import POOLING_TASKS
from vllm.tool_parsers import ToolParserManager
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.import_utils import import_from_path
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import AggregateStatLoggerBase, PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats

from worker.env_text import env_value, parse_bool
from worker.wire.errors import RequestError
from worker.wire.media_urls import MediaURLPolicy, origin, resolve
from worker.wire.redact import mask_urls

__all__ = [
    "Admitted", "APP_MODULES", "arg_annotations", "AsyncEngineArgs", "AsyncLLM", "build_arg_parser",
    "build_openai_app", "CACHE_ENTRY_DIRS", "cache_root", "compiles", "config_hash", "create_engine_config",
    "engine_arg_dests", "engine_args_from", "engine_config_message", "engine_failure",
    "ENGINE_FAILURE_FILE_ENV", "engine_phase", "ENGINE_PHASE_FILE_ENV", "EngineDeadError", "error_status",
    "failure_note", "frontend_arg_dests", "gate_requests", "guard_media_urls", "import_app_modules",
    "is_dead", "is_fatal", "keep_adapters_loaded", "kv_cache_size", "load_adapter", "load_chat_template",
    "LoadObserver", "LoRARequest", "make_sampling_params", "max_cpu_loras", "max_num_seqs",
    "memory_estimate", "memory_utilization", "note_engine_failures", "plugin_adapter", "refused_variable",
    "POOLING_TASKS", "PoolingParams", "prompt_tokens", "REQUEST_ERRORS", "REQUEST_FIELDS", "RequestOutput",
    "RequestOutputKind", "SAMPLING_FIELDS", "SamplingParams", "serve_adapters", "start_engine",
    "TokensPrompt", "unsupported_architectures", "validate_frontend_args", "visible_gpu_count", "vllm_env_names",
    "VLLM_RESOLVES_MEMORY_UTILIZATION", "VLLM_VERSION", "VllmConfig", "WEIGHTS_LOADED_LOGS",
]

log = logging.getLogger(__name__)

VLLM_VERSION = vllm.__version__

# Errors after which the engine cannot serve again: the worker must be replaced.
FATAL_ERRORS: tuple[type[BaseException], ...] = (EngineDeadError, torch.AcceleratorError)
# Errors caused by the request (HTTP 4xx).
REQUEST_ERRORS = (VLLMClientError, ValueError, TypeError, msgspec.ValidationError)


def is_fatal(exc: BaseException) -> bool:
    """True when the engine cannot serve again and the process must be replaced."""
    return isinstance(exc, FATAL_ERRORS)


def is_dead(llm: AsyncLLM) -> bool:
    """True once the engine has failed for good (its processes died): the worker must be replaced."""
    return llm.errored


def error_status(exc: Exception) -> HTTPStatus:
    """What an exception from vLLM means, as `vllm serve` answers it: vLLM's own classification,
    which its API server's exception handlers use, by type (never the message). A
    ``GracefulHTTPError``'s own status (503 for a full queue), 503 for a retryable failure, 422 for
    content vLLM cannot process, 404 for what it does not have, 400 for a request it rejects, 501
    for what it does not implement, else 500."""
    return HTTPStatus(_vllm_error_response(exc).error.code)

# SamplingParams fields a job may set: the public ones, less those the worker controls.
_WORKER_CONTROLLED = frozenset({"output_kind", "skip_clone", "output_text_buffer_length"})
SAMPLING_FIELDS = frozenset(
    name for name in SamplingParams.__struct_fields__
    if not name.startswith("_") and name not in _WORKER_CONTROLLED
)


# The fields of the request bodies vLLM's completions and chat completions routes take.
REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


class _RaisingParser(FlexibleArgumentParser):
    """vLLM's parser, raising instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise argparse.ArgumentError(None, message)


def build_arg_parser() -> FlexibleArgumentParser:
    """`vllm serve`'s full parser: every engine flag plus the OpenAI front-end flags."""
    return make_arg_parser(_RaisingParser(prog="worker"))


def _arg_dests(args_class: type, prog: str) -> frozenset[str]:
    """Destinations of the flags one of vLLM's argument classes adds to a parser."""
    parser = args_class.add_cli_args(_RaisingParser(prog=prog))
    return frozenset(a.dest for a in parser._actions if a.dest != "help")


def engine_arg_dests() -> frozenset[str]:
    """Destinations of the engine flags (AsyncEngineArgs), without the front-end ones."""
    return _arg_dests(AsyncEngineArgs, "engine")


def frontend_arg_dests() -> frozenset[str]:
    """Destinations of the OpenAI front-end flags (FrontendArgs), without the engine ones."""
    return _arg_dests(FrontendArgs, "frontend")


def engine_args_from(namespace: argparse.Namespace) -> AsyncEngineArgs:
    """The engine's arguments from the parsed flags, as `vllm serve` derives them: a front-end
    flag that also configures the engine (``--no-enable-flash-late-interaction``) is passed on."""
    engine_args = AsyncEngineArgs.from_cli_args(namespace)
    propagate_flash_late_interaction(namespace, engine_args)
    return engine_args


def arg_annotations() -> dict[str, str]:
    """Each flag's declared type, as text (``int | None``), for error messages."""
    fields = (*dataclasses.fields(AsyncEngineArgs), *dataclasses.fields(FrontendArgs))
    return {f.name: re.sub(r"\b[\w.]+\.(\w+)", r"\1", getattr(f.type, "__name__", None)
                           if isinstance(f.type, type) else str(f.type)) for f in fields}


def validate_frontend_args(namespace: argparse.Namespace) -> list[str]:
    """Problems `vllm serve` would report for these front-end flags, as messages. Like `vllm serve`,
    imports the parser plugins first (in this process, which then builds the app), so that the
    parsers they register can be named."""
    problems = []
    try:
        validate_parsed_serve_args(namespace)
    except (TypeError, ValueError) as exc:
        problems.append(str(exc).removeprefix("Error: "))
    for parser_dest, plugin_dest, registry in _PARSERS:
        problems += _parser_problems(namespace, parser_dest, plugin_dest, registry)
    return problems


# Each parser flag, the flag of its plugin (a module or a Python file that registers parsers when
# imported) and vLLM's registry of its parsers.
_PARSERS = (("tool_call_parser", "tool_parser_plugin", ToolParserManager),
            ("reasoning_parser", "reasoning_parser_plugin", ReasoningParserManager))


def _parser_problems(namespace: argparse.Namespace, parser_dest: str, plugin_dest: str,
                     registry: type[ToolParserManager | ReasoningParserManager]) -> list[str]:
    if (plugin := getattr(namespace, plugin_dest)) and (failure := _import_plugin(plugin)):
        return [f"{plugin_dest.upper()}={plugin!r}: {failure}"]
    if (parser := getattr(namespace, parser_dest)) and parser not in registry.list_registered():
        return [f"{parser_dest.upper()}={parser!r}: expected one of " + ", ".join(registry.list_registered())]
    return []


def _import_plugin(plugin: str) -> str | None:
    """Imports a plugin as vLLM's ``import_plugin`` does, a Python file or a module on the path; says
    what failed (vLLM only logs it, and serves without the plugin's parsers)."""
    is_file = Path(plugin).is_file()
    try:
        if is_file:
            import_from_path(Path(plugin).stem, plugin)
        else:
            importlib.import_module(plugin)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is a configuration error
        where = "importing it failed" if is_file else "no such file, and importing it as a module failed"
        return f"{where}: {type(exc).__name__}: {exc}"
    return None


def visible_gpu_count() -> int:
    """GPUs this process may use (after CUDA_VISIBLE_DEVICES); 0 on a machine without CUDA/ROCm."""
    return current_platform.device_count() if current_platform.is_cuda_alike() else 0


def create_engine_config(engine_args: AsyncEngineArgs) -> VllmConfig:
    """The engine's configuration, as `vllm serve` creates it (its scheduling defaults), its engine
    processes forked on the CPU too (``_start_method``).

    Mutates ``engine_args``, as vLLM does."""
    users = None if _SET_HERE.get(START_METHOD_ENV) == os.environ.get(START_METHOD_ENV) else \
        env_value(START_METHOD_ENV, os.environ)
    vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    _start_method(users)
    return vllm_config


# vLLM starts its engine core's and its workers' processes by this method. Its CPU platform sets
# "spawn" while it builds a configuration, so that each process imports vLLM again: 8 s of a core
# each, two per start. The worker forks them on the CPU, as vLLM does on a GPU: its own process
# never runs the model, so no OpenMP thread pool is copied into them. The user's value is kept.
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def _start_method(users: str | None) -> None:
    """Sets the engine processes' start method after vLLM's CPU platform set "spawn": the user's,
    else (on the CPU) "fork"."""
    if users is not None:
        os.environ[START_METHOD_ENV] = users
    elif current_platform.is_cpu():
        os.environ[START_METHOD_ENV] = _SET_HERE[START_METHOD_ENV] = "fork"
    else:
        return
    _reread_envs()


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


# vLLM's engine processes report a failed start only in their log ("EngineCore failed to start"):
# the worker's main process sees "Engine core initialization failed. See root cause above". Each of
# them notes the first exception it logs in this file, which the worker reads to tell the caller;
# and, in another, the end of their weights' load (``engine_phase``), for the start-up watchdog.
ENGINE_FAILURE_FILE_ENV = "WORKER_ENGINE_FAILURE_FILE"
ENGINE_PHASE_FILE_ENV = "WORKER_ENGINE_PHASE_FILE"
# Where vLLM raises when the KV cache cannot hold one request of max_model_len.
_KV_CACHE_CHECKS = frozenset({"check_enough_kv_cache_memory", "_check_enough_kv_cache_memory"})
# Where vLLM raises a ValueError when less memory is free at start than gpu_memory_utilization asks
# for (the raising function's qualified name): its GPU worker's check (0.32 to 0.34), and 0.32's CPU
# worker's. 0.33 moved the CPU one into CPUWorker.determine_available_memory, whose other
# ValueErrors a lower utilization does not fix (a KV_CACHE_MEMORY_BYTES too large; weights that fill
# the reservation): not classified.
_MEMORY_CHECKS = frozenset({"request_memory", "CPUWorker.__init__"})
# torch's CPU allocator fails with a plain RuntimeError: its text is the only mark.
_CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"
# vLLM 0.34's extensible KV cache commits memory through the GPU driver: every driver error is a
# RuntimeError raised in this module, with the driver's own text ("out of memory" for CUDA's and
# HIP's out-of-memory error).
_GPU_DRIVER_MODULE = "vmm_driver.py"
# vLLM's log lines (their templates) that say an engine process has loaded the weights: its
# default loader's, and the GPU model runner's (other loaders log neither; the phase then stays
# ``load``). The contract check looks for them in vLLM's source.
WEIGHTS_LOADED_LOGS = frozenset({"Loading weights took %.2f seconds",
                                 "Model loading took %s GiB memory and %.6f seconds"})


def failure_note(exc: BaseException) -> dict:
    """What the worker is told of an engine process's exception: ``type``, ``message``,
    ``out_of_memory`` (memory ran short: a lower gpu_memory_utilization may start) and
    ``kv_cache_too_small`` (the KV cache cannot hold one request of max_model_len)."""
    codes = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return {"type": type(exc).__name__, "message": mask_urls(str(exc)),
            "out_of_memory": _out_of_memory(exc, codes[-1] if codes else None),
            "kv_cache_too_small": any(code.co_name in _KV_CACHE_CHECKS for code in codes)}


def _out_of_memory(exc: BaseException, raised_in: types.CodeType | None) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    module, function = (Path(raised_in.co_filename).name, raised_in.co_qualname) if raised_in else ("", "")
    if isinstance(exc, RuntimeError):
        return _CPU_ALLOCATOR_FAILED in str(exc) or (
            module == _GPU_DRIVER_MODULE and "out of memory" in str(exc).lower())
    return isinstance(exc, ValueError) and function in _MEMORY_CHECKS


def _note_failure(exc: BaseException) -> None:
    """Write ``exc``'s ``failure_note`` to ENGINE_FAILURE_FILE_ENV's file (read now: each start attempt
    has its own), unless a process noted a failure there first."""
    path = env_value(ENGINE_FAILURE_FILE_ENV, os.environ)
    if not path:
        return
    note = failure_note(exc)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # noted already: the first failure is the cause
        return
    with os.fdopen(fd, "w") as file:
        json.dump(note, file)


def _note_phase(phase: str) -> None:
    """Write ``phase`` and the time to ENGINE_PHASE_FILE_ENV's file (each start attempt has its own)."""
    if path := env_value(ENGINE_PHASE_FILE_ENV, os.environ):
        with suppress(OSError):
            Path(path).write_text(json.dumps({"phase": phase, "at": time.time()}))


def note_engine_failures(*, in_engine_process: bool) -> None:
    """Note the first exception vLLM logs at ERROR in its engine processes ("EngineCore failed to
    start", with the exception), and the end of the weights' load. Through the log record factory:
    vLLM's own logging config, which each engine process applies again, drops any handler added to
    its loggers. Installed in the worker's process before the engine starts (a forked engine process
    inherits it; the worker's own records are not noted), and in a spawned one at import of the
    worker's main module."""
    skip_pid = None if in_engine_process else os.getpid()
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "notes_engine_failures", False):
        return

    def noting(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if not record.name.startswith("vllm") or os.getpid() == skip_pid:
            return record
        if record.levelno >= logging.ERROR and record.exc_info and record.exc_info[1] is not None:
            _note_failure(record.exc_info[1])
        elif record.msg in WEIGHTS_LOADED_LOGS:
            _note_phase("compile")
        return record

    noting.notes_engine_failures = True
    logging.setLogRecordFactory(noting)


def engine_failure() -> dict | None:
    """What an engine process noted (``failure_note``)."""
    path = env_value(ENGINE_FAILURE_FILE_ENV, os.environ)
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def engine_phase() -> tuple[str, float] | None:
    """The phase the engine's processes noted for this start attempt (``compile``: the weights are
    loaded), and the seconds since; None before they note one."""
    path = env_value(ENGINE_PHASE_FILE_ENV, os.environ)
    try:
        note = json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):  # none yet, or being written
        return None
    return (note["phase"], max(0.0, time.time() - note["at"])) if note else None


# Folders of vLLM's cache root whose children are entries, each named by a hash of what it depends
# on (engine/compile_cache): torch.compile's graphs and kernels (Inductor's and Triton's caches are
# redirected into them; on the CPU, Inductor's cache is an entry itself: _cpu_compile_cache),
# AOT-compiled functions, the memory-profiling plan
# (VLLM_ENABLE_STARTUP_PLAN) and the model registry's inspection results.
CACHE_ENTRY_DIRS = ("torch_compile_cache", "torch_compile_cache/torch_aot_compile", "startup_plan",
                    "modelinfos")


def cache_root() -> str:
    """vLLM's cache root: VLLM_CACHE_ROOT, else its default (under XDG_CACHE_HOME or ~/.cache)."""
    return vllm.envs.VLLM_CACHE_ROOT


def compiles(vllm_config: VllmConfig) -> bool:
    """Whether this engine compiles the model with torch.compile (not ENFORCE_EAGER, not
    TORCH_COMPILE_DISABLE), and so reads or writes compile cache entries."""
    return vllm_config.compilation_config.mode != CompilationMode.NONE and not torch._dynamo.config.disable


_SET_HERE: dict[str, str] = {}  # what _engine_process_env set: a later engine of this process sets its own
# vLLM sends usage statistics (the hardware, the model's architecture, some settings) to its stats
# server from the engine's first GPU worker unless this is "1" (or DO_NOT_TRACK is). A worker does
# not report home unless its operator says so: VLLM_NO_USAGE_STATS=0.
USAGE_STATS_ENV = "VLLM_NO_USAGE_STATS"


def _engine_process_env(vllm_config: VllmConfig) -> None:
    """The environment vLLM's engine processes start with, which they inherit from this one: the
    worker's choices, each unless the user made their own. The one place the worker sets it."""
    _no_usage_stats()
    _cpu_compile_cache(vllm_config)


def _no_usage_stats() -> None:
    """VLLM_NO_USAGE_STATS=1 unless the operator set it to a false value (any boolean spelling; vLLM
    reads only "1", so the value is written as vLLM reads it; anything else keeps the default)."""
    value = env_value(USAGE_STATS_ENV, os.environ)
    try:
        setting = "1" if value is None or parse_bool(value) else "0"
    except ValueError:
        setting = "1"
    if os.environ.get(USAGE_STATS_ENV) != setting:
        os.environ[USAGE_STATS_ENV] = setting
        _reread_envs()
    if _SET_HERE.get(USAGE_STATS_ENV) != setting:  # logged once a process, and when it changes
        _SET_HERE[USAGE_STATS_ENV] = setting
        log.info("vLLM's usage statistics: %s", "not sent (VLLM_NO_USAGE_STATS=1)" if setting == "1" else
                 "sent by vLLM unless DO_NOT_TRACK=1 (VLLM_NO_USAGE_STATS=0)")


def _reread_envs() -> None:
    """vLLM caches its variables in a process that ran an engine core: a changed one is read again."""
    if vllm.envs._is_envs_cache_enabled():
        vllm.envs.disable_envs_cache()
        vllm.envs.enable_envs_cache()


def _users_own(name: str) -> bool:
    """Whether the user set ``name``. Torch fills TORCHINDUCTOR_CACHE_DIR with its default,
    ``<temp dir>/torchinductor_<user>``, when first asked (importing vLLM does), and a parent
    process that imported torch (a supervisor, a test run) passes its own on, under its own temp
    dir: neither is anybody's choice."""
    value = env_value(name, os.environ)
    if value is None or value == _SET_HERE.get(name):
        return False
    return not (name == "TORCHINDUCTOR_CACHE_DIR" and Path(value).name == Path(default_cache_dir()).name)


def _cpu_compile_cache(vllm_config: VllmConfig) -> None:
    """Makes the CPU build's compiled kernels an entry of vLLM's cache root.

    vLLM's CPU build compiles with plain Inductor (``DYNAMO_TRACE_ONCE``), so its AOT entry holds a
    bare function that vLLM (0.32, 0.33) fails to load ("'function' object has no attribute
    'finalize_loading'") and compiles again on every start. Without AOT, Inductor's own cache makes
    a warm start fast, but it lives in ``/tmp/torchinductor_<user>``: it is moved into an entry
    named by the configuration's hash, which engine/compile_cache then mirrors like vLLM's own. The
    engine's process inherits both variables; a user's own value of either is kept."""
    if not (current_platform.is_cpu() and compiles(vllm_config)) or vllm.envs.VLLM_DISABLE_COMPILE_CACHE:
        return
    entry = Path(cache_root(), "torch_compile_cache", f"inductor-{config_hash(vllm_config)[:16]}")
    for name, value in (("VLLM_USE_AOT_COMPILE", "0"), ("TORCHINDUCTOR_CACHE_DIR", str(entry))):
        if not _users_own(name):
            os.environ[name] = _SET_HERE[name] = value
    if os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(entry):
        _keep_precompiled_headers(entry)


def _keep_precompiled_headers(entry: Path) -> None:
    """Makes Inductor's precompiled C++ headers part of ``entry``.

    Torch keeps them in the temp dir's ``torchinductor_<user>/precompiled_headers`` whatever
    TORCHINDUCTOR_CACHE_DIR says (``codecache._HEADER_DIR``), and builds them (150 MB, 8 s here)
    before it looks for a cached kernel: a fresh container would build them at every start. The
    engine's process has the same temp dir, so a link there to the entry's folder keeps them."""
    from torch._inductor.codecache import _HEADER_DIR  # on the CPU compile path only

    headers, kept = Path(_HEADER_DIR), entry / "precompiled_headers"
    if headers.exists() and not headers.is_symlink():
        return  # this disk has its own (a warm /tmp): torch uses them
    kept.mkdir(parents=True, exist_ok=True)
    link = headers.with_name(f".{headers.name}.{os.getpid()}")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(kept, target_is_directory=True)
    os.replace(link, headers)  # atomic: a link to another configuration's entry is replaced


# What the engine reports after each step (``start_engine``'s ``on_load``), as keyword arguments:
# running, waiting, kv_usage (0-1), the requests started, finished and preempted in that step, and
# those that finished (not aborted) as (prompt tokens, output tokens, max_tokens, prompt tokens found
# in the prefix cache).
LoadObserver = Callable[..., None]
_NO_OUTPUT = IterationStats()  # a step that produced no output started and finished nothing
_ENDED_EARLY = frozenset({FinishReason.ABORT, FinishReason.ERROR})  # their length says nothing


def _load_tap(on_load: LoadObserver) -> type[AggregateStatLoggerBase]:
    """A stat logger handing ``on_load`` vLLM's scheduler state after each engine step (in the
    engine's output handler: a few attribute reads). With data parallelism each engine reports on
    its own: the counts are summed over the engines' latest reports and the KV usage averaged."""

    class LoadTap(AggregateStatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
            self.latest = {index: (0, 0, 0.0) for index in engine_indexes}

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
            if scheduler_stats is None:
                return
            self.latest[engine_idx] = (scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                                       scheduler_stats.kv_cache_usage)
            running, waiting, kv_usage = (sum(column) for column in zip(*self.latest.values(), strict=True))
            step = iteration_stats or _NO_OUTPUT
            finished = step.finished_requests
            on_load(running=running, waiting=waiting, kv_usage=kv_usage / len(self.latest),
                    # first tokens: a preempted request that resumes is not counted again
                    started=len(step.time_to_first_tokens_iter), finished=len(finished),
                    preempted=step.num_preempted_reqs,
                    outputs=tuple((f.num_prompt_tokens, f.num_generation_tokens, f.max_tokens_param,
                                   f.num_cached_tokens) for f in finished if f.finish_reason not in _ENDED_EARLY))

        def log_engine_initialized(self) -> None:
            pass

    return LoadTap


# ``admitted(prompt_tokens, max_tokens, n)``: called as a request reaches vLLM, raising RequestError
# for one the worker refuses; its place (None: straight to vLLM), entered before vLLM sees the request
# and left when it has ended (``engine/admission.Admission.admitted``).
Admitted = Callable[[int, int | None, int], AbstractAsyncContextManager[None] | None]


class RefusedRequest(VLLMValidationError):
    """A request the worker refuses before vLLM sees it: vLLM's app answers its 400 (with the
    parameter), as for its own validation; the raw path reads the same status."""

    def __str__(self) -> str:
        return str(self.args[0])


def start_engine(vllm_config: VllmConfig, engine_args: AsyncEngineArgs,
                 on_load: LoadObserver | None = None) -> AsyncLLM:
    """AsyncLLM as `vllm serve` builds it, from the configuration made by ``create_engine_config``
    (on the CPU, with its compiled kernels kept as a cache entry; without Prometheus metrics);
    ``on_load`` gets the scheduler's state after each step (see ``_load_tap``): vLLM then collects
    statistics even with ``disable_log_stats`` (without logging them)."""
    _engine_process_env(vllm_config)
    llm = AsyncLLM.from_vllm_config(
        vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
        stat_loggers=[_load_tap(on_load)] if on_load else None)
    _drop_prometheus(llm)
    return llm


def gate_requests(llm: AsyncLLM, admitted: Admitted) -> None:
    """Every ``llm.generate`` (the raw path's, and vLLM's serving classes', which call the engine
    client they were given: this llm) asks ``admitted`` with the request's size when it is called,
    before vLLM's serving starts a response (a refusal is then its 400, streamed or not), enters its
    place before vLLM sees the request, and leaves it when the request has ended, however it ends."""
    generate = llm.generate

    def generate_once_admitted(prompt, sampling_params: SamplingParams, request_id: str,
                               *args, **kwargs) -> AsyncIterator[RequestOutput]:
        try:
            place = admitted(prompt_tokens(prompt), sampling_params.max_tokens, sampling_params.n)
        except RequestError as refused:
            raise RefusedRequest(str(refused), parameter=refused.param) from None
        if place is None:  # not gated: no layer between the caller and vLLM
            return generate(prompt, sampling_params, request_id, *args, **kwargs)
        return _through(place, lambda: generate(prompt, sampling_params, request_id, *args, **kwargs))

    llm.generate = generate_once_admitted


async def _through(place: AbstractAsyncContextManager[None],
                   start: Callable[[], AsyncIterator[RequestOutput]]) -> AsyncIterator[RequestOutput]:
    """vLLM's outputs, from inside ``place``: vLLM sees the request once it is entered."""
    async with place, aclosing(start()) as outputs:  # closed with this one: vLLM aborts it now
        async for output in outputs:
            yield output


def prompt_tokens(prompt) -> int:
    """A prompt's tokens as ``AsyncLLM.generate`` gets it: a request vLLM's renderer built, a dict of
    token ids or embeddings, an encoder-decoder pair (the decoder's: the encoder's output is not in
    the KV cache's blocks); 0 for a text prompt or a streamed input (not tokenized yet)."""
    if isinstance(prompt, EngineCoreRequest):
        prompt = {"prompt_token_ids": prompt.prompt_token_ids, "prompt_embeds": prompt.prompt_embeds}
    if not isinstance(prompt, dict):
        return 0
    if "decoder_prompt" in prompt:
        return prompt_tokens(prompt["decoder_prompt"] or {})
    if prompt.get("prompt_token_ids") is not None:
        return len(prompt["prompt_token_ids"])
    embeds = prompt.get("prompt_embeds")
    return len(embeds) if embeds is not None else 0


def kv_cache_size(llm: AsyncLLM) -> tuple[int, int, int, bool] | None:
    """The KV cache's usable blocks (over data-parallel engines; less each one's null block, which
    vLLM keeps out of use), the tokens a block holds, the model's context length, and whether vLLM
    caches prefixes (a request's sequences then share its prompt's whole blocks). None when a
    request does not hold a block per ``block_size`` tokens of its own in every layer: sliding-window
    attention, state-space layers (hybrid models), no attention, an encoder-decoder's cross-attention."""
    config = llm.vllm_config
    model = config.model_config
    if (model.is_attention_free or model.is_hybrid or model.is_encoder_decoder
            or model.get_sliding_window() is not None):
        return None
    engines = config.parallel_config.data_parallel_size
    return ((config.cache_config.num_gpu_blocks or 0) - engines, config.cache_config.block_size,
            config.model_config.max_model_len, bool(config.cache_config.enable_prefix_caching))


def _drop_prometheus(llm: AsyncLLM) -> None:
    """Stops vLLM's Prometheus metrics, which it records whenever it collects statistics (samples of
    every token's latency, about 18 µs of the front end's CPU per token here) for a ``/metrics``
    route the worker does not serve."""
    if llm.logger_manager is not None:
        loggers = llm.logger_manager.stat_loggers
        loggers[:] = [logger for logger in loggers if not isinstance(logger, PrometheusStatLogger)]


def max_num_seqs(llm: AsyncLLM) -> int:
    """How many requests the engine runs at once at most (resolved by vLLM): one step's batch, on
    each data-parallel engine."""
    config = llm.vllm_config
    return config.scheduler_config.max_num_seqs * config.parallel_config.data_parallel_size


# vLLM's app and serving classes: needed once the engine is up, so imported only then (the worker
# imports them while the engine starts: import_app_modules).
APP_MODULES = ("vllm.entrypoints.launchers.app", "vllm.entrypoints.launchers.api_server.app_state")


def import_app_modules() -> list:
    """The APP_MODULES, imported (once: later calls find them in ``sys.modules``)."""
    return [importlib.import_module(name) for name in APP_MODULES]


async def build_openai_app(engine: AsyncLLM, namespace: argparse.Namespace, adapters=None,
                           model_root: str | None = None):
    """vLLM's own OpenAI/Anthropic ASGI app with its serving state, as `vllm serve` builds it;
    ``adapters`` (``engine/adapters.Adapters``): the registry its serving classes find adapters in;
    ``model_root``: the served model's root in ``/v1/models`` (``show_model_roots``).

    Like `vllm serve`'s app start-up, this freezes the start-up heap out of the garbage collector:
    otherwise each full collection while serving walks vLLM's and torch's ~600k start-up objects
    (a 0.35 s pause on the CPU machines).
    """
    app_module, state_module = import_app_modules()
    supported_tasks = await engine.get_supported_tasks()
    root = logging.getLogger()
    level = root.level
    try:
        app = app_module.build_app(namespace, supported_tasks, engine.model_config)
    finally:
        # Building it imports model_hosting_container_standards (vLLM's SageMaker routes), which sets
        # the root logger to $LOG_LEVEL or else ERROR: that would silence the worker's own logs.
        root.setLevel(level)
    # RunPod authenticates callers; a VLLM_API_KEY in the environment would make vLLM demand a
    # bearer token that jobs never carry. (vLLM has already built the stack: build it again.)
    app.user_middleware = [m for m in app.user_middleware if m.cls is not AuthenticationMiddleware]
    app.middleware_stack = app.build_middleware_stack()
    await state_module.init_app_state(engine, app.state, namespace, supported_tasks)
    if models := getattr(app.state, "openai_serving_models", None):
        if adapters is not None:
            serve_adapters(models, adapters.resolve, adapters.loaded, adapters.available)
            _allow_adapters_by_name()
        show_model_roots(models, model_root)
    freeze_gc_heap()
    return app


def make_sampling_params(fields: dict, output_kind: RequestOutputKind) -> SamplingParams:
    """Typed, validated SamplingParams from JSON (msgspec checks types, vLLM the ranges)."""
    return msgspec.convert({**fields, "output_kind": output_kind.value}, SamplingParams)


# --- LoRA adapters by name (engine/adapters holds the registry) -------------------------------------

# What a registry of adapters offers vLLM's serving classes (engine/adapters.Adapters).
ResolveAdapter = Callable[[str], Awaitable[LoRARequest]]  # raises RequestError with its status


def _allow_adapters_by_name() -> None:
    """Lets vLLM's serving classes ask for an adapter they do not know (``resolve_lora``), as
    `vllm serve` does with VLLM_ALLOW_RUNTIME_LORA_UPDATING, which they read at each request. Set
    once the app is built: read then, it would add vLLM's load and unload routes (which no job may
    call) and a warning that they are on. vLLM caches its variables in a process that ran an
    engine core: the cache is made again."""
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    _reread_envs()


def max_cpu_loras(llm: AsyncLLM) -> int:
    """How many adapters the engine holds in memory (MAX_CPU_LORAS, else MAX_LORAS); 0 without LoRA."""
    lora = llm.vllm_config.lora_config
    return (lora.max_cpu_loras or lora.max_loras) if lora else 0


async def load_adapter(llm: AsyncLLM, request: LoRARequest) -> str | None:
    """Loads an adapter into the engine (again, when it was evicted); None when it is held, else
    why vLLM could not load it (its failure stays in this call: the engine serves on)."""
    try:
        await llm.add_lora(request)
    except EngineDeadError:
        raise
    except Exception as exc:  # noqa: BLE001 - vLLM wraps the worker's error in a plain Exception
        message = str(exc)
        return match.group(1) if (match := re.search(r"Worker failed with error '(.*)', please", message)) \
            else message
    return None


async def plugin_adapter(llm: AsyncLLM, name: str) -> LoRARequest | None:
    """The adapter a LoRA resolver registered with vLLM finds (vLLM's filesystem or hub resolver,
    when their VLLM_LORA_RESOLVER_* variables are set, or a user's plugin); None if none does."""
    for resolver_name in sorted(LoRAResolverRegistry.get_supported_resolvers()):
        resolver = LoRAResolverRegistry.get_resolver(resolver_name)
        if (request := await resolver.resolve_lora(llm.model_config.model, name)) is not None:
            return request
    return None


def serve_adapters(models, resolve: ResolveAdapter, loaded: dict[str, LoRARequest],
                   available: Callable[[], Awaitable[list[str]]]) -> None:
    """Makes vLLM's ``OpenAIServingModels`` (one app's) find adapters through the worker's registry:
    its adapters (``LORA_MODULES``', loaded already) join ``loaded``, which it then shares;
    ``resolve_lora`` asks ``resolve``; ``/v1/models`` also lists ``available()``'s names, once each
    (``loaded`` holds other spellings too)."""
    loaded.update(models.lora_requests)
    models.lora_requests = loaded

    async def resolve_lora(name: str) -> LoRARequest | ErrorResponse:
        try:
            return await resolve(name)
        except RequestError as exc:
            status = HTTPStatus(exc.status)
            if status not in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND):
                raise GracefulHTTPError(str(exc), status) from None  # vLLM reads 400 and 404 only
            return _vllm_error_response(str(exc), status_code=status, param="model",
                                        err_type="NotFoundError" if status == HTTPStatus.NOT_FOUND
                                        else "BadRequestError")

    show_loaded = models.show_available_models

    async def show_available_models():
        listed = await show_loaded()
        cards = {card.id: card for card in listed.data}
        base = models.base_model_paths[0].name
        cards.update((name, ModelCard(id=name, root=name, parent=base, permission=[ModelPermission()]))
                     for name in await available() if name not in cards)
        listed.data = list(cards.values())
        return listed

    models.resolve_lora = resolve_lora
    models.show_available_models = show_available_models


def show_model_roots(models, root: str | None) -> None:
    """``/v1/models`` (vLLM's ``OpenAIServingModels``) shows no folder of the server's: vLLM's card
    ``root`` is the path it loaded the model or an adapter from. The served model's root becomes
    ``root`` (the repo id the user named, whose copy is served), other absolute ones the card's id."""
    show = models.show_available_models
    served_from = {path.model_path for path in models.base_model_paths}

    async def show_available_models():
        listed = await show()
        for card in listed.data:
            if root and card.root in served_from:
                card.root = root
            elif card.root and os.path.isabs(card.root):
                card.root = card.id
        return listed

    models.show_available_models = show_available_models


def keep_adapters_loaded(llm: AsyncLLM, reload: Callable[[LoRARequest], Awaitable[None]]) -> None:
    """Every ``llm.generate`` with an adapter awaits ``reload(adapter)`` first. vLLM loads an
    adapter it evicted again inside an engine step, where a failure (its files changed or gone)
    would kill the engine; loaded here, it fails this request alone."""
    generate = llm.generate

    async def generate_with_adapter(prompt, sampling_params: SamplingParams, request_id: str, *args,
                                    lora_request: LoRARequest | None = None, **kwargs):
        if lora_request is not None:
            await reload(lora_request)
        async with aclosing(generate(prompt, sampling_params, request_id, *args,
                                     lora_request=lora_request, **kwargs)) as outputs:
            async for output in outputs:
                yield output

    llm.generate = generate_with_adapter


# --- Media URLs (wire/media_urls holds the policy) ----------------------------------------------------

class _RefusedHop(RefusedRequest):
    """A request for media the policy refuses, raised before it is sent: ``hop``, its URL (the
    caller's, or a redirect's), and why. vLLM passes it on as it is (a VLLMValidationError)."""

    def __init__(self, hop: str, reason: str) -> None:
        super().__init__(reason)
        self.hop = hop


class _RefusedAddress(RefusedRequest):
    """Addresses a host resolved to that the policy refuses, raised in place of connecting to them,
    where the request's URL is unknown; the request's check turns it into a ``_RefusedHop``. Not an
    OSError, so that neither aiohttp nor urllib3 takes it for a failed lookup or connection."""


class _CheckedConnection(HTTPConnection):
    """vLLM's HTTP connection, asking ``policy`` before each request it sends, every redirect's
    included: aiohttp's (the async path) through a client middleware, requests' (the sync path)
    through its transport adapter, where each follows redirects. A name is checked by resolving it
    where the connection is made, and only the addresses checked are connected to: resolved once
    for the check and again to connect, a DNS server answering the two differently (DNS rebinding)
    would reach an address never checked.

    Through a proxy (HTTP(S)_PROXY, honoured on both paths) the connection is made to the proxy, and
    the proxy resolves the media host: its name is then checked on its own resolution, as before,
    and rebinding between the two is not caught. aiohttp resolves a proxy's name through the checked
    resolver too, so a proxy named on a private network is refused unless its network is allowed."""

    def __init__(self, policy: MediaURLPolicy) -> None:
        super().__init__()
        self.policy = policy

    def check(self, url: str, proxied: bool) -> None:
        """Refuses ``url`` by its host's name or address; by the addresses its name resolves to too
        when ``proxied``, as the connection (the proxy's) cannot."""
        reason = self.policy.refusal(url, proxied=True) if proxied else self.policy.hop_refusal(url)
        if reason is not None:
            raise _RefusedHop(url, reason)

    def addresses(self, host: str, found: list[str]) -> list[str]:
        """``found``, the addresses ``host`` resolved to, when the policy allows them all."""
        if (reason := self.policy.addresses_refusal(host, found)) is not None:
            raise _RefusedAddress(reason)
        return found

    async def get_async_client(self) -> aiohttp.ClientSession:
        if self._async_client is None:
            connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.addresses))
            self._async_client = aiohttp.ClientSession(connector=connector, trust_env=True,
                                                       middlewares=(self._checked,))
        return self._async_client

    async def _checked(self, request: aiohttp.ClientRequest, send) -> aiohttp.ClientResponse:
        # aiohttp hands an address in the URL to no resolver: that, and the name's place in
        # ALLOWED_MEDIA_DOMAINS, are checked here, for each hop
        url = str(request.url)
        await asyncio.to_thread(self.check, url, request.proxy is not None)  # resolving a name blocks
        try:
            return await send(request)
        except _RefusedAddress as refused:
            raise _RefusedHop(url, str(refused)) from None

    def get_sync_client(self) -> requests.Session:
        if self._sync_client is None:
            self._sync_client = requests.Session()
            for scheme in ("http://", "https://"):
                self._sync_client.mount(scheme, _CheckedAdapter(self))
        return self._sync_client


class _CheckedResolver(aiohttp.ThreadedResolver):
    """aiohttp's resolver over the system's (as ``resolve``, which the sync path uses), answering
    only addresses ``allowed`` lets through, which are then the ones aiohttp connects to."""

    def __init__(self, allowed: Callable[[str, list[str]], list[str]]) -> None:
        super().__init__()
        self.allowed = allowed

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        found = await super().resolve(host, port, family)
        self.allowed(host, [result["host"] for result in found])
        return found


class _CheckedAdapter(requests.adapters.HTTPAdapter):
    """requests' transport, checking each request's URL before sending it, over connections that
    connect to the addresses of their host that the policy allows alone (``_checked_pool``)."""

    def __init__(self, connection: _CheckedConnection) -> None:
        self.connection = connection  # before HTTPAdapter's __init__, which makes the pool manager
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        pools = self.poolmanager.pool_classes_by_scheme
        self.poolmanager.pool_classes_by_scheme = {
            scheme: _checked_pool(pool, self.connection.addresses) for scheme, pool in pools.items()}

    def send(self, request: requests.PreparedRequest, *args, **kwargs) -> requests.Response:
        proxied = requests.utils.select_proxy(request.url, kwargs.get("proxies")) is not None
        self.connection.check(request.url, proxied)
        try:
            return super().send(request, *args, **kwargs)
        except _RefusedAddress as refused:
            raise _RefusedHop(request.url, str(refused)) from None


def _checked_pool(pool: type[urllib3.HTTPConnectionPool],
                  allowed: Callable[[str, list[str]], list[str]]) -> type[urllib3.HTTPConnectionPool]:
    """urllib3's ``pool``, whose connections resolve their host once, ask ``allowed`` about its
    addresses, and connect to those, in turn, by address: TLS (SNI, the certificate's name) still
    goes by the host's name, which urllib3 keeps apart from the address it connects to."""

    class CheckedConnection(pool.ConnectionCls):
        def _new_conn(self) -> socket.socket:
            name = self._dns_host
            try:
                found = resolve(name, self.port)
            except socket.gaierror as error:
                raise urllib3.exceptions.NameResolutionError(self.host, self, error) from error
            try:
                for address in allowed(name, found):
                    self._dns_host = address
                    try:
                        return super()._new_conn()
                    except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError) as error:
                        failed = error  # the next address, as urllib3 tries each of a name's
                raise failed
            finally:
                self._dns_host = name

    return type(pool.__name__, (pool,), {"ConnectionCls": CheckedConnection})


class _CheckedMediaConnector(MediaConnector):
    """vLLM's media connector (VLLM_MEDIA_CONNECTOR's default, "http"), fetching through the
    checked connection; a refusal is a 400 that names the caller's URL and the redirect refused."""

    checked = _CheckedConnection(MediaURLPolicy())  # guard_media_urls sets the process's

    def __init__(self, media_io_kwargs: dict | None = None, **kwargs) -> None:
        super().__init__(media_io_kwargs, self.checked, **kwargs)

    def _assert_url_in_allowed_media_domains(self, url_spec) -> None:
        """vLLM's check of ALLOWED_MEDIA_DOMAINS on the caller's URL (also one served from its
        media cache), in the policy's words."""
        if (reason := self.checked.policy.host_refusal(url_spec.hostname)) is not None:
            raise _RefusedHop(url_spec.url, reason)

    def load_from_url(self, url: str, *args, **kwargs):
        with _refusal_of(url):
            return super().load_from_url(url, *args, **kwargs)

    async def load_from_url_async(self, url: str, *args, **kwargs):
        with _refusal_of(url):
            return await super().load_from_url_async(url, *args, **kwargs)


@contextmanager
def _refusal_of(url: str):
    """A refused request, as the refusal of the caller's ``url``: one to another host or port than
    the URL's is a redirect's."""
    try:
        yield
    except _RefusedHop as refused:
        log.warning("Media URL refused: %s", refused)  # the host, not the caller's URL
        hop = "" if origin(refused.hop) == origin(url) else f" redirects to {mask_urls(refused.hop)}"
        raise RefusedRequest(f"media URL {mask_urls(url)}{hop}: {refused}") from None


def guard_media_urls(policy: MediaURLPolicy) -> None:
    """Holds every media URL vLLM fetches in this process from now on to ``policy``, each redirect
    too: vLLM's connector is replaced by ``_CheckedMediaConnector`` (vLLM checks ALLOWED_MEDIA_DOMAINS
    on the caller's URL alone, and asks nothing of the addresses), and a plugin's connector
    (VLLM_MEDIA_CONNECTOR) is held as far as it can be (``_hold_plugin_connector``)."""
    _CheckedMediaConnector.checked = _CheckedConnection(policy)
    MEDIA_CONNECTOR_REGISTRY.register("http")(_CheckedMediaConnector)
    if not getattr(MEDIA_CONNECTOR_REGISTRY.load, "holds_plugins", False):
        load = MEDIA_CONNECTOR_REGISTRY.load

        def load_held(name: str, *args, **kwargs):
            connector = load(name, *args, **kwargs)
            if not isinstance(connector, _CheckedMediaConnector):
                _hold_plugin_connector(connector)
            return connector

        load_held.holds_plugins = True
        MEDIA_CONNECTOR_REGISTRY.load = load_held


def _hold_plugin_connector(connector) -> None:
    """A plugin's media connector (VLLM_MEDIA_CONNECTOR names it; vLLM loads one per request): what
    it fetches through vLLM's HTTP connection goes through the checked one, redirects included, and
    the URL it is given is checked first, its host's addresses resolved here (what it fetches by a
    transport of its own is its own)."""
    if isinstance(getattr(connector, "connection", None), HTTPConnection):
        connector.connection = _CheckedMediaConnector.checked
    policy = _CheckedMediaConnector.checked.policy

    def checked(url: str) -> None:
        if (reason := policy.refusal(url)) is not None:
            raise _RefusedHop(url, reason)

    fetch, fetch_async = connector.load_from_url, connector.load_from_url_async

    def load_from_url(url: str, *args, **kwargs):
        with _refusal_of(url):
            checked(url)
            return fetch(url, *args, **kwargs)

    async def load_from_url_async(url: str, *args, **kwargs):
        with _refusal_of(url):
            await asyncio.to_thread(checked, url)  # resolving a name blocks
            return await fetch_async(url, *args, **kwargs)

    connector.load_from_url, connector.load_from_url_async = load_from_url, load_from_url_async
