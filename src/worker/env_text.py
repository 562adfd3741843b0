"""How the worker reads one environment value: blank means unset; booleans in the usual spellings.
Plain: no vLLM; the bake step runs it too."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["env_value", "parse_bool"]

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def env_value(name: str, env: Mapping[str, str]) -> str | None:
    """``env[name]`` stripped, or None when it is missing or blank."""
    value = env.get(name, "").strip()
    return value or None


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")
