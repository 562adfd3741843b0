"""model/lora_adapters: finding an adapter by name (folders in order, then the local hub) and the
checks made before vLLM loads it. Adapters here are folders with a config (no weights: no engine)."""

from __future__ import annotations

import json
import subprocess
from http import HTTPStatus
from pathlib import Path

import pytest

from worker.model import hub_adapters
from worker.model.hub_adapters import HubAdapters, hub_rules
from worker.model.lora_adapters import AdapterError, AdapterSources

SERVED = frozenset({"/models/tiny", "test/tiny"})


def adapter(folder: Path, name: str, **config) -> Path:
    path = folder / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, **config}))
    return path


def sources(*folders: Path, hub: str = "", check: bool = True, max_adapters: int = 32,
            max_bytes: int = 1 << 30) -> AdapterSources:
    """Adapters in ``folders``, and from the hub's repos that ``hub`` allows (LORA_HUB_REPOS)."""
    fetched = HubAdapters(hub_rules(hub), max_adapters, max_bytes) if hub else None
    return AdapterSources(tuple((folder, f"folder{i}") for i, folder in enumerate(folders)), fetched,
                          max_rank=16, served_names=SERVED, check_base_model=check)


def test_the_first_folder_with_the_name_wins(tmp_path):
    first, second = tmp_path / "volume", tmp_path / "image"
    adapter(second, "a")
    adapter(second, "b")
    path = adapter(first, "a")
    found = sources(first, second)
    assert (found.find("a").path, found.find("a").source) == (path, "folder0")
    assert found.find("b").source == "folder1"
    assert found.find("c") is None


@pytest.mark.parametrize("name", ["../a", "a/../../b", "/etc", "a/b/c/d", ".hidden", "", "a//b"])
def test_names_that_would_leave_the_folders_are_not_found(tmp_path, name):
    adapter(tmp_path / "volume", "a")
    assert sources(tmp_path / "volume" / "x").find(name) is None


def test_names_with_folders_and_the_listing(tmp_path):
    folder = tmp_path / "volume"
    for name in ("z", "org/repo", "org/repo2/sub"):
        adapter(folder, name)
    (folder / "not-an-adapter").mkdir()
    adapter(folder, "a/b/c/too-deep")
    found = sources(folder, tmp_path / "missing")
    assert found.find("org/repo2/sub").path == folder / "org/repo2/sub"
    assert [a.name for a in found.available()] == ["org/repo", "org/repo2/sub", "z"]


@pytest.mark.parametrize(("config", "reason"), [
    ({"r": 64}, "has rank 64, above MAX_LORA_RANK=16: set MAX_LORA_RANK=64"),
    ({"r": 17}, "MAX_LORA_RANK=32"),
    ({"peft_type": "IA3"}, "is a IA3 adapter: only LoRA adapters are served"),
    ({"base_model_name_or_path": "other/model"},
     "was trained for base model 'other/model', not the served 'test/tiny'"),
])
def test_what_cannot_be_served_is_a_400_that_says_why(tmp_path, config, reason):
    adapter(tmp_path, "a", **config)
    with pytest.raises(AdapterError) as raised:
        sources(tmp_path).find("a")
    assert raised.value.status == HTTPStatus.BAD_REQUEST and raised.value.param == "model"
    assert str(raised.value).startswith("LoRA adapter 'a' ") and reason in str(raised.value)


def test_an_unreadable_config_is_a_400(tmp_path):
    adapter(tmp_path, "a")
    (tmp_path / "a" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="unreadable adapter_config.json"):
        sources(tmp_path).find("a")


@pytest.mark.parametrize("base", ["test/tiny", "TEST/Tiny/", "/models/tiny", "/home/me/llama", None])
def test_a_base_model_that_is_served_or_unknown_passes(tmp_path, base):
    adapter(tmp_path, "a", base_model_name_or_path=base)
    assert sources(tmp_path).find("a").name == "a"


def test_the_base_model_check_can_be_turned_off(tmp_path):
    adapter(tmp_path, "a", base_model_name_or_path="other/model")
    assert sources(tmp_path, check=False).find("a").name == "a"


def test_no_check_by_name_when_the_served_model_has_no_repo_id(tmp_path):
    adapter(tmp_path, "a", base_model_name_or_path="other/model")
    local_only = AdapterSources(((tmp_path, "volume"),), None, 16, frozenset({"/models/tiny"}))
    assert local_only.find("a").name == "a"


# --- the hub (the local hub of tests/image/local_hub.py) ------------------------------------------

ADAPTER_FILES = {"adapter_config.json": json.dumps({"peft_type": "LORA", "r": 8}).encode(),
                 "adapter_model.safetensors": b"weights"}


