"""The model request: the hub repos the configuration serves, read before vLLM is imported, for
``model/preflight`` to check and fetch (a bad repo or token answered in seconds).

``model_request(env)`` reads the model, its revision, another tokenizer repo and its revision, and a
hub token from the same layers, in the same order, as vLLM's parser is fed (``config/engine_args``):
VLLM_EXTRA_ARGS, the env aliases (MODEL_NAME, ...), the env, then the config file; the image's baked
copy is used when a layer names the repo it came from (``model/baked_args``).

VLLM_EXTRA_ARGS is split here by a small reader of its own (``_extra_arg``: ``--flag value``,
``--flag=value``, underscores or dashes, the last one winning), not by vLLM's parser: importing vLLM to
build that parser puts 16 to 19 s before preflight's first answer on a busy 2-core machine (0.5 to 1 s
without it; 2026-12-07), and preflight is the step that answers a mistyped repo or a refused token
before any of that. The two can read a line differently only where vLLM's parser does more: an
abbreviated flag (``--tokenizer-rev``), or flags inside a ``--config`` file. Then the engine's reading
wins: preflight's snapshot is served only for the repo vLLM's parser names
(``engine_args._use_download``), and vLLM fetches any other itself.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

import yaml

from worker.config.early_settings import EXTRA_ARGS_ENV, config_file
from worker.config.settings import read_settings
from worker.env_text import env_value
from worker.model import baked_args
from worker.model.preflight import ModelRequest, RepoRequest
from worker.model.repo_ids import is_repo_id

__all__ = ["model_request"]


def _config_file_keys(env: Mapping[str, str]) -> dict[str, str]:
    """The config file's string values by dest (``tokenizer-revision`` → ``tokenizer_revision``);
    a file that does not parse is {} here (``load_config`` reports it)."""
    try:
        config = yaml.safe_load(config_file(env).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {str(k).replace("-", "_"): str(v) for k, v in config.items() if v not in (None, "")}


def _extra_arg(env: Mapping[str, str], key: str) -> str | None:
    """The value VLLM_EXTRA_ARGS gives the flag of ``key`` (``--key value`` or ``--key=value``, the last
    one winning), read without vLLM's parser, for the repos preflight fetches; a line that does not
    split is reported by ``load_config``."""
    try:
        tokens = shlex.split(env_value(EXTRA_ARGS_ENV, env) or "")
    except ValueError:
        return None
    flag, found = "--" + key.replace("_", "-"), None
    for at, token in enumerate(tokens):
        name, equals, value = token.partition("=")
        if name.replace("_", "-") == flag:
            found = value if equals else next(iter(tokens[at + 1:at + 2]), None)
    return None if found is not None and found.startswith("--") else found  # a flag without a value


def _first(env: Mapping[str, str], file: dict[str, str], names: tuple[str, ...],
           key: str) -> tuple[str | None, str]:
    """The first value set among VLLM_EXTRA_ARGS's flag, env ``names``, then the config file's
    ``key``, and its name (the first env name when none is set: where a user would set it)."""
    if (value := _extra_arg(env, key)) is not None:
        return value, f"{EXTRA_ARGS_ENV} --{key.replace('_', '-')}"
    for name in names:
        if (value := env_value(name, env)) is not None:
            return value, name
    if key not in file:
        return None, names[0]
    return file[key], f"{key} in {config_file(env)} (VLLM_CONFIG_FILE)"


def model_request(env: Mapping[str, str] | None = None) -> ModelRequest | None:
    """The hub repos the configuration serves, for ``preflight`` to check and fetch before vLLM is
    imported: read from the same layers as ``load_config`` (VLLM_EXTRA_ARGS, env alias, env, config
    file; the baked file's copy when it names the same repo). None when there is none to fetch: a
    local folder, the baked copy, or no model configured (``load_config`` then says so)."""
    env = os.environ if env is None else env
    file = _config_file_keys(env)
    baked = baked_args.read(baked_args.args_file(env), [])
    model, model_var = _first(env, file, ("MODEL_NAME", "MODEL"), "model")
    if model is None or not is_repo_id(model) or model == baked.get(baked_args.BAKED_SOURCE_KEYS["model"]):
        return None
    revision, revision_var = _first(env, file, ("MODEL_REVISION", "REVISION"), "revision")
    timeout = read_settings(env, ("MODEL_PREFLIGHT_TIMEOUT",)).model_preflight_timeout
    request = RepoRequest(model, revision, model_var, revision_var, timeout)
    token, token_var = _first(env, file, ("HF_TOKEN",), "hf_token")
    token = token if token_var != "HF_TOKEN" and token not in ("true", "True") else None  # True: the login's
    tokenizer, tokenizer_var = _first(env, file, ("TOKENIZER_NAME", "TOKENIZER"), "tokenizer")
    tokenizer_revision, tokenizer_revision_var = _first(env, file, ("TOKENIZER_REVISION",),
                                                        "tokenizer_revision")
    if tokenizer is None or tokenizer == model:
        if tokenizer_revision in (None, revision):
            return ModelRequest(request, token=token)
        tokenizer, tokenizer_var = model, model_var
    if not is_repo_id(tokenizer) or tokenizer == baked.get(baked_args.BAKED_SOURCE_KEYS["tokenizer"]):
        return ModelRequest(request, token=token)
    # Another repo's tokenizer: its own default branch unless TOKENIZER_REVISION names one.
    return ModelRequest(request, RepoRequest(tokenizer, tokenizer_revision, tokenizer_var,
                                             tokenizer_revision_var, timeout), token=token)
