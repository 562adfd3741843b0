"""LoRA adapters fetched from the Hugging Face hub by name, within one worker's caps.

A request may name ``<org>/<repo>`` or ``<org>/<repo>/<sub-folder>`` when a pattern of
``LORA_HUB_REPOS`` allows the repo (``org/*``, ``*``); ``org/repo@<revision>`` pins the repos it
matches to a branch, tag or commit. The hub matches repo ids in any case, so an adapter is kept
under the hub's own spelling: ``Org/Repo`` and ``org/repo`` are one download and one adapter.

The hub cache is on the network volume every worker of the endpoint shares, and a full volume breaks
every start: the hub lists an adapter's files and sizes before anything is downloaded, and a worker
fetches at most ``LORA_HUB_MAX_ADAPTERS`` adapters and ``LORA_HUB_MAX_BYTES`` of their files (a 400
past either). A name the hub does not have is remembered for ``MISS_SECONDS``, so that asking again
costs no hub call made with the operator's token. Blocking (huggingface_hub): the engine's registry
calls ``fetch`` in a thread pool of its own.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.file_download import repo_folder_name

from worker.model.adapter_files import ADAPTER_FILES, CONFIG_FILE
from worker.model.hub_errors import HUB_ERRORS, HubFailure, hub_failure
from worker.wire.errors import RequestError

log = logging.getLogger(__name__)

__all__ = ["AdapterError", "HubAdapters", "HubRule", "MISS_SECONDS", "hub_rules"]

MISS_SECONDS = 60.0
_MISSES_KEPT = 1024  # past this many remembered misses, the expired ones are dropped


class AdapterError(RequestError, ValueError):
    """An adapter that was found but cannot be served (400), a hub that could not be asked (502), or
    a cache that cannot take its download (507).
    A ValueError too: raised inside vLLM's serving classes, it is answered as their 400."""

    def __init__(self, name: str, reason: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(f"LoRA adapter '{name}' {reason}", param="model", status=status)


class _Missing(Exception):
    """The hub has no such adapter (repo, revision or files)."""


@dataclass(frozen=True)
class HubRule:
    pattern: str  # of repo ids, matched in any case
    revision: str | None = None  # None: the repo's default branch

    def allows(self, repo: str) -> bool:
        return fnmatch.fnmatchcase(repo.casefold(), self.pattern.casefold())


def hub_rules(text: str | None) -> tuple[HubRule, ...]:
    """LORA_HUB_REPOS: comma-separated patterns, each optionally ``@<revision>``."""
    rules = []
    for item in (text or "").split(","):
        pattern, _, revision = item.strip().partition("@")
        if pattern:
            rules.append(HubRule(pattern, revision or None))
    return tuple(rules)


@dataclass
class HubAdapters:
    rules: tuple[HubRule, ...]
    max_adapters: int  # LORA_HUB_MAX_ADAPTERS
    max_bytes: int  # LORA_HUB_MAX_BYTES
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _found: dict[str, tuple[str, Path]] = field(default_factory=dict, repr=False)  # key → (name, path)
    _sizes: dict[str, int] = field(default_factory=dict, repr=False)  # counted against the caps: name → bytes
    _misses: dict[str, float] = field(default_factory=dict, repr=False)  # key → when forgotten

    def fetch(self, name: str) -> tuple[str, Path] | None:
        """The adapter ``name`` names on the hub: its name in the hub's spelling, and its folder in the
        hub cache (downloaded if need be); None when no rule allows it or the hub has no such adapter.
        Raises ``AdapterError``: 400 past a cap or for a gated repo, 502 when the hub cannot be asked."""
        parts = name.split("/")
        if len(parts) < 2:
            return None
        repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
        if (rule := next((rule for rule in self.rules if rule.allows(repo)), None)) is None:
            return None
        key = f"{repo.casefold()}/{sub}"  # a repo id in any case; its folders as they are spelt
        with self._lock:
            if (found := self._found.get(key)) is not None:
                return found
            if self._misses.get(key, 0.0) > time.monotonic():
                return None
        try:
            with _hub_errors(name, repo):
                found = self._offline(name, repo, sub, rule) if constants.HF_HUB_OFFLINE \
                    else self._online(name, repo, sub, rule)
        except _Missing:
            self._missed(key)
            return None
        with self._lock:
            self._found[key] = found
        return found

    def _online(self, name: str, repo: str, sub: str, rule: HubRule) -> tuple[str, Path]:
        info = HfApi().model_info(repo, revision=rule.revision, files_metadata=True)
        wanted = _adapter_files(sub)
        sizes = {file.rfilename: file.size or 0 for file in info.siblings or () if file.rfilename in wanted}
        if wanted[0] not in sizes:
            raise _Missing
        spelt = "/".join(filter(None, (info.id, sub)))
        with self._counted(name, spelt, sum(sizes.values())):
            # By the rule's revision, not the commit: the cache then notes the branch, for offline starts.
            snapshot = snapshot_download(info.id, revision=rule.revision, allow_patterns=sorted(sizes))
        return spelt, Path(snapshot, sub)

    def _offline(self, name: str, repo: str, sub: str, rule: HubRule) -> tuple[str, Path]:
        """HF_HUB_OFFLINE: the adapter as the hub cache holds it, in the spelling it was cached under."""
        repo = _cached_spelling(repo)
        snapshot = Path(snapshot_download(repo, revision=rule.revision, allow_patterns=_adapter_files(sub)))
        path = snapshot / sub
        if not (path / CONFIG_FILE).is_file():
            raise _Missing
        spelt = "/".join(filter(None, (repo, sub)))
        self._count(name, spelt, sum(file.stat().st_size for file in path.iterdir() if file.is_file()))
        return spelt, path

    def _count(self, name: str, spelt: str, size: int) -> bool:
        """Counts the adapter against the caps (False: counted already, under another spelling or by
        a fetch under way); raises ``AdapterError`` (400) instead when it would pass one."""
        with self._lock:
            if spelt in self._sizes:
                return False
            if len(self._sizes) >= self.max_adapters:
                raise AdapterError(name, f"would be this worker's hub adapter number {self.max_adapters + 1}, "
                                         f"past LORA_HUB_MAX_ADAPTERS={self.max_adapters}")
            if (used := sum(self._sizes.values())) + size > self.max_bytes:
                raise AdapterError(name, f"has {size:,} bytes of files: with the {used:,} this worker "
                                         f"fetched already, past LORA_HUB_MAX_BYTES={self.max_bytes:,}")
            self._sizes[spelt] = size
        log.info("LoRA adapter %s from the hub: %d of LORA_HUB_MAX_ADAPTERS=%d, %s of LORA_HUB_MAX_BYTES=%s "
                 "bytes", spelt, len(self._sizes), self.max_adapters, f"{sum(self._sizes.values()):,}",
                 f"{self.max_bytes:,}")
        return True

    @contextmanager
    def _counted(self, name: str, spelt: str, size: int) -> Iterator[None]:
        """Counts the adapter for the block (a download), and for good if the block succeeds."""
        counted = self._count(name, spelt, size)
        try:
            yield
        except BaseException:
            if counted:
                with self._lock:
                    del self._sizes[spelt]
            raise

    def _missed(self, key: str) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._misses) >= _MISSES_KEPT:
                self._misses = {missed: until for missed, until in self._misses.items() if until > now}
            self._misses[key] = now + MISS_SECONDS


