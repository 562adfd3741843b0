"""The baked-args file: what ``model/download_model`` writes when a model or LoRA adapters are baked
into the image, and the worker's configuration layer built from it.

The file is a JSON object of env-style names: the local snapshot paths as ``MODEL_NAME`` /
``TOKENIZER_NAME``, the repos they came from as ``BAKED_MODEL_NAME`` / ``BAKED_TOKENIZER_NAME``,
and ``QUANTIZATION``; with adapters, their folder as ``BAKED_LORA_DIR`` and ``ENABLE_LORA``. Plain
(no vLLM): the image's bake step runs it with only its own files.

A start reads it once for each of its two moments: before vLLM is imported (``config/model_request``:
is the named repo the baked one, so that nothing is fetched?), and with the rest of the configuration
(``config/engine_args``, whose ``ResolvedArgs.baked`` hands it on to the LoRA adapters' sources).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.env_text import env_value

if TYPE_CHECKING:
    from worker.config.arg_parser import EnvParser, Setting

__all__ = ["BAKED_LORA_DIR_KEY", "BAKED_SOURCE_KEYS", "args_file", "baked_layer", "read", "use_baked_copies", "write"]

DEFAULT_ARGS_FILE = "/local_model_args.json"
ARGS_FILE_ENV = "LOCAL_MODEL_ARGS_FILE"  # where the file is, at build time and at run time
# The keys that name the repos the local copies came from, by the flag each copy is for.
BAKED_SOURCE_KEYS = {"model": "BAKED_MODEL_NAME", "tokenizer": "BAKED_TOKENIZER_NAME"}
# The folder of the LoRA adapters baked into the image (``LORA_ADAPTERS``), each ``<folder>/<name>``.
BAKED_LORA_DIR_KEY = "BAKED_LORA_DIR"


def args_file(env: Mapping[str, str]) -> Path:
    return Path(env_value(ARGS_FILE_ENV, env) or DEFAULT_ARGS_FILE)


def write(path: Path, model: tuple[str, Path] | None = None, tokenizer: tuple[str, Path] | None = None,
          quantization: str | None = None, lora_dir: Path | None = None) -> dict[str, str]:
    """Write the file for a model baked from repo ``model[0]`` at ``model[1]`` (and a tokenizer from
    another repo), and for LoRA adapters baked in ``lora_dir``; returns what was written."""
    baked: dict[str, str] = {}
    if model is not None:
        baked |= {"MODEL_NAME": str(model[1]), BAKED_SOURCE_KEYS["model"]: model[0]}
    if tokenizer is not None:
        baked |= {"TOKENIZER_NAME": str(tokenizer[1]), BAKED_SOURCE_KEYS["tokenizer"]: tokenizer[0]}
    if quantization:
        baked["QUANTIZATION"] = quantization
    if lora_dir is not None:  # requests name the adapters as models: vLLM serves them with LoRA on
        baked |= {BAKED_LORA_DIR_KEY: str(lora_dir), "ENABLE_LORA": "true"}
    path.write_text(json.dumps(baked, indent=2) + "\n")
    return baked


def read(path: Path, errors: list[str]) -> dict[str, Any]:
    """The file's object; {} when there is none (no model baked), with a problem in ``errors``."""
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


def baked_layer(parser: EnvParser, baked: dict[str, Any], path: Path,
                errors: list[str]) -> dict[str, Setting]:
    """The file's flags, read as env vars are (``BAKED_*`` names feed no flag)."""
    out: dict[str, Setting] = {}
    for name, value in baked.items():
        dest = parser.dest_for_env(name)
        if dest is None or value in (None, ""):
            continue
        parser.add(out, dest, value, f"baked {path.name} {name}", errors)
    return out


def use_baked_copies(merged: dict[str, Setting], baked: dict[str, Setting],
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
