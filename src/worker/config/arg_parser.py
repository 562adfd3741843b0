"""vLLM's own ``vllm serve`` parser, as the worker's configuration layers feed it.

Every configured value, whether env text or a typed YAML/JSON value, becomes the CLI tokens vLLM's
parser reads (a ``Setting``, which remembers where it came from), and each is parsed alone, so a
bad value is reported with the variable that set it. No list of flags to read is kept: names, types
and choices come from ``make_arg_parser`` (through the adapter), so a vLLM upgrade brings its new
flags along; only the front-end flags of an HTTP server the worker does not run are left out
(``SERVER_ONLY``). A whole `vllm serve` command line (VLLM_EXTRA_ARGS) is parsed by the same parser
and split into one ``Setting`` per flag (``EnvParser.command_line``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.env_text import parse_bool
from worker.vllm_adapter.cli import arg_annotations, build_arg_parser, engine_arg_dests, frontend_arg_dests

log = logging.getLogger(__name__)

__all__ = ["ENV_ALIASES", "FRONTEND_DESTS", "OWNED", "REFUSED_ENGINE", "RESERVED_ENV", "REVIEWED_FRONTEND",
           "SERVER_ONLY", "ZERO_MEANS_UNSET", "EnvParser", "Setting", "env_parser", "unclassified_frontend_flags"]

ENV_ALIASES: Mapping[str, str] = {
    "MODEL_NAME": "model",
    "MODEL_REVISION": "revision",
    "TOKENIZER_NAME": "tokenizer",
    "CUSTOM_CHAT_TEMPLATE": "chat_template",
    "OPENAI_RESPONSE_ROLE": "response_role",
    "LORA_MODULES": "lora_modules",
}

# Why a front-end flag is not read: it configures an HTTP server the worker does not run (the worker
# calls vLLM's FastAPI app in-process: no socket, and no proxy or browser in front of it).
_SOCKET = "the HTTP server's socket (address, TLS, h11 limits): the worker calls vLLM's app in-process"
_UVICORN = "uvicorn's logs: the worker runs no uvicorn"
_CORS = "CORS, for browsers' cross-origin requests: jobs come from RunPod's queue"
_HTTP_CLIENTS = ("for proxies and HTTP clients (a path prefix, keep-alive comments, a request-id "
                 "header): jobs reach the app through neither")
_PROCESSES = "another process of `vllm serve` (gRPC, the data-parallel supervisor): the worker runs none"
_DENIED_ROUTES = "shapes only routes no job may call (route_table.DENIED)"

# FrontendArgs fields the worker does not read (env, config file), with the reason.
SERVER_ONLY: Mapping[str, str] = {
    **dict.fromkeys(["host", "port", "uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
                     "ssl_cert_reqs", "ssl_ciphers", "enable_ssl_refresh",
                     "h11_max_incomplete_event_size", "h11_max_header_count"], _SOCKET),
    **dict.fromkeys(["uvicorn_log_level", "disable_uvicorn_access_log",
                     "disable_access_log_for_endpoints"], _UVICORN),
    **dict.fromkeys(["allow_credentials", "allowed_origins", "allowed_methods", "allowed_headers"], _CORS),
    **dict.fromkeys(["root_path", "sse_keep_alive_interval", "enable_request_id_headers"], _HTTP_CLIENTS),
    **dict.fromkeys(["grpc_port", "data_parallel_supervisor_port", "dp_supervisor_probe_interval_s",
                     "dp_supervisor_probe_timeout_s", "dp_supervisor_probe_failure_threshold"],
                    _PROCESSES),
    **dict.fromkeys(["disable_fastapi_docs", "enable_offline_docs", "enable_server_load_tracking"],
                    _DENIED_ROUTES),
    "api_key": "RunPod authenticates callers: the worker drops vLLM's key check (build_openai_app)",
    "tokens_only": "a disaggregated deployment's tokens-only server, without the tokenizer the "
                   "worker's raw jobs need",
}

# Flags of the server's socket and authentication, which the worker owns, with the reason: given on
# a command line (VLLM_EXTRA_ARGS) they stop the start rather than be ignored, since the caller meant
# to change how the worker is reached (the other SERVER_ONLY flags are ignored with a warning there).
_IN_PROCESS = ("the worker has no HTTP server of vLLM's: jobs reach vLLM's app in-process (a "
               "load-balancing worker listens on PORT)")
OWNED: Mapping[str, str] = {
    **dict.fromkeys(["host", "port", "uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
                     "ssl_ciphers", "enable_ssl_refresh"], _IN_PROCESS),
    "api_key": "RunPod authenticates callers with the endpoint's API key; the worker checks no key itself",
}
# Engine flags the worker refuses to start with when on, with the reason: nothing would undo them.
REFUSED_ENGINE: Mapping[str, str] = {
    "checkpoint_prepare_on_startup": "the engine would start drained and serve only after "
                                     "/checkpoint/restore, a route no job may call (route_table.DENIED)",
}
# `vllm serve`'s own flags beyond the engine's and the front end's: how it runs its processes.
_SERVE_ONLY = {"api_server_count": _PROCESSES, "headless": _PROCESSES, "grpc": _PROCESSES,
               "headless_client_handshake_address": _PROCESSES}

# FrontendArgs fields reviewed and read. Reading is derived (a field not in SERVER_ONLY is read);
# this list only lets ``unclassified_frontend_flags`` report a field nobody has reviewed, so that
# the tests and the contract check against a newer vLLM fail on it until it is put here or in
# SERVER_ONLY. It may name fields of that newer vLLM (reasoning_effort_map: 0.33).
REVIEWED_FRONTEND: frozenset[str] = frozenset({
    "lora_modules", "response_role", "max_log_len", "log_error_stack", "middleware",
    # chat templates and request rendering
    "chat_template", "chat_template_content_format", "default_chat_template_kwargs",
    "trust_request_chat_template", "trust_request_mm_kwargs", "reasoning_effort_map",
    # tools
    "enable_auto_tool_choice", "tool_call_parser", "tool_parser_plugin", "tool_strict_level",
    "exclude_tools_when_tool_choice_none", "tool_server",
    # what responses carry
    "return_tokens_as_token_ids", "enable_prompt_tokens_details", "enable_per_request_metrics",
    "enable_force_include_usage", "fingerprint_mode", "fingerprint_value",
    # request logs
    "enable_log_outputs", "enable_log_deltas",
    # routes and API dialects
    "enable_tokenizer_info_endpoint", "enable_scale_out", "cohere_is_reasoning_model",
    "cohere_format", "anthropic_disabled_thinking_effort", "enable_flash_late_interaction",
})

# `vllm serve`'s front-end flags the worker reads, as engine flags are read.
FRONTEND_DESTS = frontend_arg_dests() - SERVER_ONLY.keys()


def unclassified_frontend_flags() -> list[str]:
    """This vLLM's front-end flags that are neither reviewed as read nor server-only: new in it."""
    return sorted(FRONTEND_DESTS - REVIEWED_FRONTEND)


