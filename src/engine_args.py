"""Engine configuration: vLLM's own CLI parser, fed from layered sources.

Precedence, highest first (each layer is one function returning ``{dest: Setting}``):

1. env aliases       ``MODEL_NAME``→model, ``MODEL_REVISION``→revision, ``TOKENIZER_NAME``→tokenizer,
                     ``CUSTOM_CHAT_TEMPLATE``→chat_template, ``OPENAI_RESPONSE_ROLE``→response_role,
                     ``LORA_MODULES``→lora_modules
2. env vars          every engine and front-end flag of ``vllm serve`` as its UPPER_SNAKE name
                     (``MAX_MODEL_LEN``→``--max-model-len``) but the HTTP server's
                     (``arg_parser.SERVER_ONLY``), plus worker-vllm's legacy names (``legacy_env``)
3. config file       YAML at ``VLLM_CONFIG_FILE`` (``/vllm_config.yaml``), keys as in ``vllm serve --config``
                     (the HTTP server's flags ignored with a warning)
4. baked args        ``/local_model_args.json``, written when a model is baked into the image
5. worker defaults   ``WORKER_DEFAULTS``
6. vLLM defaults

Every value is parsed by vLLM's own parser (``arg_parser``), one setting at a time, so a bad value
is reported with the variable that set it, before the model loads. An empty env value means "not
set". The baked layer, and the choice of the image's copy when its repo is named, is
``baked_args``'s.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import baked_args
from arg_parser import ENV_ALIASES, SERVER_ONLY, ZERO_MEANS_UNSET, EnvParser, Setting, env_parser
from env_text import env_value
from errors import ConfigError
from legacy_env import LEGACY_ENV
from legacy_env import translate as legacy_texts
from model_folder import check_model_folder
from vllm_adapter import (
    ENGINE_CONFIG_ERRORS,
    AsyncEngineArgs,
    VllmConfig,
    create_engine_config,
    engine_args_from,
    engine_config_message,
    validate_frontend_args,
    visible_gpu_count,
)

log = logging.getLogger(__name__)

__all__ = ["ResolvedArgs", "WORKER_DEFAULTS", "get_engine_args", "known_env_names", "resolve_args"]

WORKER_DEFAULTS: Mapping[str, Any] = {
    "gpu_memory_utilization": 0.95,  # the worker owns the GPU; vLLM's 0.92 leaves it idle
    "max_num_seqs": 256,
    # Request logs carry no prompt or output text unless MAX_LOG_LEN is set: an opt-in, since
    # prompts are the users' data (vLLM's default, None, logs them whole).
    "max_log_len": 0,
}

# Set explicitly, any of these means the user chose how to spread the model over the GPUs.
PARALLEL_DESTS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


@dataclass
class ResolvedArgs:
    """The parsed ``vllm serve`` namespace (engine + front-end flags) and its provenance."""

    namespace: argparse.Namespace
    engine_args: AsyncEngineArgs
    flags: dict[str, Setting] = field(default_factory=dict)  # by dest: each configured flag
    baked_model: str | None = None  # repo id whose baked copy is served, if any

    def summary(self) -> str:
        return ", ".join(f"{s.dest}={s.shown} ({s.source})" for s in self.flags.values())

    def serve_argv(self) -> list[str]:
        """The `vllm serve` flags of this configuration (a 0 that means "unset" is left out)."""
        return [token for flag in self.flags.values()
                if not (flag.dest in ZERO_MEANS_UNSET and getattr(self.namespace, flag.dest) is None)
                for token in flag.tokens]

    def engine_config(self) -> VllmConfig:
        """vLLM's complete engine configuration, built as the engine builds it, so that a
        combination vLLM rejects stops start-up as a configuration error before the model loads."""
        try:
            return create_engine_config(copy.deepcopy(self.engine_args))
        except ENGINE_CONFIG_ERRORS as exc:
            raise ConfigError(f"invalid configuration:\n  {self._culprit()}: "
                              f"{engine_config_message(exc)}") from None

    def _culprit(self) -> str:
        """The settings to blame for a rejected engine configuration."""
        speculative = self.flags.get("speculative_config")
        if speculative is not None:
            without = copy.deepcopy(self.engine_args)
            without.speculative_config = None
            try:
                create_engine_config(without)
            except ENGINE_CONFIG_ERRORS:
                pass
            else:
                return speculative.source
        return "vLLM's engine configuration"


def known_env_names() -> frozenset[str]:
    """Every env var name this module reads."""
    return frozenset({d.upper() for d in env_parser().env_dests} | set(ENV_ALIASES)
                     | LEGACY_ENV
                     | {"VLLM_CONFIG_FILE", baked_args.ARGS_FILE_ENV})


def _worker_defaults_layer(parser: EnvParser, errors: list[str]) -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for dest, value in WORKER_DEFAULTS.items():
        if dest in parser.actions:
            parser.add(out, dest, value, "worker default", errors)
    return out


def _config_file_layer(parser: EnvParser, path: Path, errors: list[str]) -> dict[str, Setting]:
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        errors.append(f"config file {path}: not valid YAML ({exc})")
        return {}
    if not isinstance(config, dict):
        errors.append(f"config file {path}: expected a mapping of vLLM flags at the top level")
        return {}
    out: dict[str, Setting] = {}
    for key, value in config.items():
        dest = parser.dest_for_option(str(key))
        if dest is None:
            log.warning("Config file %s: unknown key %r ignored", path, key)
            continue
        if dest in SERVER_ONLY:
            log.warning("Config file %s: %r ignored: %s", path, key, SERVER_ONLY[dest])
            continue
        if value is not None:
            parser.add(out, dest, value, f"config file {path.name} {key}", errors)
    return out


def _env_layer(parser: EnvParser, env: Mapping[str, str], errors: list[str]) -> dict[str, Setting]:
    texts = {name: (value, f"env {name}") for name in env
             if name not in ENV_ALIASES and (value := env_value(name, env)) is not None}
    texts |= legacy_texts(env, errors)
    out: dict[str, Setting] = {}
    for name, given in texts.items():
        if given is not None and (dest := parser.dest_for_env(name)) is not None:
            parser.add(out, dest, given[0], given[1], errors)
    return out


def _lora_modules_text(text: str) -> str:
    """LORA_MODULES: a JSON list of adapters, or a single adapter object."""
    value = json.loads(text)
    return json.dumps(value if isinstance(value, list) else [value])


def _alias_layer(parser: EnvParser, env: Mapping[str, str], errors: list[str]) -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for name, dest in ENV_ALIASES.items():
        if (text := env_value(name, env)) is None or dest not in parser.actions:
            continue
        if name == "LORA_MODULES":
            try:
                text = _lora_modules_text(text)
            except ValueError as exc:
                errors.append(f"env LORA_MODULES: not valid JSON ({exc})")
                continue
        parser.add(out, dest, text, f"env {name}", errors)
    return out


def resolve_args(env: Mapping[str, str] | None = None, *,
                 config_file: Path | None = None,
                 baked_args_file: Path | None = None) -> ResolvedArgs:
    """Merge every layer and parse it with vLLM's parser; raise ConfigError naming each problem."""
    env = os.environ if env is None else env
    config_file = config_file or Path(env.get("VLLM_CONFIG_FILE") or "/vllm_config.yaml")
    baked_args_file = baked_args_file or baked_args.args_file(env)
    parser = env_parser()
    errors: list[str] = []
    baked_file = baked_args.read(baked_args_file, errors)
    baked = baked_args.baked_layer(parser, baked_file, baked_args_file, errors)
    layers = [_worker_defaults_layer(parser, errors), baked,
              _config_file_layer(parser, config_file, errors),
              _env_layer(parser, env, errors), _alias_layer(parser, env, errors)]
    merged = {dest: s for layer in layers for dest, s in layer.items()}
    baked_model = baked_args.use_baked_copies(merged, baked, baked_file)
    if baked and merged.get("model") is not baked.get("model"):
        # Another model is served: the baked tokenizer, quantization, ... describe the baked one.
        merged = {dest: s for layer in layers if layer is not baked for dest, s in layer.items()}
    if baked_model and "served_model_name" not in merged:
        merged["served_model_name"] = Setting(
            "served_model_name", ("--served-model-name", baked_model), "baked model id",
            baked_model)
    if "lora_modules" in merged and "enable_lora" not in merged:  # adapters need LoRA on
        merged["enable_lora"] = Setting("enable_lora", ("--enable-lora",), "implied by lora_modules", True)
    _default_to_all_gpus(merged)
    if "model" not in merged:
        errors.append("no model configured: set MODEL_NAME (or `model` in the config file)")
    namespace = parser.parse(merged, errors)
    if not errors:  # front-end checks assume each value parsed
        errors += validate_frontend_args(namespace)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    check_model_folder(merged["model"])
    try:
        engine_args = engine_args_from(namespace)
    except (OSError, ValueError) as exc:  # e.g. offline with a repo id that is not in the cache
        raise ConfigError(f"invalid configuration:\n  {merged['model'].source}: {exc}") from None
    return ResolvedArgs(namespace, engine_args, merged, baked_model)


def _default_to_all_gpus(merged: dict[str, Setting]) -> None:
    """With no parallelism configured, shard the model over every visible GPU, as worker-vllm
    did (it overrode even an explicit size); log the layout either way."""
    if (count := visible_gpu_count()) <= 1:
        return
    if chosen := [merged[dest] for dest in PARALLEL_DESTS if dest in merged]:
        log.info("%d GPUs visible; parallelism as configured: %s", count,
                 ", ".join(f"{s.dest}={s.value} ({s.source})" for s in chosen))
        return
    merged["tensor_parallel_size"] = Setting(
        "tensor_parallel_size", ("--tensor-parallel-size", str(count)), f"{count} visible GPUs", count)
    log.info("%d GPUs visible and no tensor, pipeline or data parallel size set: "
             "tensor_parallel_size=%d uses them all", count, count)


def get_engine_args(env: Mapping[str, str] | None = None) -> AsyncEngineArgs:
    """vLLM's ``AsyncEngineArgs`` from every configuration layer (worker-vllm's entry point)."""
    return resolve_args(env).engine_args
