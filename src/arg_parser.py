"""vLLM's own ``vllm serve`` parser, as the worker's configuration layers feed it.

Every configured value, whether env text or a typed YAML/JSON value, becomes the CLI tokens vLLM's
parser reads (a ``Setting``, which remembers where it came from), and each is parsed alone, so a
bad value is reported with the variable that set it. No flag list is kept: names, types and choices
come from ``make_arg_parser`` (through the adapter), so a vLLM upgrade brings its new flags along.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from env_text import parse_bool
from vllm_adapter import arg_annotations, build_arg_parser, engine_arg_dests

__all__ = ["ENV_ALIASES", "FRONTEND_DESTS", "RESERVED_ENV", "ZERO_MEANS_UNSET", "EnvParser", "Setting",
           "env_parser"]

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

# vLLM treats these as "derive from the model" when unset; RunPod templates send 0 for that.
ZERO_MEANS_UNSET = ("max_model_len", "max_num_batched_tokens")

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


class EnvParser:
    """vLLM's own ``vllm serve`` parser (``cli``), with lookups by dest and env name, and the
    conversion of configured values into its CLI tokens."""

    def __init__(self) -> None:
        self.cli = build_arg_parser()
        self.actions = {a.dest: a for a in self.cli._actions if a.option_strings}
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
        action = self.cli._option_string_actions.get("--" + key.replace("_", "-"))
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

    def add(self, out: dict[str, Setting], dest: str, value: Any, source: str, errors: list[str]) -> None:
        """Add the Setting for ``value`` (env text, or a typed YAML/JSON value) to ``out``."""
        try:
            tokens = (self.tokens_from_text(dest, value) if isinstance(value, str)
                      else self.tokens_from_value(dest, value))
        except ValueError as exc:
            errors.append(f"{source}={value!r}: {exc}; expected {self.expected(dest)}")
            return
        out[dest] = Setting(dest, tokens, source, value)

    def parse(self, merged: dict[str, Setting], errors: list[str]) -> argparse.Namespace:
        """One namespace from every setting, each parsed alone so a bad value names its source."""
        namespace = self.cli.parse_args([])
        for setting in merged.values():
            try:
                self.cli.parse_args(list(setting.tokens), namespace=namespace)
            except (argparse.ArgumentError, ValueError, TypeError) as exc:
                errors.append(f"{setting.source}={setting.shown}: {exc}; "
                              f"expected {self.expected(setting.dest)}")
        for dest in ZERO_MEANS_UNSET:
            if getattr(namespace, dest, None) == 0:
                setattr(namespace, dest, None)
        return namespace


@functools.cache
def env_parser() -> EnvParser:
    """The one parser (building vLLM's takes a while)."""
    return EnvParser()
