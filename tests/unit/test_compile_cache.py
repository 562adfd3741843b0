"""The compile cache's mirror on the network volume (src/worker/engine/compile_cache.py): seeding, atomic
publication, racing publishers, a publisher that died mid-copy, and the cold/warm state."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from worker.engine import compile_cache
from worker.engine.compile_cache import TMP_PREFIX, EngineStart, VolumeCache, cache_state, entries, snapshot

DIRS = ("torch_compile_cache", "torch_compile_cache/torch_aot_compile", "modelinfos")


def make_entry(root: Path, name: str, files: int = 3, size: int = 1000) -> None:
    """A folder entry of ``files`` files (or, for modelinfos, one file)."""
    if name.startswith("modelinfos/"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
        return
    for i in range(files):
        path = root / name / "rank_0_0" / f"part{i}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i % 256]) * size)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_entries_are_the_keyed_children_without_temporary_copies(tmp_path):
    make_entry(tmp_path, "torch_compile_cache/abc")
    make_entry(tmp_path, "torch_compile_cache/torch_aot_compile/def")
    make_entry(tmp_path, "modelinfos/llama.json")
    (tmp_path / "torch_compile_cache" / f"{TMP_PREFIX}abc-123").mkdir()
    (tmp_path / "assets").mkdir()  # not an entry folder
    assert entries(tmp_path, DIRS) == {"torch_compile_cache/abc", "torch_compile_cache/torch_aot_compile/def",
                                       "modelinfos/llama.json"}
    assert entries(tmp_path / "missing", DIRS) == frozenset()


def test_seed_copies_what_the_local_root_lacks_and_publish_what_the_volume_lacks(tmp_path):
    volume, local = tmp_path / "volume", tmp_path / "local"
    make_entry(volume, "torch_compile_cache/old")
    make_entry(volume, "modelinfos/a.json")
    cache = VolumeCache(volume, local, DIRS)
    assert cache.seed() == 2
    assert tree(local) == tree(volume)
    make_entry(local, "torch_compile_cache/new", files=5)
    assert cache.publish() == 1
    assert tree(volume) == tree(local)
    assert cache.publish() == 0 and cache.seed() == 0
    assert not list(volume.rglob(f"{TMP_PREFIX}*"))


def _publish(volume: str, local: str, start: multiprocessing.Event) -> None:
    start.wait()
    VolumeCache(Path(volume), Path(local), DIRS).publish()


def test_workers_publishing_the_same_entry_at_once_leave_one_whole_copy(tmp_path):
    """Eight processes publish their own copy of one entry at the same moment, while a reader
    watches the volume: it never sees a partial entry, and one copy wins whole."""
    volume = tmp_path / "volume"
    locals_ = []
    for i in range(8):
        local = tmp_path / f"local{i}"
        make_entry(local, "torch_compile_cache/same", files=20, size=50_000)
        (local / "torch_compile_cache" / "same" / "writer").write_text(str(i))
        locals_.append(local)
    start = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_publish, args=(str(volume), str(local), start))
             for local in locals_]
    for proc in procs:
        proc.start()
    start.set()
    entry = volume / "torch_compile_cache" / "same"
    while any(proc.is_alive() for proc in procs):
        if entry.exists():
            assert len(list(entry.rglob("part*"))) == 20  # whole, or not there at all
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0
    winner = int((entry / "writer").read_text())
    assert tree(volume / "torch_compile_cache") == tree(locals_[winner] / "torch_compile_cache")
    assert not list(volume.rglob(f"{TMP_PREFIX}*"))


def test_a_copy_left_by_a_worker_that_died_is_never_read_and_is_removed_when_stale(tmp_path):
    volume, local = tmp_path / "volume", tmp_path / "local"
    torn = volume / "torch_compile_cache" / f"{TMP_PREFIX}abc-1"
    make_entry(volume, f"torch_compile_cache/{TMP_PREFIX}abc-1")
    make_entry(volume, f"torch_compile_cache/{TMP_PREFIX}abc-2")
    old = time.time() - compile_cache.STALE_TMP_SECONDS - 10
    os.utime(torn, (old, old))
    cache = VolumeCache(volume, local, DIRS)
    assert cache.seed() == 0 and entries(local, DIRS) == frozenset()
    cache.publish()
    assert not torn.exists()  # stale: removed
    assert (volume / "torch_compile_cache" / f"{TMP_PREFIX}abc-2").exists()  # may still be copying


def test_a_failed_copy_is_logged_and_leaves_nothing_behind(tmp_path, caplog, monkeypatch):
    volume, local = tmp_path / "volume", tmp_path / "local"
    make_entry(local, "torch_compile_cache/abc")

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compile_cache.shutil, "copytree", full_disk)
    assert VolumeCache(volume, local, DIRS).publish() == 0
    assert "No space left on device" in caplog.text
    assert entries(volume, DIRS) == frozenset()
    assert not list(volume.rglob(f"{TMP_PREFIX}*"))


@pytest.mark.parametrize(("before", "after", "compiles", "state"), [
    ({}, {"a": {1}}, True, "cold (1 entries written)"),
    ({"a": {1}}, {"a": {1}}, True, "warm"),
    ({"a": {1}}, {"a": {2}, "b": {1}, "c": {1}}, True, "cold (3 entries written)"),  # a: written again
    ({}, {}, False, "off"),
    ({}, {}, True, "unused"),
])
def test_cache_state(before, after, compiles, state):
    assert str(cache_state(before, after, compiles)) == state


def test_an_entry_written_again_makes_the_start_cold(tmp_path):
    """vLLM compiles again and rewrites an entry it could not load (its CPU build does so)."""
    make_entry(tmp_path, "torch_compile_cache/abc")
    before = snapshot(tmp_path, DIRS)
    assert snapshot(tmp_path, DIRS) == before
    part = tmp_path / "torch_compile_cache" / "abc" / "rank_0_0" / "part0"
    part.write_bytes(b"recompiled")
    assert str(cache_state(before, snapshot(tmp_path, DIRS), compiles=True)) == "cold (1 entries written)"


def test_an_engine_start_seeds_before_and_publishes_after(tmp_path):
    volume, local = tmp_path / "volume", tmp_path / "local"
    make_entry(volume, "torch_compile_cache/old")
    start = EngineStart.begin(local, DIRS, volume)
    assert entries(local, DIRS) == {"torch_compile_cache/old"}
    make_entry(local, "torch_compile_cache/new")  # what the engine compiled
    assert str(start.end(compiles=True)) == "cold (1 entries written)"
    deadline = time.monotonic() + 30
    while entries(volume, DIRS) != {"torch_compile_cache/old", "torch_compile_cache/new"}:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    warm = EngineStart.begin(tmp_path / "fresh", DIRS, volume)
    assert str(warm.end(compiles=True)) == "warm"
    assert str(EngineStart.begin(tmp_path / "alone", DIRS, None).end(compiles=True)) == "unused"


def test_a_volume_that_cannot_be_written_is_logged_and_the_start_goes_on(tmp_path, caplog):
    volume, local = tmp_path / "volume", tmp_path / "local"
    volume.write_text("a file where the folder should be")
    make_entry(local, "torch_compile_cache/abc")
    assert VolumeCache(volume, local, DIRS).publish() == 0
    assert "could not copy" in caplog.text


@pytest.mark.parametrize(("value", "own"), [
    (None, False),
    ("{tmp}/torchinductor_{user}", False),  # torch's default, set when vLLM is imported
    ("/other/tmp/torchinductor_{user}", False),  # a parent's default, under its own TMPDIR
    ("/volume/inductor", True),
])
def test_only_a_chosen_inductor_cache_dir_is_the_users_own(value, own, monkeypatch):
    import getpass
    import tempfile

    from worker.vllm_adapter import engine_env

    if value is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR",
                           value.format(tmp=tempfile.gettempdir(), user=getpass.getuser()))
    assert engine_env._users_own("TORCHINDUCTOR_CACHE_DIR") is own


def test_what_the_worker_set_itself_is_not_the_users_own(monkeypatch):
    from worker.vllm_adapter import engine_env

    monkeypatch.setitem(engine_env._SET_HERE, "VLLM_USE_AOT_COMPILE", "0")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    assert not engine_env._users_own("VLLM_USE_AOT_COMPILE")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert engine_env._users_own("VLLM_USE_AOT_COMPILE")


def test_torchs_precompiled_headers_are_kept_in_the_entry(tmp_path, monkeypatch):
    """Torch puts them under the temp dir whatever TORCHINDUCTOR_CACHE_DIR says: a link there
    makes them part of the entry, re-pointed for another configuration's entry."""
    import torch._inductor.codecache

    from worker.vllm_adapter import engine_env

    headers = tmp_path / "tmp" / "torchinductor_me" / "precompiled_headers"
    monkeypatch.setattr(torch._inductor.codecache, "_HEADER_DIR", str(headers))
    for entry in (tmp_path / "cache" / "inductor-a", tmp_path / "cache" / "inductor-b"):
        engine_env._keep_precompiled_headers(entry)
        assert headers.is_symlink() and headers.resolve() == (entry / "precompiled_headers").resolve()
        (headers / "h.gch").write_text("x")
        assert (entry / "precompiled_headers" / "h.gch").read_text() == "x"
    assert sorted(p.name for p in headers.parent.iterdir()) == ["precompiled_headers"]  # no link left over

    headers.unlink()
    headers.mkdir()  # a disk with its own headers keeps them
    engine_env._keep_precompiled_headers(tmp_path / "cache" / "inductor-c")
    assert not headers.is_symlink() and not (tmp_path / "cache" / "inductor-c").exists()


def test_lock_files_are_not_an_entrys_content(tmp_path):
    entry = tmp_path / "torch_compile_cache" / "inductor-a"
    (entry / "locks").mkdir(parents=True)
    (entry / "kernel.so").write_text("k")
    before = snapshot(tmp_path, ["torch_compile_cache"])
    (entry / "locks" / "k.lock").write_text("")  # a warm start takes a lock
    assert cache_state(before, snapshot(tmp_path, ["torch_compile_cache"]), True).state == "warm"
