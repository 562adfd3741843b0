"""vLLM's compile cache: whether a start found it warm, and a copy on RunPod's network volume that
the endpoint's workers share, so that a new container does not compile again.

vLLM keeps what it derives at start-up under its cache root (``VLLM_CACHE_ROOT``, by default on the
container's own disk, lost with the container): torch.compile's graphs and kernels, AOT-compiled
functions, and smaller derived state. Each is an *entry*, a file or folder named by a hash of
everything it depends on (model, configuration, vLLM and torch code, hardware), so entries of other
models and configurations sit side by side and are never mistaken for one another.

The worker does not point vLLM's cache root at the volume itself. vLLM writes an entry in place
(the index of compiled graphs is rewritten with a plain ``open("w")``), so a worker reading an entry
while another writes it, or a worker killed mid-compile, would leave a torn entry that every later
start would load. Instead:

- before the engine starts, the volume's entries that the local root lacks are copied into it;
- vLLM compiles and reads there, as on any machine;
- once the engine has started, the local entries the volume lacks are published: copied to a
  temporary name on the volume, then renamed into place. A rename is atomic: readers see an entry
  whole or not at all, and when two workers publish the same entry the first rename wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["CacheState", "EngineStart", "VolumeCache", "cache_state", "entries", "snapshot"]

TMP_PREFIX = ".tmp-"  # an entry being copied; never read
STALE_TMP_SECONDS = 3600  # a temporary copy this old was left by a worker that died mid-copy


def entries(root: Path, entry_dirs: Iterable[str]) -> frozenset[str]:
    """The entries under ``root``: each child of an ``entry_dirs`` folder that is not itself one of
    them, as a path relative to ``root``."""
    dirs = set(entry_dirs)
    found = set()
    for parent in dirs:
        with _missing_ok():
            for child in os.scandir(root / parent):
                name = f"{parent}/{child.name}"
                if name not in dirs and not child.name.startswith(TMP_PREFIX):
                    found.add(name)
    return frozenset(found)


Snapshot = dict[str, frozenset[tuple[str, int, int]]]  # entry → its files' (path, size, mtime)


def snapshot(root: Path, entry_dirs: Iterable[str]) -> Snapshot:
    """Every entry under ``root`` with the size and modification time of each of its files."""
    return {name: frozenset(_files(root / name)) for name in entries(root, entry_dirs)}


def _files(entry: Path) -> Iterable[tuple[str, int, int]]:
    """An entry's files, but for lock files (empty; a reader opens them for writing)."""
    paths = [entry] if entry.is_file() else (Path(top, name) for top, _, names in os.walk(entry)
                                             for name in names if not name.endswith(".lock"))
    for path in paths:
        with _missing_ok():  # a file vLLM replaced meanwhile
            stat = path.stat(follow_symlinks=False)
            yield str(path), stat.st_size, stat.st_mtime_ns


@dataclass(frozen=True)
class CacheState:
    """What the engine's start did with the compile cache, for the start-up log line."""

    # "cold": compiled and wrote entries (new ones, or existing ones it could not load and wrote
    # again); "warm": compiled nothing, it found what it needed; "off": compiles nothing;
    # "unused": compiles, but caches nothing (VLLM_DISABLE_COMPILE_CACHE)
    state: str
    written: int = 0

    def __str__(self) -> str:
        return f"{self.state} ({self.written} entries written)" if self.state == "cold" else self.state


def cache_state(before: Snapshot, after: Snapshot, compiles: bool) -> CacheState:
    if not compiles:
        return CacheState("off")
    if written := sum(before.get(name) != files for name, files in after.items()):
        return CacheState("cold", written)
    return CacheState("warm" if after else "unused")


@dataclass(frozen=True)
class VolumeCache:
    """The entries of the local cache root ``local`` mirrored on the volume, at ``volume``."""

    volume: Path
    local: Path
    entry_dirs: tuple[str, ...]

    def seed(self) -> int:
        """Copy the volume's entries the local root lacks into it; returns how many."""
        started = time.perf_counter()
        missing = sorted(entries(self.volume, self.entry_dirs) - entries(self.local, self.entry_dirs))
        copied = sum(_copy_atomically(self.volume / name, self.local / name) for name in missing)
        log.info("Compile cache: %d entries copied from %s in %.2fs", copied, self.volume,
                 time.perf_counter() - started)
        return copied

    def publish(self) -> int:
        """Publish the local entries the volume lacks; returns how many this call published."""
        started = time.perf_counter()
        for parent in self.entry_dirs:
            _remove_stale_copies(self.volume / parent)
        missing = sorted(entries(self.local, self.entry_dirs) - entries(self.volume, self.entry_dirs))
        published = sum(_copy_atomically(self.local / name, self.volume / name) for name in missing)
        log.info("Compile cache: %d new entries published to %s in %.2fs (%d published by another "
                 "worker meanwhile)", published, self.volume, time.perf_counter() - started,
                 len(missing) - published)
        return published


def _copy_atomically(source: Path, target: Path) -> bool:
    """Copy ``source`` (a file or folder) to ``target`` through a temporary sibling renamed into
    place; False when ``target`` appeared meanwhile (another worker's copy won) or the copy failed."""
    tmp = target.with_name(f"{TMP_PREFIX}{target.name}-{uuid.uuid4().hex}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, tmp, symlinks=True)
        else:
            shutil.copy2(source, tmp)
        if target.exists():
            return False
        # For folders rename refuses an existing non-empty target; for files it would replace
        # one: either way each reader sees a whole entry.
        os.rename(tmp, target)
        return True
    except OSError as exc:
        if not target.exists():
            log.warning("Compile cache: could not copy %s to %s: %s", source, target, exc)
        return False
    finally:
        _remove(tmp)


def _remove_stale_copies(parent: Path) -> None:
    with _missing_ok():
        for child in os.scandir(parent):
            if child.name.startswith(TMP_PREFIX) and \
                    time.time() - child.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                _remove(Path(child.path))


def _remove(path: Path) -> None:
    """Best effort: what cannot be removed now is a stale copy for a later publisher."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _missing_ok() -> contextlib.suppress:
    """Ignores a folder that does not exist (yet)."""
    return contextlib.suppress(FileNotFoundError, NotADirectoryError)


@dataclass(frozen=True)
class EngineStart:
    """The compile cache around one engine start: ``begin`` before it, ``end`` once it is up."""

    local: Path
    entry_dirs: tuple[str, ...]
    volume: VolumeCache | None
    before: Snapshot

    @classmethod
    def begin(cls, local: Path, entry_dirs: tuple[str, ...], volume: Path | None) -> EngineStart:
        """Seeds the local cache root from ``volume`` (when given), then notes its entries."""
        shared = VolumeCache(volume, local, entry_dirs) if volume is not None else None
        if shared is not None:
            shared.seed()
        return cls(local, entry_dirs, shared, snapshot(local, entry_dirs))

    def end(self, compiles: bool) -> CacheState:
        """The start's cache state. Entries the volume lacks (this start's, or an earlier one's
        in a container that outlived it) are published in the background: a copy to a network
        volume may take a while, and jobs need not wait for it."""
        state = cache_state(self.before, snapshot(self.local, self.entry_dirs), compiles)
        if self.volume is not None:
            threading.Thread(target=self.volume.publish, name="compile-cache-publish", daemon=True).start()
        return state
