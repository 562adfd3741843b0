"""`vllm serve`'s command line, from vLLM's own parser: the flags it has (engine and front-end,
told apart), each flag's type for error messages, the engine's arguments from a parsed namespace,
and the front-end checks `vllm serve` makes before it starts (its parser plugins imported)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from pathlib import Path

from vllm import AsyncEngineArgs

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
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.import_utils import import_from_path

__all__ = ["arg_annotations", "build_arg_parser", "engine_arg_dests", "engine_args_from",
           "frontend_arg_dests", "validate_frontend_args"]


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
