"""Models that are not baked, downloaded at start into the Hugging Face cache that the endpoint's
workers share (on RunPod, the network volume), from the local hub (SmolLM2's files, no weights from
the internet), by real workers under the local endpoint:

1. two workers starting together: the first downloads (progress in the log), the second waits for it
   and uses it; each file is sent once; the pinned MODEL_REVISION is what both serve;
2. a worker killed half-way through the weights: the endpoint restarts it, and it resumes the file
   where the killed one stopped (a Range request), then serves;
3. offline (HF_HUB_OFFLINE=1, the hub gone), the warm cache alone starts a worker;
4. RunPod's model cache: the model only in a read-only Hugging Face cache at ``$HF_HOME/hub`` (a
   read-only bind mount), served by its repo id with the hub reachable and not, with no download and
   nothing written there; a revision it does not hold is answered as a start-up failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
from conftest import SMOLLM2_DTYPE, wait_for
from hub_cache import add_cached_repo
from local_endpoint import LocalEndpoint, worker_pids
from test_startup_failures import answered
from tests.image.local_hub import LocalHub

MIB = 2**20
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_files(models):
    return {p.name: p for p in models["smollm2-135m-instruct"].iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(smol_files):
    """org/smol: v1 (a tag, the one pinned) and a later main with another README."""
    with LocalHub() as hub:
        hub.v1 = hub.add_repo("org/smol", {**smol_files, "README.md": b"v1"}, revision="release", tags=["v1"])
        hub.main = hub.add_repo("org/smol", {**smol_files, "README.md": b"v2"})
        yield hub


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """The network volume the workers share."""
    return tmp_path_factory.mktemp("volume")


def worker_env(hub_url: str, volume, **env: str) -> dict[str, str]:
    return {"MODEL_NAME": "org/smol", "MODEL_REVISION": "v1", "DTYPE": SMOLLM2_DTYPE,
            "HF_ENDPOINT": hub_url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
            "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(volume / "huggingface-cache"), "HF_TOKEN": "",
            "BASE_PATH": str(volume), "VLLM_CONFIG_FILE": "/nonexistent/vllm_config.yaml",
            "LOCAL_MODEL_ARGS_FILE": "/nonexistent/local_model_args.json", **env}


def serves_v1(endpoint: LocalEndpoint, hub: LocalHub) -> None:
    """The repo id is the served name and its root (no folder of the server's); the snapshot served
    is v1's commit; it answers."""
    card = endpoint.http.get("/openai/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == "org/smol"
    assert re.findall(r"Model org/smol: .*?commit (\w+)", endpoint.log())[-1] == hub.v1
    answer = endpoint.openai_client().chat.completions.create(model="org/smol", messages=CHAT,
                                                               temperature=0, max_tokens=20)
    assert "Paris" in answer.choices[0].message.content


def sent(hub: LocalHub, path: str, since: int = 0) -> list:
    """The hub's downloads of ``path``, from its ``since``-th download on."""
    return [d for d in hub.downloads[since:] if d.path == path]


def test_two_workers_starting_together_download_each_file_once(hub, volume, smol_files, tmp_path):
    hub.bytes_per_second = 40 * MIB  # ~7 s for the weights: the second worker starts meanwhile
    endpoint = LocalEndpoint(worker_env(hub.url, volume), 2, tmp_path / "endpoint.log")
    try:
        log = endpoint.log()
        assert log.count("Model org/smol: downloading") == 2  # both planned it ...
        for name in ("model.safetensors", "config.json", "tokenizer.json"):  # ... each file went once
            (download,) = sent(hub, name)
            assert (download.start, download.complete, download.revision) == (0, True, hub.v1)
        assert sent(hub, "model.safetensors")[0].sent == smol_files["model.safetensors"].stat().st_size
        assert "Model org/smol: 0." in log and " GB (" in log  # progress lines while it downloads
        assert log.count(f"Model org/smol: ready at commit {hub.v1}") == 2
        serves_v1(endpoint, hub)
    finally:
        hub.bytes_per_second = None
        endpoint.stop()


def test_a_download_killed_half_way_resumes_on_the_next_start(hub, smol_files, tmp_path):
    volume = tmp_path / "fresh-volume"
    size = smol_files["model.safetensors"].stat().st_size
    hub.bytes_per_second = 30 * MIB
    before = len(hub.downloads)
    endpoint = LocalEndpoint(worker_env(hub.url, volume), 1, tmp_path / "endpoint.log", ready_timeout=None)
    try:
        # huggingface_hub writes up to 10 MiB at a time: past 30 MiB sent, some are on disk.
        wait_for(lambda: any(d.sent > 30 * MIB for d in sent(hub, "model.safetensors", since=before)), 120)
        os.kill(worker_pids(endpoint)["local-worker-0"], signal.SIGKILL)
        hub.bytes_per_second = None
        wait_for(lambda: "worker(s) ready" in endpoint.log(), 400)
        first, resumed = sent(hub, "model.safetensors", since=before)
        assert first.start == 0 and not first.complete
        assert 0 < resumed.start <= first.sent  # from what the killed worker had written
        assert resumed.start + resumed.sent == size and resumed.complete
        log = endpoint.log()
        assert "local-worker-0 exited with status -9" in log
        assert f"Model org/smol: resuming model.safetensors at {resumed.start / 1e9:.2f} of {size / 1e9:.2f} GB" in log
        serves_v1(endpoint, hub)
    finally:
        hub.bytes_per_second = None
        endpoint.stop()


def test_offline_a_warm_cache_starts_a_worker_without_the_hub(hub, volume, tmp_path):
    requests = len(hub.requests)
    env = worker_env("http://127.0.0.1:9", volume, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log")
    try:
        assert "Model org/smol: from the Hugging Face cache (HF_HUB_OFFLINE is set)" in endpoint.log()
        serves_v1(endpoint, hub)
        assert len(hub.requests) == requests
    finally:
        endpoint.stop()


@pytest.fixture(scope="module")
def model_cache(smol_files, tmp_path_factory):
    """RunPod's model cache: HF_HOME whose ``hub`` holds org/smol (``refs/main``), mounted read-only."""
    home = tmp_path_factory.mktemp("model-cache") / "huggingface-cache"
    snapshot = add_cached_repo(home / "hub", "org/smol", smol_files)
    hub_dir = str(home / "hub")
    mounted = subprocess.run(["mount", "--bind", hub_dir, hub_dir], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot bind-mount here (needs root): {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", hub_dir], check=True)
        yield home, snapshot
    finally:
        subprocess.run(["umount", "-l", hub_dir], check=True)


def tree(folder) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.mark.parametrize("hub_reachable", [True, False], ids=["hub reachable", "hub unreachable"])
def test_runpods_model_cache_serves_the_repo_id_with_no_download_and_no_write(
        hub, model_cache, tmp_path, hub_reachable):
    home, snapshot = model_cache
    before, requests, downloads = tree(home / "hub"), len(hub.requests), len(hub.downloads)
    env = worker_env(hub.url if hub_reachable else "http://127.0.0.1:9", tmp_path / "volume",
                     MODEL_REVISION="", HF_HOME=str(home))
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log")
    try:
        assert (f"Model org/smol: from RunPod's model cache (the cache is read-only), commit {snapshot.name}, "
                "no download") in endpoint.log()
        card = endpoint.http.get("/openai/v1/models").json()["data"][0]
        assert card["id"] == card["root"] == "org/smol" and str(snapshot) not in json.dumps(card)
        answer = endpoint.openai_client().chat.completions.create(model="org/smol", messages=CHAT,
                                                                   temperature=0, max_tokens=20)
        assert "Paris" in answer.choices[0].message.content
        assert (len(hub.requests), len(hub.downloads)) == (requests, downloads)  # the hub was not asked
        assert tree(home / "hub") == before
    finally:
        endpoint.stop()


def test_a_revision_runpods_model_cache_does_not_hold_is_a_start_up_failure_saying_why(hub, model_cache, tmp_path):
    home, snapshot = model_cache
    downloads = len(hub.downloads)
    endpoint = LocalEndpoint(worker_env(hub.url, tmp_path / "volume", HF_HOME=str(home)), 1,
                             tmp_path / "endpoint.log")
    try:
        message = answered(endpoint, "MODEL_NAME='org/smol' (revision v1, MODEL_REVISION) is not in the "
                                     f"Hugging Face cache (HF_HOME; it holds main, {snapshot.name}), "
                                     "which is read-only (RunPod's model cache)")
        assert "set MODEL_NAME and MODEL_REVISION to the model the endpoint caches" in message
        assert f"[the cache: {home / 'hub'}]" in endpoint.log()  # its path: the log's
        assert len(hub.downloads) == downloads
    finally:
        endpoint.stop()
