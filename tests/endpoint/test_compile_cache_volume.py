"""vLLM's compile cache on the network volume (src/worker/engine/compile_cache.py), on the real engine with
torch.compile on: two workers, each on a container disk of its own, start at the same moment on one
empty volume; both serve, and the volume then holds each entry once and whole. A third worker, on a
fresh disk, starts from what they published and answers the same."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from local_endpoint import LocalEndpoint

from worker.engine.compile_cache import TMP_PREFIX, entries
from worker.config.worker_config import VOLUME_CACHE_DIR
from worker.vllm_adapter.engine_env import CACHE_ENTRY_DIRS

COMPILE_ON = {"ENFORCE_EAGER": "false", "TORCH_COMPILE_DISABLE": "0"}
JOB = {"input": {"prompt": "The lighthouse keeper", "sampling_params": {"temperature": 0, "max_tokens": 8}}}
PUBLISHED = re.compile(r"Compile cache: (\d+) new entries published")


def start(models, volume, disk, log) -> LocalEndpoint:
    """A worker on its own container disk: its cache root and temp dir (torch's headers) are there."""
    (disk / "tmp").mkdir(parents=True, exist_ok=True)
    env = {"MODEL_NAME": str(models["tiny-llama"]), "BASE_PATH": str(volume), "XDG_CACHE_HOME": str(disk),
           "TMPDIR": str(disk / "tmp"), "MAX_CONCURRENCY": "4", **COMPILE_ON}
    return LocalEndpoint(env, 1, log, ready_timeout=900)


def answer(endpoint: LocalEndpoint) -> str:
    result = endpoint.http.post("/runsync", json=JOB).json()
    assert result["status"] == "COMPLETED", result
    return "".join(result["output"][0]["choices"][0]["tokens"])


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def wait_published(endpoints: list[LocalEndpoint], shared, local: list) -> int:
    """Entries the workers published (their logs' count), once the volume holds every entry of
    their cache roots, whole (no copy in progress). The volume is the proof: a worker's publication
    line has at times not reached its log on one machine, its entries on the volume all the same."""
    deadline = time.monotonic() + 120
    wanted = set().union(*(entries(root, CACHE_ENTRY_DIRS) for root in local))
    while not (wanted <= entries(shared, CACHE_ENTRY_DIRS) and not list(shared.rglob(f"{TMP_PREFIX}*"))):
        assert time.monotonic() < deadline, "the workers never published their compile cache:\n" + "\n".join(
            e.log()[-3000:] for e in endpoints)
        time.sleep(0.5)
    time.sleep(1)  # a publication line still to come
    return sum(int(found[1]) for e in endpoints if (found := PUBLISHED.search(e.log())))


@pytest.mark.timeout(1800)
def test_two_workers_starting_at_once_share_one_volume_cache_and_a_third_starts_from_it(models, tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    disks = [tmp_path / f"disk{i}" for i in range(3)]
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(start, models, volume, disks[i], tmp_path / f"worker{i}.log") for i in range(2)]
        first = [future.result() for future in starting]
    shared, local = volume / VOLUME_CACHE_DIR, [disk / "vllm" for disk in disks[:2]]
    try:
        answers = {answer(endpoint) for endpoint in first}
        assert len(answers) == 1 and answers != {""}
        published = wait_published(first, shared, local)
    finally:
        for endpoint in first:
            endpoint.stop()
    on_volume = entries(shared, CACHE_ENTRY_DIRS)
    # On the CPU, Inductor's compiled kernels are an entry of their own (vllm_adapter/engine_env._cpu_compile_cache).
    inductor = [name for name in on_volume if name.startswith("torch_compile_cache/inductor-")]
    assert inductor, on_volume
    # with torch's precompiled C++ headers, which it keeps under the temp dir (linked into the entry)
    assert list((shared / inductor[0] / "precompiled_headers").glob("*.gch"))
    assert published <= len(on_volume)  # each entry published once at most: the other copy lost the race
    assert not [p for p in shared.rglob(f"{TMP_PREFIX}*")]
    for name in on_volume:  # whole: the same files, byte for byte, as one worker's own entry
        copies = [tree(root / name) if (root / name).is_dir() else (root / name).read_bytes()
                  for root in local if (root / name).exists()]
        theirs = tree(shared / name) if (shared / name).is_dir() else (shared / name).read_bytes()
        assert theirs in copies, name

    third = start(models, volume, disks[2], tmp_path / "worker2.log")
    try:
        assert answer(third) in answers
        log = third.log()
    finally:
        third.stop()
    assert f"Compile cache: {len(on_volume)} entries copied from {shared}" in log
    assert re.search(r"Worker ready: .*; compile cache (warm|cold \(\d+ entries written\))$", log, re.MULTILINE)
    assert "Compiling model again due to a load failure" not in log  # vLLM's CPU AOT entry is not used
