"""The check that a model given as a path is a model folder, made before vLLM is handed it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from worker.model.repo_ids import is_path
from worker.wire.errors import ConfigError

if TYPE_CHECKING:
    from worker.config.arg_parser import Setting

__all__ = ["check_model_folder"]


def check_model_folder(setting: Setting) -> None:
    """A model given as a path must be a model folder: say so now, not in a traceback later."""
    path = Path(str(setting.value))
    if not is_path(str(setting.value)):
        return  # a hub repo id or a remote URI
    if not path.is_dir():
        problem = "no such directory"
    elif not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
        problem = "not a model folder (no config.json)"
    else:
        return
    raise ConfigError(f"invalid configuration:\n  {setting.source}={setting.value!r}: {problem}")
