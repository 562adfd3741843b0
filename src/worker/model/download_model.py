"""Bakes a model and LoRA adapters into the Docker image at build time: ``python3 /src/download_model.py``.

Reads the Dockerfile's build args from the environment (with neither ``MODEL_NAME`` nor
``LORA_ADAPTERS``, nothing is baked and the script succeeds):

- ``MODEL_NAME``: the repo to bake; when unset or blank, no model is baked;
- ``MODEL_REVISION``: its branch, tag or commit (default: main);
- ``TOKENIZER_NAME`` / ``TOKENIZER_REVISION``: a tokenizer from another repo or revision, baked too;
- ``QUANTIZATION``: recorded for the worker, which loads the model with it;
- ``LORA_ADAPTERS``: LoRA adapters, comma-separated, each ``source`` or ``name=source``: a repo
  (``org/repo``) or a folder in one (``org/repo/sub/folder``), served as model ``name`` (default: the
  source), which must be a name the worker serves (``model/adapter_files.NAME``).

From each model repo it downloads the config and tokenizer files and exactly one weight format (top-level
``*.safetensors``, else ``*.bin``, else ``*.pt``; no training state), with progress bars, into
``BAKED_MODELS_DIR`` (default ``/models``; not under ``BASE_PATH``, where a network volume is
mounted at run time and would hide it). Of each adapter's folder it downloads PEFT's files alone
(``adapter_config.json``, ``adapter_model.*``) and copies them to ``BAKED_MODELS_DIR/loras/<name>``:
the worker looks an adapter up as a folder by its name, not in a hub cache. They come through a
temporary cache, removed afterwards, so that the image holds each adapter once.

Then it writes ``LOCAL_MODEL_ARGS_FILE`` (default ``/local_model_args.json``), the file the worker's
config layer reads (``model/baked_args``: the local snapshot paths, the repos they came from, and
``QUANTIZATION``; the adapters' folder and ``ENABLE_LORA``). Revisions are not written: a snapshot
path is one revision already, and a revision there would also apply to any other model named at run
time.

The Hugging Face token comes from huggingface_hub's usual sources: ``HF_TOKEN``, or the file at
``HF_TOKEN_PATH`` (the Dockerfile points it at the ``HF_TOKEN`` BuildKit secret). With
``HF_HUB_OFFLINE=1`` the repos (adapters' too) are taken from the local cache in ``BAKED_MODELS_DIR``.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx2  # huggingface_hub's HTTP client
import huggingface_hub
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from worker.env_text import env_value
from worker.model import baked_args
from worker.model.adapter_files import ADAPTER_FILES, CONFIG_FILE, NAME

log = logging.getLogger("download_model")

DEFAULT_MODELS_DIR = "/models"
LORA_DIR = "loras"  # under BAKED_MODELS_DIR: the adapters, each at loras/<name>

# One weight format per repo, in vLLM's order of preference; only top-level files are weights
# (sub-folders hold other variants, e.g. `original/` checkpoints or ONNX exports).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
# Training state saved beside the weights, which vLLM skips (and which may dwarf the model).
TRAINING_STATE = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt",
                            "scaler.pt"})
# Everything else a model needs: configs (also in sub-folders, e.g. sentence-transformers pooling),
# tokenizer files of every kind, chat templates, and code for trust_remote_code models.
SUPPORT_PATTERNS = ("*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py", "tokenizer*")


class BakeError(Exception):
    """A model cannot be baked; the message says why and what to do."""


class Snapshot(NamedTuple):
    path: Path
    files: tuple[str, ...]


class AdapterEntry(NamedTuple):
    """One adapter of ``LORA_ADAPTERS``."""

    name: str  # the model name requests give
    repo: str
    folder: str  # its folder in the repo; "" for the top

    @property
    def source(self) -> str:
        return f"{self.repo}/{self.folder}".removesuffix("/")


def weight_files(files: Iterable[str]) -> list[str]:
    """The repo's weights in the first format it has (safetensors, else .bin, else .pt)."""
    top_level = [f for f in files if "/" not in f and f not in TRAINING_STATE]
    for suffix in WEIGHT_SUFFIXES:
        if found := sorted(f for f in top_level if f.endswith(suffix)):
            return found
    return []