# Engine fields never taken from a bare env var: huggingface_hub reads HF_TOKEN itself, and
# copying it into the engine args would put the secret into vLLM's "non-default args" log; LOG_LEVEL
# is the worker's own (any case), not vLLM's --log-level (capitals only; VLLM_LOGGING_LEVEL is vLLM's).
RESERVED_ENV = frozenset({"HF_TOKEN", "LOG_LEVEL"})

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
    def given(self) -> bool:
        """Set by the user (env, config file) or the image (baked), not a default of the worker's."""
        return self.source.startswith(("env ", "config file ", "baked "))

    @property
    def variables(self) -> tuple[str, ...]:
        """The variables that set it (``env A, B``; ``env A: ...``), or its config-file or baked source."""
        head = self.source.split(":", 1)[0]
        if head.startswith("env "):
            return tuple(name.strip() for name in head.removeprefix("env ").split(","))
        return (head,) if self.given else ()

    @property
    def shown(self) -> str:
        if _SECRET.search(self.dest):
            return "***"
        text = repr(self.value)
        return text if len(text) <= 80 else text[:77] + "..."


def _takes_list(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)


def _list_tokens(action: argparse.Action, items: list[Any]) -> tuple[str, ...]:
    """A list's tokens: ``--flag a b``, or ``--flag a --flag b`` for an append action
    (``--middleware``), which takes one item per flag."""
    flag = action.option_strings[0]
    texts = [item if isinstance(item, str) else json.dumps(item) for item in items]
    if isinstance(action, argparse._AppendAction):
        return tuple(token for text in texts for token in (flag, text))
    return (flag, *texts)


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
        if _takes_list(action):
            return _list_tokens(action, json.loads(text) if text.startswith("[") else [
                part.strip() for part in text.split(",") if part.strip()])
        return (flag, text)

    def tokens_from_value(self, dest: str, value: Any) -> tuple[str, ...]:
        """CLI tokens for a typed value (YAML, JSON), as `vllm serve --config` converts them."""
        if isinstance(value, bool):
            return self.tokens_from_text(dest, str(value))
        action = self.actions[dest]
        if isinstance(value, list):
            return _list_tokens(action, value)
        if isinstance(value, dict):
            return (action.option_strings[0], json.dumps(value))
        return (action.option_strings[0], str(value))

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
        return "a list" if _takes_list(action) else kind

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

    def command_line(self, text: str, variable: str, errors: list[str]) -> dict[str, Setting]:
        """Settings from a `vllm serve` command line (``variable``'s ``text``), split as a shell splits
        it and parsed by vLLM's parser as `vllm serve` parses it (``--flag=value``, ``-O3``, dotted
        config keys; a repeated flag's last value wins). A flag vLLM rejects, one the worker owns
        (``OWNED``) or a bare argument is an error; one of an HTTP server the worker does not run is
        ignored with a warning."""
        try:
            argv = shlex.split(text)
            if help_flag := next((a for a in argv if a in ("-h", "--help") or a.startswith("--help=")), None):
                raise ValueError(f"{help_flag} prints `vllm serve`'s help: it is not a setting")
            given, namespace = self._parse_recording(argv)
        except (argparse.ArgumentError, ValueError, TypeError) as exc:
            errors.append(f"env {variable}: {exc}")
            return {}
        out: dict[str, Setting] = {}
        for dest, (action, strings) in given.items():
            flag = action.option_strings[0] if action.option_strings else None
            if flag is None:
                errors.append(f"env {variable}: {strings[0]!r} is not a flag (name the model with --model)")
            elif dest in OWNED:
                errors.append(f"env {variable}: {flag} is the worker's own: {OWNED[dest]}")
            elif reason := SERVER_ONLY.get(dest) or _SERVE_ONLY.get(dest):
                log.warning("%s: %s ignored: %s", variable, flag, reason)
            elif dest != "config":  # its file's flags are given already, each as itself
                value = getattr(namespace, dest)
                shown = value if action.nargs == 0 else strings[0] if len(strings) == 1 else strings
                tokens = _given_tokens(action, strings, value)
                out[dest] = Setting(dest, tokens, f"env {variable}: {flag}", shown)
        return out

    def _parse_recording(self, argv: list[str]) -> tuple[dict[str, tuple[argparse.Action, list[str]]],
                                                         argparse.Namespace]:
        """``argv`` parsed, with each given action's argument strings as vLLM's parser passed them on
        (after its own rewriting); an append action's strings from every occurrence."""
        given: dict[str, tuple[argparse.Action, list[str]]] = {}
        parse_values = self.cli._get_values

        def recording(action: argparse.Action, strings: list[str]) -> Any:
            if action.option_strings or strings:  # a positional is offered every time, given or not
                earlier = given[action.dest][1] if isinstance(action, argparse._AppendAction) and \
                    action.dest in given else []
                given[action.dest] = (action, [*earlier, *strings])
            return parse_values(action, strings)

        self.cli._get_values = recording  # argparse's one funnel of a flag's argument strings
        try:
            namespace = self.cli.parse_args(argv, namespace=argparse.Namespace())
        finally:
            del self.cli._get_values
        return given, namespace


def _given_tokens(action: argparse.Action, strings: list[str], value: Any) -> tuple[str, ...]:
    """One flag's tokens, as given on a command line: a switch as its value says (``--no-x``)."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        negative = isinstance(action, argparse.BooleanOptionalAction) and not value
        return ("--no-" + flag[2:],) if negative else (flag,)
    if isinstance(action, argparse._AppendAction):
        return _list_tokens(action, strings)
    return (flag, *strings)


@functools.cache
def env_parser() -> EnvParser:
    """The one parser (building vLLM's takes a while)."""
    return EnvParser()
