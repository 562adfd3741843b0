"""What a model's name is: a local path, a remote URI (``s3://...``) or a Hugging Face hub repo id.

The one rule the worker reads names by: which models preflight fetches (``config/model_request``),
which revision pins vLLM is given (``config/engine_args``), which model folders are checked
(``model/model_folder``) and which base models a LoRA adapter is compared with (``model/lora_adapters``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_path", "is_repo_id"]


def is_path(name: str) -> bool:
    """Written as a path: absolute, or from ``.`` or ``~`` (a name vLLM never asks the hub for)."""
    return name.startswith(("/", ".", "~"))


def is_repo_id(name: str) -> bool:
    """A hub repo id: neither a path, a remote URI, nor a folder that exists (``org/name`` in the
    working folder is loaded from there, as vLLM does)."""
    return not (is_path(name) or "://" in name or Path(name).is_dir())
