"""Engine configuration: vLLM's own CLI parser, fed from layered sources.

Precedence, highest first (each layer is one function returning ``{dest: Setting}``):

0. command line      ``VLLM_EXTRA_ARGS``: raw `vllm serve` flags, split as a shell line (worker-vllm's),
                     the HTTP server's own refused or ignored (``EnvParser.command_line``)
1. env aliases       ``MODEL_NAME``→model, ``MODEL_REVISION``→revision, ``TOKENIZER_NAME``→tokenizer,
                     ``CUSTOM_CHAT_TEMPLATE``→chat_template, ``OPENAI_RESPONSE_ROLE``→response_role,
                     ``LORA_MODULES``→lora_modules
2. env vars          every engine and front-end flag of ``vllm serve`` as its UPPER_SNAKE name
                     (``MAX_MODEL_LEN``→``--max-model-len``) but the HTTP server's
                     (``arg_parser.SERVER_ONLY``), plus worker-vllm's legacy names (``config/legacy_env``)
3. config file       YAML at ``VLLM_CONFIG_FILE`` (``/vllm_config.yaml``), keys as in ``vllm serve --config``
                     (the HTTP server's flags ignored with a warning)
4. baked args        ``/local_model_args.json``, written when a model or LoRA adapters are baked in
5. worker defaults   ``WORKER_DEFAULTS``
6. vLLM defaults

Every value is parsed by vLLM's own parser (``config/arg_parser``), one setting at a time, so a bad
value is reported with the variable that set it, before the model loads. A blank env value means
"not set" (``env_text.env_value``). The baked layer, and the choice of the image's copy when its
repo is named, is ``model/baked_args``'s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from worker.config import early_settings
from worker.config.arg_parser import (
    ENV_ALIASES,
    REFUSED_ENGINE,
    SERVER_ONLY,
    ZERO_MEANS_UNSET,
    EnvParser,
    Setting,
    env_parser,
)
from worker.config.legacy_env import LEGACY_ENV, merge_rope
from worker.config.legacy_env import translate as legacy_texts
from worker.env_text import env_value
from worker.model import baked_args
from worker.model.model_folder import check_model_folder
from worker.model.repo_ids import is_repo_id
from worker.vllm_adapter.cli import engine_args_from, validate_frontend_args
from worker.vllm_adapter.engine_config import (
    VLLM_RESOLVES_MEMORY_UTILIZATION,
    VLLM_VERSION,
    AsyncEngineArgs,
    VllmConfig,
    create_engine_config,
    engine_config_message,
    memory_estimate,
    refused_variable,
    unsupported_architectures,
    visible_gpu_count,
)
from worker.wire.errors import ConfigError

if TYPE_CHECKING:
    from worker.model.preflight import Fetched

log = logging.getLogger(__name__)

__all__ = ["ResolvedArgs", "WORKER_DEFAULTS", "known_env_names", "resolve_args"]

WORKER_DEFAULTS: Mapping[str, Any] = {
    # The worker owns the GPU: vLLM's 0.92 leaves it idle. Not where vLLM resolves an unset value by
    # its KV cache's sizing (0.34: 1.0 for its extensible KV cache, which a number would shrink).
    **({} if VLLM_RESOLVES_MEMORY_UTILIZATION else {"gpu_memory_utilization": 0.95}),
    "max_num_seqs": 256,
    # Request logs carry no prompt or output text unless MAX_LOG_LEN is set: an opt-in, since
    # prompts are the users' data (vLLM's default, None, logs them whole).
    "max_log_len": 0,
}

# Engine flags by dest; a rejected configuration is blamed on a flag by building it without that
# flag, at most this many times (each build takes a fraction of a second).
_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
_NOT_BLAMED = frozenset({"model", "served_model_name"})  # without a model nothing builds
MAX_BLAME_TRIALS = 12

# Set explicitly, any of these means the user chose how to spread the model over the GPUs.
PARALLEL_DESTS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


@dataclass
class ResolvedArgs:
    """The parsed ``vllm serve`` namespace (engine + front-end flags) and its provenance."""

    namespace: argparse.Namespace
    engine_args: AsyncEngineArgs
    flags: dict[str, Setting] = field(default_factory=dict)  # by dest: each configured flag
    served_repo: str | None = None  # repo id whose local copy (baked or downloaded) is served, if any
    baked: dict[str, Any] = field(default_factory=dict)  # the baked-args file, read once (model/baked_args)

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
            config = create_engine_config(copy.deepcopy(self.engine_args))
        except Exception as exc:  # noqa: BLE001 - whatever vLLM raises here, the configuration caused it
            if variable := refused_variable(exc):
                raise ConfigError(f"invalid configuration:\n  env {variable}: {engine_config_message(exc)}",
                                  variables=(variable,)) from None
            model = self.flags["model"]
            if architectures := unsupported_architectures(str(self.engine_args.model)):
                raise ConfigError(
                    f"invalid configuration:\n  {model.source}: the model's architecture "
                    f"{', '.join(architectures)} is not one that vLLM {VLLM_VERSION} serves (natively or "
                    "through its Transformers backend): serve another model", variables=model.variables) from None
            culprits = self._culprits()
            raise ConfigError(
                f"invalid configuration:\n  {', '.join(s.source for s in culprits) or 'the engine configuration'}"
                f": {engine_config_message(exc)}",
                variables=tuple(dict.fromkeys(name for s in culprits for name in s.variables))) from None
        return self._fitted(config)

    def _fitted(self, config: VllmConfig) -> VllmConfig:
        """The configuration, if one request of max_model_len can fit the GPUs' memory at all
        (``memory_estimate``); a length the user did not choose is left to vLLM to fit instead."""
        estimate, length = memory_estimate(config), config.model_config.max_model_len
        if estimate is None or estimate.fits(length):
            return config
        gib = 2**30
        needs = (f"{estimate.weights / gib:.1f} GiB of weights and {estimate.kv_per_token * length / gib:.1f} "
                 f"GiB of KV cache for one {length}-token request exceed the {estimate.budget / gib:.1f} GiB "
                 "the GPUs' memory and GPU_MEMORY_UTILIZATION allow")
        if estimate.max_tokens and "max_model_len" not in self.flags:
            log.warning("Model's full length does not fit (%s): max_model_len=-1, vLLM fits the longest "
                        "that does (about %d tokens); set MAX_MODEL_LEN to choose", needs, estimate.max_tokens)
            self.engine_args.max_model_len = -1
            return create_engine_config(copy.deepcopy(self.engine_args))
        if estimate.max_tokens:
            raise ConfigError(f"invalid configuration:\n  {self.flags['max_model_len'].source}: {needs}; "
                              f"about {estimate.max_tokens} tokens fit",
                              variables=("MAX_MODEL_LEN", "GPU_MEMORY_UTILIZATION"))
        raise ConfigError(f"invalid configuration:\n  {self.flags['model'].source}: {needs}: the weights "
                          "alone do not fit; use GPUs with more memory, more of them (TENSOR_PARALLEL_SIZE), "
                          "or a quantized model", variables=("MODEL_NAME", "TENSOR_PARALLEL_SIZE"))

    def _culprits(self) -> list[Setting]:
        """The settings to blame for a rejected engine configuration: those given (not defaults)
        without which vLLM accepts it, tried one at a time; else every one given."""
        given = [s for s in self.flags.values() if s.given and s.dest in _ENGINE_FIELDS
                 and s.dest not in _NOT_BLAMED]
        blamed = []
        for setting in given[:MAX_BLAME_TRIALS]:
            trial = copy.deepcopy(self.engine_args)
            field_ = _ENGINE_FIELDS[setting.dest]
            setattr(trial, setting.dest, field_.default_factory() if field_.default_factory is not MISSING
                    else field_.default)
            try:
                create_engine_config(trial)
            except Exception:  # noqa: BLE001, S112 - still rejected: not this one alone
                continue
            blamed.append(setting)
        return blamed or [s for s in self.flags.values() if s.given]


def known_env_names() -> frozenset[str]:
    """Every env var name this module reads."""
    return frozenset({d.upper() for d in env_parser().env_dests} | set(ENV_ALIASES)
                     | LEGACY_ENV
                     | {"VLLM_CONFIG_FILE", early_settings.EXTRA_ARGS_ENV, baked_args.ARGS_FILE_ENV})


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


def _command_line_layer(parser: EnvParser, env: Mapping[str, str], errors: list[str]) -> dict[str, Setting]:
    text = env_value(early_settings.EXTRA_ARGS_ENV, env)
    return {} if text is None else parser.command_line(text, early_settings.EXTRA_ARGS_ENV, errors)


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


# The flag of each repo the worker may fetch, and the flag of its revision (vLLM's tokenizer is the
# model unless set).
_REVISION_OF = {"model": "revision", "tokenizer": "tokenizer_revision"}


def _use_download(merged: dict[str, Setting], dest: str, fetched: Fetched | None) -> bool:
    """Serve ``preflight``'s snapshot for the flag that names its repo (or for the tokenizer, when
    only its revision differs); its revision flag then has nothing left to pick."""
    setting = merged.get(dest)
    if fetched is None or (setting is not None and setting.value != fetched.repo):
        return False
    path = str(fetched.path)
    source = f"{setting.source if setting else 'the model'}: {fetched.repo} at commit {fetched.commit[:12]}"
    merged[dest] = Setting(dest, (f"--{dest}", path), source, path)
    merged.pop(_REVISION_OF[dest], None)
    return True




def _drop_local_pins(merged: dict[str, Setting]) -> None:
    """Drop a revision whose repo is served from a local folder (or a URI): it pins nothing there, and
    vLLM hands it on to other repos, which seldom have it (RevisionNotFound): the model's to another
    tokenizer repo, to a config repo (hf_config_path) and, through the tokenizer's, to a draft model's
    tokenizer (use_heterogeneous_vocab). A revision ``_use_download`` consumed is gone already."""
    for repo_dest, revision_dest in _REVISION_OF.items():
        pin, repo = merged.get(revision_dest), merged.get(repo_dest) or merged.get("model")
        if pin is None or repo is None or is_repo_id(str(repo.value)):
            continue
        del merged[revision_dest]
        log.info("%s=%s not given to vLLM: %s is no hub repo, which a revision would pin, and vLLM would "
                 "ask other repos for it", pin.source, pin.value, repo.value)


def resolve_args(env: Mapping[str, str] | None = None, *,
                 config_file: Path | None = None,
                 baked_args_file: Path | None = None,
                 downloaded: tuple[Fetched, Fetched | None] | None = None) -> ResolvedArgs:
    """Merge every layer and parse it with vLLM's parser; raise ConfigError naming each problem.
    ``downloaded``: the snapshots ``preflight`` fetched, served in place of their repo ids."""
    env = os.environ if env is None else env
    config_file = config_file or early_settings.config_file(env)
    baked_args_file = baked_args_file or baked_args.args_file(env)
    parser = env_parser()
    errors: list[str] = []
    baked_file = baked_args.read(baked_args_file, errors)
    baked = baked_args.baked_layer(parser, baked_file, baked_args_file, errors)
    layers = [_worker_defaults_layer(parser, errors), baked,
              _config_file_layer(parser, config_file, errors),
              _env_layer(parser, env, errors), _alias_layer(parser, env, errors),
              _command_line_layer(parser, env, errors)]
    merged = {dest: s for layer in layers for dest, s in layer.items()}
    served_repo = baked_args.use_baked_copies(merged, baked, baked_file)
    if "model" in baked and merged.get("model") is not baked["model"]:
        # Another model is served: the baked tokenizer, quantization, ... describe the baked one
        # (adapters baked without a model are for the model named at run time: their LoRA switch holds).
        merged = {dest: s for layer in layers if layer is not baked for dest, s in layer.items()}
    if downloaded and _use_download(merged, "model", downloaded[0]):
        served_repo = downloaded[0].repo
        _use_download(merged, "tokenizer", downloaded[1])
    _drop_local_pins(merged)
    if served_repo and "served_model_name" not in merged:
        merged["served_model_name"] = Setting(
            "served_model_name", ("--served-model-name", served_repo), "the model's repo id",
            served_repo)
    if "lora_modules" in merged and "enable_lora" not in merged:  # adapters need LoRA on
        merged["enable_lora"] = Setting("enable_lora", ("--enable-lora",), "implied by lora_modules", True)
    _default_to_all_gpus(merged)
    if "model" not in merged:
        errors.append("no model configured: set MODEL_NAME (or `model` in the config file)")
    namespace = parser.parse(merged, errors)
    if not errors:  # front-end checks assume each value parsed
        errors += validate_frontend_args(namespace)
        errors += [f"{merged[dest].source}: {reason}" for dest, reason in REFUSED_ENGINE.items()
                   if getattr(namespace, dest, None)]
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    check_model_folder(merged["model"])
    try:
        engine_args = engine_args_from(namespace)
        if "hf_overrides" in merged:
            engine_args.hf_overrides = merge_rope(engine_args.hf_overrides, merged["hf_overrides"].source)
    except (OSError, ValueError) as exc:  # e.g. offline with a repo id that is not in the cache
        raise ConfigError(f"invalid configuration:\n  {merged['model'].source}: {exc}") from None
    return ResolvedArgs(namespace, engine_args, merged, served_repo, baked_file)


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
