"""The environment vLLM's engine processes start with, which they inherit from the worker's: usage
statistics off unless the operator turns them on; on the CPU, the engine core forked (vLLM spawns
it) and its model workers spawned, and Inductor's compiled kernels (and its precompiled headers)
kept in an entry of vLLM's cache root; a variable changed later read again (``reread_envs``); and
what the worker reads of that cache (its root, its entries' folders, whether an engine compiles)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch._dynamo.config
import vllm.envs
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from vllm.config import CompilationMode, VllmConfig
from vllm.platforms import current_platform

from worker.env_text import env_value, parse_bool

try:  # vLLM 0.34 hashes a configuration's compile factors; VllmConfig.compute_hash is gone
    from vllm.config.utils import hash_config as config_hash
except ImportError:  # vLLM 0.32, 0.33
    def config_hash(vllm_config: VllmConfig) -> str:
        return vllm_config.compute_hash()

__all__ = ["CACHE_ENTRY_DIRS", "cache_root", "compiles", "config_hash", "engine_process_env", "reread_envs"]

log = logging.getLogger(__name__)

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


_SET_HERE: dict[str, str] = {}  # what engine_process_env set: a later engine of this process sets its own
# vLLM sends usage statistics (the hardware, the model's architecture, some settings) to its stats
# server from the engine's first GPU worker unless this is "1" (or DO_NOT_TRACK is). A worker does
# not report home unless its operator says so: VLLM_NO_USAGE_STATS=0.
USAGE_STATS_ENV = "VLLM_NO_USAGE_STATS"


def engine_process_env(vllm_config: VllmConfig) -> None:
    """The environment vLLM's engine processes start with, which they inherit from this one: the
    worker's choices, each unless the user made their own. The one place the worker sets it."""
    _no_usage_stats()
    _start_method()
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
        reread_envs()
    if _SET_HERE.get(USAGE_STATS_ENV) != setting:  # logged once a process, and when it changes
        _SET_HERE[USAGE_STATS_ENV] = setting
        log.info("vLLM's usage statistics: %s", "not sent (VLLM_NO_USAGE_STATS=1)" if setting == "1" else
                 "sent by vLLM unless DO_NOT_TRACK=1 (VLLM_NO_USAGE_STATS=0)")


# vLLM starts its engine core's and its workers' processes by this method. Its CPU platform writes
# "spawn" whenever it builds a configuration (a default one too), so that each process imports vLLM
# again: 8 s of a core each, two per start. On the CPU the worker forks the engine core, as vLLM does
# on a GPU (its own process never runs the model, and no import is half done in it:
# startup/serving_imports), and the engine core spawns its model workers: vLLM binds their OpenMP
# threads to cores through variables (GOMP_CPU_AFFINITY, OMP_PLACES) that OpenMP reads only as a
# process loads it, so a forked model worker's threads float, and it decoded a quarter slower (bench
# item 20). The user's value, read before any configuration is built (importing this module builds
# none), is kept for both.
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_USERS_START_METHOD = env_value(START_METHOD_ENV, os.environ)


def _start_method() -> None:
    """The engine processes' start method, set just before they start: the user's, else on the CPU
    "fork" for the engine core and "spawn" for the model workers it starts."""
    if _USERS_START_METHOD or not current_platform.is_cpu():
        chosen = _USERS_START_METHOD
    else:
        chosen = "fork"
        _spawn_in_forked_children()
    if chosen and os.environ.get(START_METHOD_ENV) != chosen:
        os.environ[START_METHOD_ENV] = chosen
        reread_envs()


@functools.cache
def _spawn_in_forked_children() -> None:
    """A process forked from this one (the engine core) spawns the processes vLLM starts in it."""
    os.register_at_fork(after_in_child=_spawn_here)


def _spawn_here() -> None:
    if not _USERS_START_METHOD:
        os.environ[START_METHOD_ENV] = "spawn"
        reread_envs()


def reread_envs() -> None:
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
