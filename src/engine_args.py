"""Engine configuration: vLLM's own CLI parser, fed from layered sources.

Precedence, highest first (each layer is one function returning ``{dest: Setting}``):

1. env aliases       ``MODEL_NAME``→model, ``MODEL_REVISION``→revision, ``TOKENIZER_NAME``→tokenizer,
                     ``CUSTOM_CHAT_TEMPLATE``→chat_template, ``OPENAI_RESPONSE_ROLE``→response_role,
                     ``LORA_MODULES``→lora_modules
2. env vars          every flag of ``vllm serve``'s engine parser as its UPPER_SNAKE name
                     (``MAX_MODEL_LEN``→``--max-model-len``), the OpenAI front-end flags in
                     ``FRONTEND_DESTS``, plus worker-vllm's legacy names (``legacy_env``)
3. config file       YAML at ``VLLM_CONFIG_FILE`` (``/vllm_config.yaml``), keys as in ``vllm serve --config``
4. baked args        ``/local_model_args.json``, written when a model is baked into the image
5. worker defaults   ``WORKER_DEFAULTS``
6. vLLM defaults

No flag list is kept here: names, types and choices come from ``make_arg_parser``, so a vLLM
upgrade brings its new flags along. Every value is converted to CLI tokens and parsed by vLLM's
parser, one setting at a time, so a bad value is reported with the variable that set it, before
the model loads. An empty env value means "not set".
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from env_text import env_value, parse_bool
from errors import ConfigError
from legacy_env import LEGACY_ENV
from legacy_env import translate as legacy_texts
from vllm_adapter import (
    ENGINE_CONFIG_ERRORS,
    AsyncEngineArgs,
    VllmConfig,
    arg_annotations,
    build_arg_parser,
    create_engine_config,
    engine_arg_dests,
    engine_config_message,
    validate_frontend_args,
    visible_gpu_count,
)

log = logging.getLogger(__name__)

__all__ = ["ENV_ALIASES", "FRONTEND_DESTS", "ResolvedArgs", "Setting", "WORKER_DEFAULTS",
           "get_engine_args", "known_env_names", "resolve_args"]

ENV_ALIASES: Mapping[str, str] = {
    "MODEL_NAME": "model",
    "MODEL_REVISION": "revision",
    "TOKENIZER_NAME": "tokenizer",
    "CUSTOM_CHAT_TEMPLATE": "chat_template",
    "OPENAI_RESPONSE_ROLE": "response_role",
    "LORA_MODULES": "lora_modules",
}

# `vllm serve` front-end flags that shape how requests are served. The others (host, port, TLS,
# CORS, API key, uvicorn) belong to an HTTP server the worker does not run.
FRONTEND_DESTS = frozenset({
    "chat_template", "chat_template_content_format", "default_chat_template_kwargs",
    "enable_auto_tool_choice", "tool_call_parser", "tool_parser_plugin",
    "exclude_tools_when_tool_choice_none", "enable_force_include_usage", "enable_log_outputs",
    "enable_log_deltas", "enable_prompt_tokens_details", "log_error_stack", "lora_modules",
    "response_role", "return_tokens_as_token_ids", "trust_request_chat_template",
    "max_log_len", "tool_strict_level", "enable_scale_out", "enable_tokenizer_info_endpoint",
})

# Engine fields never taken from a bare env var: huggingface_hub reads HF_TOKEN itself, and
# copying it into the engine args would put the secret into vLLM's "non-default args" log.
RESERVED_ENV = frozenset({"HF_TOKEN"})

WORKER_DEFAULTS: Mapping[str, Any] = {
    "gpu_memory_utilization": 0.95,  # the worker owns the GPU; vLLM's 0.92 leaves it idle
    "max_num_seqs": 256,
    # Request logs carry no prompt or output text unless MAX_LOG_LEN is set: an opt-in, since
    # prompts are the users' data (vLLM's default, None, logs them whole).
    "max_log_len": 0,
}

# vLLM treats these as "derive from the model" when unset; RunPod templates send 0 for that.
ZERO_MEANS_UNSET = ("max_model_len", "max_num_batched_tokens")

# Set explicitly, any of these means the user chose how to spread the model over the GPUs.
PARALLEL_DESTS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")

# Keys of the baked-args file that name the repos the local copies came from.
BAKED_SOURCE_KEYS = {"model": "BAKED_MODEL_NAME", "tokenizer": "BAKED_TOKENIZER_NAME"}

_SECRET = re.compile(r"(^|_)(token|key|secret|password)$")


@dataclass(frozen=True)
class Setting:
    """One configured flag: the CLI tokens vLLM's parser reads, and where they came from."""

    dest: str
    tokens: tuple[str, ...]
    source: str
    value: Any  # as given, for the summary log and baked-model matching

    @property
    def shown(self) -> str:
        if _SECRET.search(self.dest):
            return "***"
        text = repr(self.value)
        return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class ResolvedArgs:
    """The parsed ``vllm serve`` namespace (engine + front-end flags) and its provenance."""

    namespace: argparse.Namespace
    engine_args: AsyncEngineArgs
    settings: dict[str, Setting] = field(default_factory=dict)
    baked_model: str | None = None  # repo id whose baked copy is served, if any

    def summary(self) -> str:
        return ", ".join(f"{s.dest}={s.shown} ({s.source})" for s in self.settings.values())

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
        speculative = self.settings.get("speculative_config")
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


