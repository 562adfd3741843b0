"""Item 23: a start from RunPod's model cache beside one from a copy on the network volume.

The same model (``Plan.latency_model``'s files, as the hub repo ``org/cached``) served by its repo id,
the two sides started in turn (ABBA…):

- model cache: the model only in a read-only Hugging Face cache (a read-only bind mount, as RunPod
  mounts its cache), the hub out of reach: the worker serves the cached snapshot without asking it;
- network volume: a writable Hugging Face cache that a first start (not measured) downloaded the
  model into from the local hub, which each start asks again (the repo's files, then
  ``snapshot_download`` checking the cache), as a worker on a network volume does.

Each side's figures: the worker's ``model`` phase (the hub check and fetch, before vLLM is imported)
and the process's start to its first call for work. Needs root (``mount``).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import MODELS_ROOT, Plan, Results, ab, model_env
from bench.servers import Endpoint
from tests.hub_cache import add_cached_repo
from tests.image.local_hub import LocalHub

REPO_ID = "org/cached"
ITEM = "23 model cache"


@contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """``folder`` bind-mounted read-only onto itself."""
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def _env(model: str, plan: Plan, home: Path, hub_url: str) -> dict[str, str]:
    return {**model_env(model, plan), "MODEL_NAME": REPO_ID, "HF_HOME": str(home), "HF_ENDPOINT": hub_url,
            "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": ""}


def _start(env: dict[str, str], log: Path) -> Endpoint:
    endpoint = Endpoint(env, log)
    endpoint.stop()
    if "no download" not in endpoint.log() and "ready at commit" not in endpoint.log():
        raise RuntimeError(f"the worker fetched no model ({log})")
    return endpoint


def run(plan: Plan, results: Results) -> None:
    model, work = plan.latency_model, Path(tempfile.mkdtemp(prefix="bench-model-cache-"))
    files = {p.name: p for p in (MODELS_ROOT / model).iterdir() if p.is_file()}
    cache_home, volume_home = work / "model-cache", work / "volume" / "huggingface-cache"
    add_cached_repo(cache_home / "hub", REPO_ID, files)
    with LocalHub() as hub, _read_only(cache_home / "hub"):
        hub.add_repo(REPO_ID, files)
        _start(_env(model, plan, volume_home, hub.url), work / "download.log")  # fills the volume
        for rep in range(plan.reps):
            cached, volume = ab(rep, lambda: _start(_env(model, plan, cache_home, "http://127.0.0.1:9"),
                                                    work / f"cache-{rep}.log"),
                                lambda: _start(_env(model, plan, volume_home, hub.url), work / f"volume-{rep}.log"))
            for side, endpoint in (("model cache", cached), ("network volume", volume)):
                results.figure(ITEM, model, f"model phase, {side}", "s").values.append(
                    endpoint.start_up.phases["model"])
                results.figure(ITEM, model, f"process start → taking jobs, {side}", "s").values.append(
                    endpoint.start_up.total)
            results.figure(ITEM, model, "start-up model cache ÷ network volume").values.append(
                cached.start_up.total / volume.start_up.total)
