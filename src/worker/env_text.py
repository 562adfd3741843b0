"""How the worker reads one environment value: blank means unset, and booleans in pydantic's
spellings (those ``WorkerSettings`` reads its own with), for every variable. Plain: no vLLM; the
bake step runs it too."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import TypeAdapter, ValidationError

__all__ = ["BOOL_SPELLINGS", "env_value", "parse_bool"]

# What pydantic reads as a boolean, in any case: listed for the error message (pydantic decides).
BOOL_SPELLINGS = "true/false, 1/0, yes/no, on/off, t/f, y/n"
_BOOL = TypeAdapter(bool)


def env_value(name: str, env: Mapping[str, str]) -> str | None:
    """``env[name]`` stripped, or None when it is missing or blank."""
    value = env.get(name, "").strip()
    return value or None


def parse_bool(value: str) -> bool:
    try:
        return _BOOL.validate_python(value.strip())
    except ValidationError:
        raise ValueError(f"not a boolean ({BOOL_SPELLINGS})") from None
