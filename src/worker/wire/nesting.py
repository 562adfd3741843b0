"""JSON nested deeper than the worker serves: the limit, and reading and writing such JSON.

Python's ``json`` (both ways), ``repr``, and much of pydantic's and vLLM's code recurse once per level
of nesting, and fail with a RecursionError near the interpreter's limit (1,000 frames, less those in
use). A job input nested ~1,000 levels deep failed where it was parsed: in a batch from RunPod's
job-take it failed the whole batch (its jobs, already taken, were never answered), and on a
load-balancing endpoint it was a bare 500. So:

- ``MAX_DEPTH``: the most levels a job input or a request body may nest (``too_deep``); deeper is
  refused with a 400 that says so. Far above what a real request needs (a JSON schema ten objects
  deep is some 25 levels; serde_json's default limit is the same 128), and far below where
  anything on the worker's paths fails: a request within it is served as before. A string that
  holds JSON counts its own levels where it sits: vLLM parses some (a tool call's ``arguments``, a
  JSON schema given as text), and its chat renderer failed with a RecursionError on deep ones.
- ``loads``: ``json.loads``, but JSON too deep for it is split at its top levels without recursion,
  and a part still too deep is kept unparsed as ``Raw`` text (always ``too_deep``): the other jobs of
  a batch are read, and the deep one is refused alone.
- ``dumps``: ``json.dumps``, with ``Raw`` text written as it is (the local endpoint passes such a job
  on to its worker, as RunPod does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["MAX_DEPTH", "Raw", "dumps", "loads", "refusal", "too_deep"]

MAX_DEPTH = 128

# What splitting needs to see: a string (whose brackets do not count), a bracket, a comma or a colon.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:,]')


@dataclass(frozen=True)
class Raw:
    """A JSON value nested too deep for Python's parser, as its text."""
    text: str


# Exact classes, as json.loads makes them: a set lookup is 3 times faster than isinstance (100,000-token
# prompts are walked too).
_NESTED = frozenset({dict, list, Raw})


def refusal(what: str) -> str:
    """The error message for ``what`` ("the job input", "the request body"), nested too deep."""
    return (f"{what} is nested more than {MAX_DEPTH} levels deep (JSON objects and arrays within each "
            f"other); the worker serves at most {MAX_DEPTH}")


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests dicts and lists more than ``limit`` levels deep, counting the levels of
    a string that holds JSON (it starts with ``[`` or ``{``) where it sits; a ``Raw`` part always does.
    Level by level, without recursion; it stops at the first level with nothing nested."""
    level = [value]
    for depth in range(limit + 1):  # ``depth`` containers around each item of ``level``
        containers = []
        for item in level:
            kind = item.__class__
            if kind in _NESTED:
                containers.append(item)
            elif kind is str and _JSON_TEXT.match(item) and _text_too_deep(item, limit - depth):
                return True
        if not containers:
            return False
        if depth == limit or any(item.__class__ is Raw for item in containers):
            return True
        level = [child for item in containers for child in (item.values() if item.__class__ is dict else item)]
    return False


_JSON_TEXT = re.compile(r"\s*[\[{]")


def _text_too_deep(text: str, limit: int) -> bool:
    """Whether the brackets of ``text`` outside its strings nest more than ``limit`` deep."""
    depth = 0
    for token in _TOKENS.finditer(text):
        mark = token.group()
        if mark in "[{":
            depth += 1
            if depth > limit:
                return True
        elif mark in "]}":
            depth -= 1
    return False


def loads(data: str | bytes, levels: int = 0) -> Any:
    """``json.loads(data)``; JSON too deep for it is split ``levels`` levels down (an array into its
    items, an object into its members), and what is still too deep is ``Raw``. ValueError: not JSON."""
    try:
        return json.loads(data)
    except RecursionError:
        pass
    text = (data.decode(json.detect_encoding(data)) if isinstance(data, bytes) else data).strip()
    if levels <= 0:
        return Raw(text)
    members = [(key, loads(value, levels - 1)) for key, value in _members(text)]
    return [value for _, value in members] if text.startswith("[") else dict(members)


def _members(text: str) -> list[tuple[str | None, str]]:
    """The members of the JSON array or object ``text``: (key, value text) pairs, the key None in an
    array. Only brackets outside strings are counted: no recursion, however deep ``text`` is."""
    if text[:1] not in ("[", "{"):
        raise ValueError(f"expected a JSON array or object, not {text[:20]!r}")
    depth, start, key, members = 0, 1, None, []
    for token in _TOKENS.finditer(text):
        mark = token.group()
        depth += (mark in "[{") - (mark in "]}")
        if depth == 1 and mark == ":":
            key, start = json.loads(text[start:token.start()]), token.end()
        elif (depth == 1 and mark == ",") or depth == 0:
            if value := text[start:token.start()].strip():
                members.append((key, value))
            key, start = None, token.end()
            if depth == 0:
                break
    if depth != 0 or text[start:].strip():
        raise ValueError("unbalanced brackets, or text after the JSON value")
    if any((key is None) != (text[0] == "[") or not isinstance(key, str | None) for key, _ in members):
        raise ValueError("an object member without a string key, or an array item with one")
    return members


class _HasRaw(Exception):
    pass


def _refuse_raw(value: Any) -> NoReturn:
    raise _HasRaw if isinstance(value, Raw) else TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(value: Any) -> str:
    """``json.dumps(value)``, with each ``Raw`` part's text as it is. Only the containers that hold
    one are written piece by piece (they sit a level or two down)."""
    try:
        return json.dumps(value, default=_refuse_raw)
    except _HasRaw:
        pass
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(key))}: {dumps(item)}" for key, item in value.items()) + "}"
    return "[" + ", ".join(map(dumps, value)) + "]"
