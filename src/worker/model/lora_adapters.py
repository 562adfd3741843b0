"""LoRA adapters by name: where a request's adapter is found, and whether it fits the served model.

A request names an adapter (its ``model``); ``AdapterSources.find`` looks for it, in order:

1. in each folder of ``LORA_DIRS`` (default ``$BASE_PATH/loras``, on the network volume), as
   ``<folder>/<name>``;
2. among the adapters baked into the image (``LORA_ADAPTERS`` build arg), as ``<baked folder>/<name>``;
3. on the Hugging Face hub, when ``LORA_HUB_REPOS`` allows the repo: ``<org>/<repo>`` or
   ``<org>/<repo>/<sub-folder>`` (``model/hub_adapters``, within the worker's caps). Only the
   adapter's files are downloaded, into the hub cache (``HF_HOME``, on the network volume); the
   adapter's name is then the hub's spelling of it.

An adapter is a folder with PEFT's ``adapter_config.json`` and its weights. Every worker of an
endpoint reads the same sources, so a name means the same adapter on each of them.

Found but unusable (an unreadable config, not LoRA, a rank above ``MAX_LORA_RANK``, another base
model): ``AdapterError`` (400), checked before vLLM loads anything. Plain (no vLLM): the engine's
registry (``engine/adapters``) loads what this finds.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from worker.model.adapter_files import CONFIG_FILE, NAME
from worker.model.hub_adapters import AdapterError, HubAdapters
from worker.model.repo_ids import is_repo_id


__all__ = ["Adapter", "AdapterError", "AdapterSources", "CONFIG_FILE", "VLLM_LORA_RANKS"]

# vLLM's choices for --max-lora-rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_MAX_DEPTH = 3


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    source: str  # where it was found, for logs: "volume", "image", "hub" or a folder


def _names_a_repo(name: str) -> bool:
    """A repo id with its owner (``org/name``): a bare name (a served name, ``gpt2``) tells no base model."""
    return is_repo_id(name) and "/" in name


def _normal(name: str) -> str:
    return name.rstrip("/").casefold()


@dataclass(frozen=True)
class AdapterSources:
    """Where adapters are found, and what they must fit."""

    folders: tuple[tuple[Path, str], ...]  # (folder, label), searched in order
    hub: HubAdapters | None  # the hub repos a request may name (LORA_HUB_REPOS); None: not the hub
    max_rank: int  # MAX_LORA_RANK
    served_names: frozenset[str]  # the served model's path, repo id and served names
    check_base_model: bool = True

    def find(self, name: str) -> Adapter | None:
        """The adapter called ``name``, checked; None when no source has it. Blocking: a hub
        adapter is downloaded (run it in a thread)."""
        if not NAME.fullmatch(name):
            return None
        for folder, label in self.folders:
            if (folder / name / CONFIG_FILE).is_file():
                return self._checked(Adapter(name, folder / name, label))
        if self.hub is not None and (found := self.hub.fetch(name)) is not None:
            return self._checked(Adapter(*found, "hub"))
        return None

    def available(self) -> list[Adapter]:
        """The adapters in the folders (not the hub's: asking it costs a request per repo), the
        first folder's where two have one name."""
        found: dict[str, Adapter] = {}
        for folder, label in self.folders:
            for path in _adapter_folders(folder, _MAX_DEPTH):
                name = path.relative_to(folder).as_posix()
                if NAME.fullmatch(name):
                    found.setdefault(name, Adapter(name, path, label))
        return sorted(found.values(), key=lambda adapter: adapter.name)

    def _checked(self, adapter: Adapter) -> Adapter:
        try:
            config = json.loads((adapter.path / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise AdapterError(adapter.name, f"has an unreadable {CONFIG_FILE}: {exc}") from None
        if not isinstance(config, dict):
            raise AdapterError(adapter.name, f"has an unreadable {CONFIG_FILE}: not a JSON object")
        if (kind := config.get("peft_type", "LORA")) != "LORA":
            raise AdapterError(adapter.name, f"is a {kind} adapter: only LoRA adapters are served")
        rank = config.get("r")
        if isinstance(rank, int) and rank > self.max_rank:
            fits = next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])
            raise AdapterError(adapter.name, f"has rank {rank}, above MAX_LORA_RANK={self.max_rank}: "
                                             f"set MAX_LORA_RANK={fits} (more GPU memory per adapter)")
        if problem := self._base_model_problem(config.get("base_model_name_or_path")):
            raise AdapterError(adapter.name, problem)
        return adapter

    def _base_model_problem(self, base: object) -> str | None:
        """Why the adapter's base model is not the served one, when its config tells (a hub repo
        id, and the served model is known by one too); a local path tells nothing."""
        if not self.check_base_model or not isinstance(base, str) or not _names_a_repo(base):
            return None
        served = {_normal(name) for name in self.served_names}
        repos = sorted(name for name in self.served_names if _names_a_repo(name))
        if _normal(base) in served or not repos:
            return None
        return (f"was trained for base model '{base}', not the served '{repos[0]}' (its {CONFIG_FILE}'s "
                "base_model_name_or_path); set LORA_CHECK_BASE_MODEL=false to serve it anyway")


def _adapter_folders(folder: Path, depth: int) -> list[Path]:
    """The folders under ``folder``, ``depth`` levels down at most, that hold an adapter."""
    try:
        entries = [entry for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith(".")]
    except OSError:
        return []
    found = []
    for entry in entries:
        path = Path(entry.path)
        if (path / CONFIG_FILE).is_file():
            found.append(path)
        elif depth > 1:
            found += _adapter_folders(path, depth - 1)
    return found