class _Parser:
    """vLLM's parser with lookups by dest and env name."""

    def __init__(self) -> None:
        self.parser = build_arg_parser()
        self.actions = {a.dest: a for a in self.parser._actions if a.option_strings}
        self.env_dests = {d for d in engine_arg_dests() | FRONTEND_DESTS if d in self.actions}
        self.annotations = arg_annotations()

    def dest_for_env(self, name: str) -> str | None:
        if name in ENV_ALIASES:
            return ENV_ALIASES[name]
        dest = name.lower()
        if name.isupper() and name not in RESERVED_ENV and dest in self.env_dests:
            return dest
        return None

    def dest_for_option(self, key: str) -> str | None:
        action = self.parser._option_string_actions.get("--" + key.replace("_", "-"))
        return action.dest if action else None

    def tokens_from_text(self, dest: str, text: str) -> tuple[str, ...]:
        """CLI tokens for an env string, typed by the action it feeds."""
        action = self.actions[dest]
        flag = action.option_strings[0]
        if action.nargs == 0:  # boolean flags
            on = parse_bool(text)
            if isinstance(action, argparse.BooleanOptionalAction):
                return (flag if on else "--no-" + flag[2:],)
            return (flag,) if on else ()
        if action.nargs in ("+", "*"):
            items = json.loads(text) if text.startswith("[") else [
                part.strip() for part in text.split(",") if part.strip()]
            return (flag, *(i if isinstance(i, str) else json.dumps(i) for i in items))
        return (flag, text)

    def tokens_from_value(self, dest: str, value: Any) -> tuple[str, ...]:
        """CLI tokens for a typed value (YAML, JSON), as `vllm serve --config` converts them."""
        if isinstance(value, bool):
            return self.tokens_from_text(dest, str(value))
        flag = self.actions[dest].option_strings[0]
        if isinstance(value, list):
            return (flag, *(v if isinstance(v, str) else json.dumps(v) for v in value))
        if isinstance(value, dict):
            return (flag, json.dumps(value))
        return (flag, str(value))

    def expected(self, dest: str) -> str:
        """What the flag accepts, in words, from vLLM's own choices and annotations."""
        action = self.actions[dest]
        if action.choices:
            return "one of " + ", ".join(map(str, action.choices))
        if action.nargs == 0:
            return "a boolean"
        kind = self.annotations.get(dest, "str")
        if "dict" in kind or "Config" in kind:
            return f"JSON ({kind})"
        return "a list" if action.nargs in ("+", "*") else kind


@functools.cache
def _parser() -> _Parser:
    return _Parser()


def known_env_names() -> frozenset[str]:
    """Every env var name this module reads."""
    return frozenset({d.upper() for d in _parser().env_dests} | set(ENV_ALIASES)
                     | LEGACY_ENV
                     | {"VLLM_CONFIG_FILE", "LOCAL_MODEL_ARGS_FILE"})


def _add(out: dict[str, Setting], parser: _Parser, dest: str, value: Any, source: str,
         errors: list[str]) -> None:
    """Add the Setting for ``value`` (env text, or a typed YAML/JSON value) to ``out``."""
    try:
        tokens = (parser.tokens_from_text(dest, value) if isinstance(value, str)
                  else parser.tokens_from_value(dest, value))
    except ValueError as exc:
        errors.append(f"{source}={value!r}: {exc}; expected {parser.expected(dest)}")
        return
    out[dest] = Setting(dest, tokens, source, value)


def _worker_defaults_layer(parser: _Parser, errors: list[str]) -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for dest, value in WORKER_DEFAULTS.items():
        if dest in parser.actions:
            _add(out, parser, dest, value, "worker default", errors)
    return out