def select_files(files: Iterable[str], *, weights: bool) -> list[str]:
    """The files to bake from a repo's file list: config and tokenizer files, and its weights.

    Raises ValueError when the repo has no config or tokenizer files, or no weights when they are
    wanted.
    """
    files = sorted(files)
    chosen = {f for f in files if any(fnmatch.fnmatch(f, p) for p in SUPPORT_PATTERNS)}
    if not chosen:
        raise ValueError(f"no config or tokenizer files ({', '.join(SUPPORT_PATTERNS)}) among: "
                         + ", ".join(files))
    if weights:
        found = weight_files(files)
        if not found:
            raise ValueError("no weight files (top-level *.safetensors, *.bin or *.pt) among: "
                             + ", ".join(files))
        chosen.update(found)
    return sorted(chosen)


def repo_files(repo: str, revision: str | None, cache_dir: Path) -> list[str]:
    """Every file of the repo at ``revision``: from the hub, or from the local cache when offline."""
    if constants.HF_HUB_OFFLINE:
        snapshot = Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                          local_files_only=True))
        return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    return HfApi().list_repo_files(repo, revision=revision)


def _token_hint() -> str:
    if huggingface_hub.get_token() is None:
        return "build with a token: HF_TOKEN=hf_... docker buildx bake worker-baked"
    return "check that the token given can read it"


@contextmanager
def _explained(where: str) -> Iterator[None]:
    """Hub errors as BakeErrors saying what went wrong and how to fix it."""
    try:
        yield
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass
        raise BakeError(f"{where} is gated: accept its terms on huggingface.co, then "
                        f"{_token_hint()}") from None
    except RepositoryNotFoundError:
        raise BakeError(f"{where} does not exist on the Hugging Face hub, or is private: "
                        f"{_token_hint()}") from None
    except RevisionNotFoundError:
        raise BakeError(f"{where}: no such revision") from None
    except LocalEntryNotFoundError:
        raise BakeError(f"{where} is not in the local cache, and HF_HUB_OFFLINE is set") from None
    except HfHubHTTPError as exc:
        if exc.response is not None and exc.response.status_code == 401:  # the token itself
            raise BakeError(f"{where}: the hub refused the token (invalid or revoked): "
                            "build with a valid read token") from None
        raise BakeError(f"{where}: the hub at {constants.ENDPOINT} answered: {exc}") from None
    except ValueError as exc:
        raise BakeError(f"{where}: {exc}") from None
    except httpx2.TransportError as exc:
        raise BakeError(f"{where}: cannot reach the hub at {constants.ENDPOINT} ({exc})") from None


def fetch(repo: str, revision: str | None, cache_dir: Path, *, weights: bool) -> Snapshot:
    """Download the files ``select_files`` picks; returns the local snapshot."""
    with _explained(f"{repo} (revision {revision or 'main'})"):
        files = select_files(repo_files(repo, revision, cache_dir), weights=weights)
        log.info("Baking %s: %s", repo, ", ".join(files))
        path = snapshot_download(repo, revision=revision, cache_dir=cache_dir, allow_patterns=files)
    return Snapshot(Path(path), tuple(files))


def adapter_entries(text: str) -> list[AdapterEntry]:
    """``LORA_ADAPTERS``' entries; raises BakeError at the first the worker could not serve, or at
    a name given twice."""
    entries: dict[str, AdapterEntry] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, source = item.rpartition("=")
        entry = _adapter_entry(name.strip() or source.strip(), source.strip())
        if entry.name in entries:
            raise BakeError(f"LORA_ADAPTERS: two adapters are named {entry.name}")
        entries[entry.name] = entry
    return list(entries.values())


def _adapter_entry(name: str, source: str) -> AdapterEntry:
    parts = source.split("/")
    if len(parts) < 2 or any(part in ("", ".", "..") for part in parts[2:]):
        raise BakeError(f"LORA_ADAPTERS: {source!r} is neither a hub repo (org/repo) nor a folder in one "
                        "(org/repo/sub/folder)")
    repo = "/".join(parts[:2])
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise BakeError(f"LORA_ADAPTERS: {source!r}: {exc}") from None
    if not NAME.fullmatch(name):
        hint = f"; give it one: name={source}" if name == source else ""
        raise BakeError(f"LORA_ADAPTERS: {name!r} cannot name an adapter: requests name it as their model, "
                        "in 1 to 3 segments joined by '/', each of letters, digits, '.', '_' and '-' that "
                        f"starts with a letter or digit{hint}")
    return AdapterEntry(name, repo, "/".join(parts[2:]))