def _adapter_files(sub: str) -> list[str]:
    """The adapter's files in its repo (the config first)."""
    prefix = f"{sub}/" if sub else ""
    return [prefix + file for file in ADAPTER_FILES]


def _cached_spelling(repo: str) -> str:
    """The spelling ``repo`` was cached under (``repo`` itself if it was not)."""
    folder = repo_folder_name(repo_id=repo, repo_type="model").casefold()
    try:
        cached = [path.name for path in Path(constants.HF_HUB_CACHE).iterdir()]
    except OSError:
        return repo
    found = next((name for name in cached if name.casefold() == folder), None)
    return found.removeprefix("models--").replace("--", "/", 1) if found else repo


@contextmanager
def _hub_errors(name: str, repo: str) -> Iterator[None]:
    """huggingface_hub's exceptions as the caller's answer: a missing adapter, a gated repo (400), a
    cache that cannot take the download (507), a hub out of reach (502, its cause in the log: an
    error may carry the mirror's address)."""
    try:
        yield
    except HUB_ERRORS as exc:
        failure = hub_failure(exc)
        if failure is HubFailure.GATED:
            raise AdapterError(name, f"is in a gated or private repo ({repo}) that HF_TOKEN cannot read") from None
        if failure in _MISSING or (failure is HubFailure.NOT_CACHED and constants.HF_HUB_OFFLINE):
            raise _Missing from None
        if failure in (HubFailure.DISK_FULL, HubFailure.READ_ONLY):
            raise _unwritable(name, exc, failure) from None
        raise _unreachable(name, exc) from None


_MISSING = (HubFailure.NO_REPO, HubFailure.NO_REVISION, HubFailure.NO_FILE)


def _unwritable(name: str, exc: BaseException, failure: HubFailure) -> AdapterError:
    log.warning("LoRA adapter %s: the Hugging Face cache cannot take its download: %s", name, exc)
    why = "is full" if failure is HubFailure.DISK_FULL else "is read-only here"
    return AdapterError(name, f"could not be fetched from the hub: the Hugging Face cache (HF_HOME) {why}; "
                              "put the adapter in a folder of LORA_DIRS or on the volume, or point HF_HOME at "
                              "a writable disk with room", HTTPStatus.INSUFFICIENT_STORAGE)


def _unreachable(name: str, exc: Exception) -> AdapterError:
    log.warning("LoRA adapter %s: the hub (HF_ENDPOINT) could not be asked: %s", name, exc)
    return AdapterError(name, "could not be fetched from the hub (HF_ENDPOINT): it could not be asked; "
                              "the worker's log says why", HTTPStatus.BAD_GATEWAY)