def test_hub_adapters_of_allowed_repos_only_their_files(online, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    hub.add_repo("org/one", {**ADAPTER_FILES, "big.bin": b"x" * 1000})
    hub.add_repo("org/many", {f"sub/{name}": body for name, body in ADAPTER_FILES.items()})
    hub.add_repo("other/repo", ADAPTER_FILES)
    found = sources(tmp_path / "volume", hub="org/*")
    one = found.find("org/one")
    assert one.source == "hub" and sorted(p.name for p in one.path.iterdir()) == sorted(ADAPTER_FILES)
    assert found.find("org/many/sub").path.name == "sub"
    assert found.find("org/many") is None  # no adapter at the repo's root
    assert found.find("org/missing") is None
    downloads = len(hub.downloads)
    assert found.find("other/repo") is None and len(hub.downloads) == downloads  # not asked


def test_a_local_folder_is_asked_before_the_hub(online, hub, tmp_path):
    hub.add_repo("org/one", ADAPTER_FILES)
    path = adapter(tmp_path / "volume", "org/one")
    assert sources(tmp_path / "volume", hub="*").find("org/one").path == path
    assert not hub.downloads


def test_a_hub_out_of_reach_is_a_502_and_offline_only_the_cache_is_asked(online, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    found = sources(tmp_path / "volume", hub="org/*")
    with pytest.raises(AdapterError, match="could not be fetched from the hub") as raised:
        found.find("org/one")
    assert raised.value.status == HTTPStatus.BAD_GATEWAY
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert found.find("org/one") is None


@pytest.fixture
def read_only_cache(tmp_path):
    """An empty Hugging Face hub cache, mounted read-only (as RunPod's model cache is)."""
    cache = tmp_path / "read-only-cache"
    cache.mkdir()
    if subprocess.run(["mount", "--bind", cache, cache], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", cache], check=True)
        yield cache
    finally:
        subprocess.run(["umount", "-l", cache], check=True)


def test_a_hub_adapter_a_read_only_cache_cannot_take_is_a_507_that_says_so(online, hub, tmp_path, monkeypatch,
                                                                           read_only_cache):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(read_only_cache))
    hub.add_repo("org/one", ADAPTER_FILES)
    with pytest.raises(AdapterError, match=r"the Hugging Face cache \(HF_HOME\) is read-only here") as raised:
        sources(tmp_path / "volume", hub="org/*").find("org/one")
    assert raised.value.status == HTTPStatus.INSUFFICIENT_STORAGE and "could not be asked" not in str(raised.value)


def hub_requests(hub) -> list[str]:
    return [path for _, path, _ in hub.requests if "agent-harnesses" not in path]


def test_a_hub_adapter_in_any_case_is_one_download_under_the_hubs_spelling(online, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    hub.add_repo("Org/Mixed-Case", {f"Sub/{name}": body for name, body in ADAPTER_FILES.items()})
    found = sources(tmp_path / "volume", hub="org/*")
    first = found.find("org/mixed-case/Sub")
    assert (first.name, first.source) == ("Org/Mixed-Case/Sub", "hub")
    asked = len(hub_requests(hub))
    for spelling in ("ORG/MIXED-CASE/Sub", "Org/Mixed-Case/Sub"):
        assert found.find(spelling) == first  # no other download, no hub call
    assert len(hub_requests(hub)) == asked and len(hub.downloads) == len(ADAPTER_FILES)
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("models--")] == \
        ["models--Org--Mixed-Case"]
    assert found.find("org/mixed-case/sub") is None  # a folder's name keeps its case, as on the hub


def test_caps_on_hub_adapters_and_bytes_refuse_before_downloading(online, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    size = sum(map(len, ADAPTER_FILES.values()))
    for name in ("one", "two", "three"):
        hub.add_repo(f"org/{name}", ADAPTER_FILES)
    hub.add_repo("org/big", {**ADAPTER_FILES, "adapter_model.safetensors": b"w" * 5000})
    found = sources(tmp_path / "volume", hub="org/*", max_adapters=2, max_bytes=2 * size + 100)
    assert found.find("org/one") and found.find("org/two") and found.find("ORG/ONE")  # counted once
    with pytest.raises(AdapterError) as raised:
        found.find("org/three")
    assert raised.value.status == HTTPStatus.BAD_REQUEST and raised.value.param == "model"
    assert "past LORA_HUB_MAX_ADAPTERS=2" in str(raised.value)
    bytes_only = sources(tmp_path / "volume", hub="org/*", max_bytes=size + 100)
    downloads = len(hub.downloads)
    with pytest.raises(AdapterError, match=r"has 5,\d+ bytes of files: .*past LORA_HUB_MAX_BYTES=") as raised:
        bytes_only.find("org/big")
    assert raised.value.status == HTTPStatus.BAD_REQUEST and len(hub.downloads) == downloads  # none
    assert bytes_only.find("org/three").name == "org/three"  # the refusal counted nothing


def test_a_miss_is_remembered_for_a_while(online, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    found = sources(tmp_path / "volume", hub="org/*")
    assert found.find("org/later") is None
    asked = len(hub_requests(hub))
    hub.add_repo("org/later", ADAPTER_FILES)
    assert found.find("org/later") is None and found.find("ORG/Later") is None
    assert len(hub_requests(hub)) == asked  # no hub call
    monkeypatch.setattr(hub_adapters, "MISS_SECONDS", 0.0)
    monkeypatch.setattr(found.hub, "_misses", {})  # forgotten, as after MISS_SECONDS
    assert found.find("org/later").name == "org/later"


def test_a_pattern_pins_a_revision(online, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    pinned = hub.add_repo("org/pinned", {**ADAPTER_FILES, "adapter_config.json": b'{"r": 4}'}, tags=["v1"])
    hub.add_repo("org/pinned", ADAPTER_FILES)  # main moves on
    found = sources(tmp_path / "volume", hub="org/pinned@v1, acme/*")
    path = found.find("org/pinned").path
    assert (path / "adapter_config.json").read_bytes() == b'{"r": 4}' and pinned in str(path)
    assert hub_rules("org/pinned@v1, acme/*") == (hub_adapters.HubRule("org/pinned", "v1"),
                                                  hub_adapters.HubRule("acme/*"))


def test_offline_a_cached_adapter_is_found_in_any_case(online, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    hub.add_repo("Org/Cached", ADAPTER_FILES)
    assert sources(tmp_path / "volume", hub="org/*").find("Org/Cached")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    offline = sources(tmp_path / "volume", hub="org/*")
    assert offline.find("org/cached").name == "Org/Cached" and offline.find("org/other") is None