@contextmanager
def _download_cache(models_dir: Path) -> Iterator[Path]:
    """Where adapters are downloaded before they are copied into place: a temporary cache, so that the
    image holds no second copy (offline: the local cache in ``models_dir``, as for the model)."""
    if constants.HF_HUB_OFFLINE:
        yield models_dir
        return
    with tempfile.TemporaryDirectory(prefix="lora-cache-") as cache_dir:
        yield Path(cache_dir)


def fetch_adapter(entry: AdapterEntry, cache_dir: Path, dest: Path) -> None:
    """Download the adapter's own files (none other of its repo) and copy them to ``dest``."""
    prefix = f"{entry.folder}/" if entry.folder else ""
    with _explained(f"LoRA adapter {entry.name} ({entry.source})"):
        snapshot = snapshot_download(entry.repo, cache_dir=cache_dir,
                                     allow_patterns=[prefix + file for file in ADAPTER_FILES])
    folder = Path(snapshot, entry.folder)
    files = [file for file in ADAPTER_FILES if (folder / file).is_file()]
    if CONFIG_FILE not in files:
        raise BakeError(f"LoRA adapter {entry.name} ({entry.source}): no {CONFIG_FILE} there; name the "
                        "folder of the adapter, as org/repo/sub/folder when it is not the repo's top")
    dest.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copyfile(folder / file, dest / file)  # the bytes: a cache file is a symlink to its blob
    log.info("Baked LoRA adapter %s from %s: %s", entry.name, entry.source, ", ".join(files))


def bake_adapters(entries: list[AdapterEntry], models_dir: Path) -> Path:
    """Bake each adapter at ``models_dir/loras/<name>``; returns that folder."""
    lora_dir = models_dir / LORA_DIR
    with _download_cache(models_dir) as cache_dir:
        for entry in entries:
            fetch_adapter(entry, cache_dir, lora_dir / entry.name)
    return lora_dir


def bake_model(env: Mapping[str, str], models_dir: Path) -> dict[str, Any]:
    """Bake the model (and tokenizer) ``env`` names; returns ``baked_args.write``'s arguments for
    them, {} when MODEL_NAME is empty."""
    model = env_value("MODEL_NAME", env)
    if model is None:
        log.info("MODEL_NAME is empty: no model baked in")
        return {}
    revision = env_value("MODEL_REVISION", env)
    local_model = fetch(model, revision, models_dir, weights=True).path
    tokenizer = env_value("TOKENIZER_NAME", env) or model
    # Another repo's tokenizer comes from its own default branch unless TOKENIZER_REVISION names one.
    tokenizer_revision = env_value("TOKENIZER_REVISION", env) or (revision if tokenizer == model else None)
    other_tokenizer = None
    if (tokenizer, tokenizer_revision) != (model, revision):  # else the model's own files serve
        other_tokenizer = tokenizer, fetch(tokenizer, tokenizer_revision, models_dir, weights=False).path
    return {"model": (model, local_model), "tokenizer": other_tokenizer,
            "quantization": env_value("QUANTIZATION", env)}


def bake(env: Mapping[str, str]) -> dict[str, str] | None:
    """Bake the model (and tokenizer) and the LoRA adapters ``env`` names; returns the args written,
    None when it names neither."""
    adapters = adapter_entries(env_value("LORA_ADAPTERS", env) or "")  # a bad entry fails before any download
    models_dir = Path(env_value("BAKED_MODELS_DIR", env) or DEFAULT_MODELS_DIR)
    model_args = bake_model(env, models_dir)
    lora_dir = bake_adapters(adapters, models_dir) if adapters else None
    if not model_args and lora_dir is None:
        return None
    path = baked_args.args_file(env)
    baked = baked_args.write(path, **model_args, lora_dir=lora_dir)
    log.info("Wrote %s: %s", path, baked)
    return baked


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    huggingface_hub.utils.enable_progress_bars()  # the build log is the only sign of a long download
    try:
        bake(os.environ)
    except BakeError as exc:
        log.error("Cannot bake: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