def _read_baked(path: Path, errors: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        baked = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        errors.append(f"baked args {path}: not valid JSON ({exc})")
        return {}
    if not isinstance(baked, dict):
        errors.append(f"baked args {path}: expected a JSON object")
        return {}
    return baked


def _baked_layer(parser: _Parser, baked: dict[str, Any], path: Path,
                 errors: list[str]) -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    for name, value in baked.items():
        dest = parser.dest_for_env(name)
        if dest is None or value in (None, ""):
            continue
        _add(out, parser, dest, value, f"baked {path.name} {name}", errors)
    return out


def _config_file_layer(parser: _Parser, path: Path, errors: list[str]) -> dict[str, Setting]:
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
        if value is not None:
            _add(out, parser, dest, value, f"config file {path.name} {key}", errors)
    return out


def _env_layer(parser: _Parser, env: Mapping[str, str], errors: list[str]) -> dict[str, Setting]:
    texts = {name: (value, f"env {name}") for name in env
             if name not in ENV_ALIASES and (value := env_value(name, env)) is not None}
    texts |= legacy_texts(env, errors)
    out: dict[str, Setting] = {}
    for name, given in texts.items():
        if given is not None and (dest := parser.dest_for_env(name)) is not None:
            _add(out, parser, dest, given[0], given[1], errors)
    return out


def _lora_modules_text(text: str) -> str:
    """LORA_MODULES: a JSON list of adapters, or a single adapter object."""
    value = json.loads(text)
    return json.dumps(value if isinstance(value, list) else [value])


def _alias_layer(parser: _Parser, env: Mapping[str, str], errors: list[str]) -> dict[str, Setting]:
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
        _add(out, parser, dest, text, f"env {name}", errors)
    return out


def _use_baked_copies(merged: dict[str, Setting], baked: dict[str, Setting],
                      sources: dict[str, Any]) -> str | None:
    """Serve the image's local copy when a higher layer names the repo that was baked.

    Returns the baked model's repo id when the baked model is served.
    """
    for dest, key in BAKED_SOURCE_KEYS.items():
        repo = sources.get(key)
        if repo and dest in baked and merged.get(dest) and merged[dest].value == repo:
            merged[dest] = baked[dest]
    model_repo = sources.get(BAKED_SOURCE_KEYS["model"])
    if "model" in baked and merged.get("model") is baked["model"]:
        return model_repo or None
    return None


def _parse(parser: _Parser, merged: dict[str, Setting], errors: list[str]) -> argparse.Namespace:
    namespace = parser.parser.parse_args([])
    for setting in merged.values():
        try:
            parser.parser.parse_args(list(setting.tokens), namespace=namespace)
        except (argparse.ArgumentError, ValueError, TypeError) as exc:
            shown = setting.shown
            errors.append(f"{setting.source}={shown}: {exc}; expected {parser.expected(setting.dest)}")
    for dest in ZERO_MEANS_UNSET:
        if getattr(namespace, dest, None) == 0:
            setattr(namespace, dest, None)
    return namespace


def resolve_args(env: Mapping[str, str] | None = None, *,
                 config_file: Path | None = None,
                 baked_args_file: Path | None = None) -> ResolvedArgs:
    """Merge every layer and parse it with vLLM's parser; raise ConfigError naming each problem."""
    env = os.environ if env is None else env
    config_file = config_file or Path(env.get("VLLM_CONFIG_FILE") or "/vllm_config.yaml")
    baked_args_file = baked_args_file or Path(
        env.get("LOCAL_MODEL_ARGS_FILE") or "/local_model_args.json")
    parser = _parser()
    errors: list[str] = []
    baked_file = _read_baked(baked_args_file, errors)
    baked = _baked_layer(parser, baked_file, baked_args_file, errors)
    layers = [_worker_defaults_layer(parser, errors), baked,
              _config_file_layer(parser, config_file, errors),
              _env_layer(parser, env, errors), _alias_layer(parser, env, errors)]
    merged = {dest: s for layer in layers for dest, s in layer.items()}
    baked_model = _use_baked_copies(merged, baked, baked_file)
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
    namespace = _parse(parser, merged, errors)
    if not errors:  # front-end checks assume each value parsed
        errors += validate_frontend_args(namespace)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    _check_local_model(merged["model"])
    try:
        engine_args = AsyncEngineArgs.from_cli_args(namespace)
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


def _check_local_model(setting: Setting) -> None:
    """A model given as a path must be a model folder: say so now, not in a traceback later."""
    path = Path(str(setting.value))
    if not (path.is_absolute() or str(setting.value).startswith(".")):
        return  # a hub repo id
    if not path.is_dir():
        problem = "no such directory"
    elif not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
        problem = "not a model folder (no config.json)"
    else:
        return
    raise ConfigError(f"invalid configuration:\n  {setting.source}={setting.value!r}: {problem}")


def get_engine_args(env: Mapping[str, str] | None = None) -> AsyncEngineArgs:
    """vLLM's ``AsyncEngineArgs`` from every configuration layer (worker-vllm's entry point)."""
    return resolve_args(env).engine_args
