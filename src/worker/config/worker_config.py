"""The configuration assembled: ``load_config(env)`` reads and validates everything once, at start-up,
before the model loads, into a ``WorkerConfig``:

- ``WorkerSettings``: the worker's own knobs (``config/settings``);
- ``ResolvedArgs``: vLLM's engine and OpenAI front-end flags (``config/engine_args``, which reads
  worker-vllm's old names through ``config/legacy_env`` and the baked-args file through
  ``model/baked_args``);
- what follows from both: the compile cache's folder on the network volume, the names the served
  model answers to, where LoRA adapters named by requests are found, and which media URLs vLLM may
  fetch.

Every problem is collected into one ``ConfigError``. Unknown variables close to a real name get a
"did you mean" warning (``_warn_near_misses``). Plain until ``load_config`` runs, which imports vLLM
(its parser, through ``config/engine_args``): ``WorkerConfig`` and the volume's folder are named by
modules and tests that do not load vLLM.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.config.settings import WorkerSettings, env_names, load_settings
from worker.env_text import env_value
from worker.model.baked_args import BAKED_LORA_DIR_KEY
from worker.model.hub_adapters import HubAdapters, hub_rules
from worker.model.lora_adapters import AdapterSources
from worker.wire.errors import ConfigError
from worker.wire.media_urls import MediaURLPolicy

if TYPE_CHECKING:
    from worker.config.engine_args import ResolvedArgs
    from worker.model.preflight import Fetched

log = logging.getLogger(__name__)

__all__ = ["VOLUME_CACHE_DIR", "WorkerConfig", "load_config", "volume_cache_dir"]


@dataclass(frozen=True)
class WorkerConfig:
    settings: WorkerSettings
    args: ResolvedArgs
    # vLLM's compile cache on the network volume (compile_cache.VolumeCache); None: not kept there.
    volume_cache: Path | None = None
    # The names the served model answers to: its path or repo id, the repo its copy came from, the
    # served names (OPENAI_SERVED_MODEL_NAME_OVERRIDE's too).
    served_names: frozenset[str] = frozenset()
    # Where LoRA adapters named by requests are found; None with LoRA off.
    adapters: AdapterSources | None = None
    # Which media URLs vLLM may fetch (vllm_adapter/media.guard_media_urls holds it to them).
    media_urls: MediaURLPolicy = MediaURLPolicy()


# Where RunPod mounts the network volume (the image's BASE_PATH build arg, also set in its env).
DEFAULT_BASE_PATH = "/runpod-volume"
VOLUME_CACHE_DIR = "vllm-cache"  # under BASE_PATH


def volume_cache_dir(settings: WorkerSettings, env: Mapping[str, str]) -> Path | None:
    """The compile cache's folder on the network volume, when one is mounted at BASE_PATH and
    neither VLLM_CACHE_ROOT (the user's own cache root) nor COMPILE_CACHE_ON_VOLUME=false says no."""
    volume = Path(env_value("BASE_PATH", env) or DEFAULT_BASE_PATH)
    if not settings.compile_cache_on_volume:
        reason = "COMPILE_CACHE_ON_VOLUME=false"
    elif env_value("VLLM_CACHE_ROOT", env) is not None:
        reason = "VLLM_CACHE_ROOT is set"
    elif not (volume.is_dir() and os.access(volume, os.W_OK)):
        reason = f"no writable network volume at {volume} (BASE_PATH)"
    else:
        log.info("Compile cache: kept on the network volume, in %s", volume / VOLUME_CACHE_DIR)
        return volume / VOLUME_CACHE_DIR
    log.info("Compile cache: local only (%s)", reason)
    return None


LORA_DIR = "loras"  # under BASE_PATH


def _served_names(settings: WorkerSettings, args: ResolvedArgs) -> frozenset[str]:
    namespace = args.namespace
    names = {namespace.model, args.served_repo, settings.openai_served_model_name_override,
             *(namespace.served_model_name or ())}
    return frozenset(name for name in names if name)


def _adapter_sources(settings: WorkerSettings, args: ResolvedArgs, served_names: frozenset[str],
                     env: Mapping[str, str]) -> AdapterSources | None:
    """Where adapters named by requests are found (LORA_DIRS, then the image's), when LoRA is on."""
    if not args.engine_args.enable_lora:
        return None
    volume = Path(env_value("BASE_PATH", env) or DEFAULT_BASE_PATH) / LORA_DIR
    folders = [(Path(folder), "LORA_DIRS") for folder in (settings.lora_dirs or "").split(":") if folder] \
        or [(volume, "volume")]
    if baked := args.baked.get(BAKED_LORA_DIR_KEY):
        folders.append((Path(baked), "image"))
    rules = hub_rules(settings.lora_hub_repos)
    hub = HubAdapters(rules, settings.lora_hub_max_adapters, settings.lora_hub_max_bytes) if rules else None
    sources = AdapterSources(tuple(folders), hub, args.engine_args.max_lora_rank, served_names,
                             settings.lora_check_base_model)
    log.info("LoRA adapters by name: from %s%s", ", ".join(str(folder) for folder, _ in folders),
             f", and the hub's {settings.lora_hub_repos.strip()}" if rules else "")
    return sources


def _media_urls(settings: WorkerSettings, args: ResolvedArgs) -> MediaURLPolicy:
    """ALLOWED_PRIVATE_MEDIA_NETWORKS and vLLM's ALLOWED_MEDIA_DOMAINS, as the policy; logged."""
    policy = MediaURLPolicy(settings.allowed_private_media_networks or (),
                            tuple(args.engine_args.allowed_media_domains or ()))
    allowed = ", ".join(map(str, policy.private_networks))
    log.info("Media URLs: from %s; non-public addresses refused%s (ALLOWED_PRIVATE_MEDIA_NETWORKS)",
             ", ".join(policy.domains) or "any host", f" but in {allowed}" if allowed else "")
    return policy


# Prefixes of variables that belong to other programs (no typo check against ours).
_FOREIGN_PREFIXES = ("RUNPOD_", "VLLM_", "HF_", "HUGGINGFACE_", "NVIDIA_", "CUDA_", "PYTHON",
                     "TORCH", "OMP_", "LC_", "UV_", "PIP_", "NCCL_", "TRANSFORMERS_")


def _warn_near_misses(env: Mapping[str, str], known: frozenset[str], vllms: frozenset[str]) -> None:
    """A name close to a setting's is a typo. ``vllms``: vLLM's own variables; a ``VLLM_`` name that
    is neither theirs nor ours is checked against both (the worker's VLLM_EXTRA_ARGS among them)."""
    for name in env:
        if name in known or name in vllms or "_" not in name:
            continue
        if name.startswith("VLLM_"):
            candidates = known | vllms
        elif name.startswith(_FOREIGN_PREFIXES):
            continue
        else:
            candidates = known
        if match := difflib.get_close_matches(name, candidates, n=1, cutoff=0.85):
            log.warning("Unknown setting %s is ignored; did you mean %s?", name, match[0])


def load_config(env: Mapping[str, str] | None = None,
                downloaded: tuple[Fetched, Fetched | None] | None = None, *,
                also_read: frozenset[str] = frozenset()) -> WorkerConfig:
    """Read and validate all configuration; raises ConfigError listing every problem.
    ``downloaded``: the model (and tokenizer) ``preflight`` fetched, served from their snapshots;
    ``also_read``: variables read elsewhere (the fitness checks'), known to the near-miss warnings."""
    from worker.config.engine_args import known_env_names, resolve_args  # imports vLLM
    from worker.vllm_adapter.engine_config import vllm_env_names

    env = os.environ if env is None else env
    _warn_near_misses(env, known_env_names() | env_names(WorkerSettings) | also_read, vllm_env_names())
    problems: list[str] = []
    settings = args = None
    try:
        settings = load_settings(env)
    except ConfigError as exc:
        problems.append(str(exc))
    try:
        args = resolve_args(env, downloaded=downloaded)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    if env_value("VLLM_API_KEY", env) is not None:
        log.warning("VLLM_API_KEY is ignored: RunPod authenticates callers, and jobs reach vLLM's "
                    "routes in-process, without a bearer token")
    log.info("Engine config: %s", args.summary())
    log.info("Worker settings: %s", settings.model_dump())
    served_names = _served_names(settings, args)
    return WorkerConfig(settings, args, volume_cache_dir(settings, env), served_names,
                        _adapter_sources(settings, args, served_names, env), _media_urls(settings, args))


