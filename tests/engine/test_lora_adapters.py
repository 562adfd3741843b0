"""LoRA adapters by name on the real engine (tiny model, float32): found in the folders on first
use, batched together, evicted and loaded again, and every way one can fail, on both route
families and raw jobs. The same weights loaded through LORA_MODULES are the reference."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import pytest
from build_models import build_lora
from conftest import _build_engine, engine_env
from openai.types import Completion

from worker.model.hub_adapters import HubAdapters, hub_rules
from worker.routes.serving import OpenAIvLLMEngine

SERVED = "test/tiny-llama"  # a repo id, so that an adapter for another repo is told apart by name
PROMPT = "Once upon a time"
BATCHED = ("a", "b", "c")  # also loaded statically, as static-a, static-b, static-c
EVICTED = ("e1", "e2", "e3", "e4", "e5")  # more than MAX_CPU_LORAS=4


@pytest.fixture(scope="module")
def folders(models, tmp_path_factory):
    """The volume's adapters (each its own random weights) and a second folder."""
    root = tmp_path_factory.mktemp("adapters")
    volume, second = root / "volume", root / "second"
    for seed, name in enumerate((*BATCHED, *EVICTED, "org/in-folder"), start=1):
        build_lora(models["tiny-llama"], volume / name, seed=seed)
    build_lora(models["tiny-llama"], second / "only-second", seed=20)
    build_lora(models["tiny-llama"], volume / "once", seed=23)
    build_lora(models["tiny-llama"], volume / "rank-32", seed=21, rank=32)
    build_lora(models["smollm2-135m-instruct"], volume / "for-smollm2", seed=22)
    shutil.copytree(volume / "a", volume / "other-base")
    config = json.loads((volume / "a" / "adapter_config.json").read_text())
    (volume / "other-base" / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "test/another-model"}))
    shutil.copytree(volume / "a", volume / "damaged")
    (volume / "damaged" / "adapter_model.safetensors").write_bytes(b"not safetensors" * 10)
    return volume, second


@pytest.fixture(scope="module")
def engine(models, folders):
    volume, second = folders
    static = [{"name": f"static-{name}", "path": str(volume / name)} for name in BATCHED]
    built = _build_engine(engine_env(
        models["tiny-llama"], DTYPE="float32", SERVED_MODEL_NAME=SERVED, ENABLE_LORA="true",
        MAX_LORAS="3", MAX_CPU_LORAS="4", MAX_LORA_RANK="16", LORA_DIRS=f"{volume}:{second}",
        LORA_MODULES=json.dumps(static)))
    yield built
    built.shutdown()


@pytest.fixture(scope="module")
def openai(engine):
    return OpenAIvLLMEngine(engine)


def complete(run_openai, openai, model: str, max_tokens: int = 10):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    (item,) = run_openai(openai, "/v1/completions", body)
    return item


def text(item) -> str:
    return Completion.model_validate(item).choices[0].text


def run_together(openai, models: list[str], monkeypatch) -> list[str]:
    """One completion per model through the handler, all sent at once (in vLLM's batches together)."""
    import handler

    monkeypatch.setattr(handler, "openai_engine", openai)

    async def one(model):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        items = [item async for item in handler.handler({"id": model, "input": {
            "openai_route": "/v1/completions", "openai_input": body}})]
        return text(items[0])

    async def all_of():
        return await asyncio.gather(*map(one, models))

    return asyncio.run(all_of())


def test_three_adapters_in_one_batch_match_the_same_adapters_loaded_statically(openai, run_openai,
                                                                              monkeypatch):
    """Without the served model in the batch: on the CPU, vLLM 0.32 applies the last adapter slot to a
    base-model request batched beside adapters (vllm-project/vllm#48421; its GPU kernels skip them)."""
    names = [*BATCHED, *(f"static-{name}" for name in BATCHED)]
    by_name = dict(zip(names, run_together(openai, names, monkeypatch), strict=True))
    for name in BATCHED:
        assert by_name[name] == by_name[f"static-{name}"]
    base = text(complete(run_openai, openai, SERVED))
    assert len({base, *(by_name[name] for name in BATCHED)}) == 4  # each adapter changes the output


def test_raw_jobs_name_an_adapter_in_model(engine, openai, run_job):
    def raw(model):
        (item,) = run_job(engine, {"prompt": PROMPT, "model": model,
                                   "sampling_params": {"max_tokens": 10, "temperature": 0, "ignore_eos": True}})
        return "".join(item["choices"][0]["tokens"])

    assert raw("b") == raw("static-b") != raw(SERVED) == raw(None)
    assert raw("b") == text(complete(run_openai_of(run_job), openai, "b"))


def run_openai_of(run_job):
    return lambda engine, route, body: run_job(engine, {"openai_route": route, "openai_input": body})


def test_adapters_in_the_second_folder_and_in_sub_folders(openai, run_openai):
    assert text(complete(run_openai, openai, "only-second")) != text(complete(run_openai, openai, SERVED))
    assert text(complete(run_openai, openai, "org/in-folder"))


def test_eviction_past_max_cpu_loras_and_loading_again(engine, openai, run_openai, folders):
    first = {name: text(complete(run_openai, openai, name)) for name in EVICTED}
    held = engine.loop.run(engine.llm.list_loras())
    assert engine.adapters.loaded["e1"].lora_int_id not in held and len(held) == 4
    assert engine.adapters.loaded["e5"].lora_int_id in held
    assert text(complete(run_openai, openai, "e1")) == first["e1"]  # loaded again, the same weights
    assert engine.adapters.loaded["e1"].lora_int_id in engine.loop.run(engine.llm.list_loras())


def test_an_evicted_adapter_whose_files_went_fails_alone(engine, openai, run_openai, folders):
    volume, _ = folders
    for name in EVICTED[1:]:  # e1 is evicted again
        complete(run_openai, openai, name)
    gone = volume.parent / "gone-e1"
    shutil.move(volume / "e1", gone)
    try:
        (item,) = run_openai(openai, "/v1/completions", {"model": "e1", "prompt": PROMPT, "max_tokens": 3})
        assert item["error"]["code"] == 400 and "'e1' could not be loaded again" in item["error"]["message"]
        assert str(volume.parent) not in item["error"]["message"]  # the log has the folder, not the answer
    finally:
        shutil.move(gone, volume / "e1")
    assert text(complete(run_openai, openai, "e2"))  # the engine serves on


def test_an_unknown_adapter_gets_vllm_serves_404(openai, run_openai):
    (item,) = run_openai(openai, "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 3})
    assert item["error"] == {"message": f"The model `nope` does not exist. Valid aliases: {SERVED}.",
                             "type": "NotFoundError", "param": "model", "code": 404}
    (item,) = run_openai(openai, "/v1/messages", {"model": "nope", "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert item["type"] == "error" and item["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(("model", "reason"), [
    ("rank-32", "has rank 32, above MAX_LORA_RANK=16: set MAX_LORA_RANK=32"),
    ("other-base", "was trained for base model 'test/another-model', not the served 'test/tiny-llama'"),
    ("for-smollm2", "could not be loaded: The size of tensor a"),
    ("damaged", "could not be loaded: Error while deserializing header"),
])
def test_an_adapter_that_cannot_be_served_is_a_400_that_says_why(openai, run_openai, engine, run_job, folders,
                                                                 model, reason):
    (item,) = run_openai(openai, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert item["error"]["code"] == 400 and reason in item["error"]["message"]
    assert not any(str(folder) in item["error"]["message"] for folder in folders)  # no server path
    (item,) = run_openai(openai, "/v1/messages", {"model": model, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert item["error"]["type"] == "invalid_request_error" and reason in item["error"]["message"]
    (item,) = run_job(engine, {"prompt": PROMPT, "model": model})
    assert item["error"]["code"] == 400 and item["error"]["param"] == "model"
    assert text(complete(run_openai, openai, "a"))  # others unaffected, the engine serves on


def test_concurrent_first_uses_load_an_adapter_once(openai, engine, caplog, monkeypatch):
    with caplog.at_level("INFO", logger="worker.engine.adapters"):
        texts = run_together(openai, ["once"] * 4, monkeypatch)
    assert len(set(texts)) == 1 and texts[0]
    assert [r.getMessage().split(" from ")[0] for r in caplog.records] == ["LoRA adapter once loaded"]


def test_models_lists_the_base_loaded_and_available_adapters(openai, run_openai, folders):
    (item,) = run_openai(openai, "/v1/models")
    ids = [card["id"] for card in item["data"]]
    assert ids[0] == SERVED and set(ids[1:4]) == {"static-a", "static-b", "static-c"}
    assert {"a", "only-second", "org/in-folder", "rank-32", "damaged"} <= set(ids)
    assert len(ids) == len(set(ids))
    assert all(card["parent"] == SERVED for card in item["data"][1:])


def with_hub(engine, monkeypatch, repos: str, **caps) -> HubAdapters:
    """The engine's adapters also from the hub's ``repos`` (LORA_HUB_REPOS), within ``caps``."""
    fetched = HubAdapters(hub_rules(repos), **{"max_adapters": 32, "max_bytes": 1 << 30, **caps})
    monkeypatch.setattr(engine.adapters, "sources", dataclasses.replace(engine.adapters.sources, hub=fetched))
    return fetched


def test_an_adapter_from_the_hub_and_a_hub_out_of_reach(engine, openai, run_openai, run_job, online, hub,
                                                        folders, monkeypatch):
    """The local hub serves a copy of adapter "a" as org/hub-a (a repo LORA_HUB_REPOS allows), then
    stops answering: a name not fetched yet is a 502, on the route and on a raw job."""
    import huggingface_hub.constants

    volume, _ = folders
    with_hub(engine, monkeypatch, "org/hub-*")
    hub.add_repo("org/hub-a", {path.name: path for path in (volume / "a").iterdir()})
    assert text(complete(run_openai, openai, "org/hub-a")) == text(complete(run_openai, openai, "a"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    (item,) = run_openai(openai, "/v1/completions", {"model": "org/hub-b", "prompt": PROMPT, "max_tokens": 3})
    assert item["error"]["code"] == 502 and "could not be fetched from the hub" in item["error"]["message"]
    (item,) = run_job(engine, {"prompt": PROMPT, "model": "org/hub-b"})
    assert item["error"]["code"] == 502


def test_a_hub_adapter_named_in_any_case_is_one_adapter_and_caps_hold(engine, openai, run_openai, run_job,
                                                                      online, hub, folders, tmp_path,
                                                                      monkeypatch):
    """Issue 43: case variants of a hub repo id were fetched, cached and loaded each on their own (a
    slot and a registry entry each), and nothing capped what a caller could make a worker fetch."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    volume, _ = folders
    with_hub(engine, monkeypatch, "acme/*", max_adapters=1)
    files = {path.name: path for path in (volume / "b").iterdir() if path.name.startswith("adapter_")}
    hub.add_repo("Acme/Case-A", files)
    hub.add_repo("acme/other", files)
    reference = text(complete(run_openai, openai, "b"))
    assert text(complete(run_openai, openai, "acme/case-a")) == reference
    assert text(complete(run_openai, openai, "ACME/CASE-A")) == reference
    (item,) = run_job(engine, {"prompt": PROMPT, "model": "Acme/Case-A", "sampling_params": {
        "max_tokens": 10, "temperature": 0, "ignore_eos": True}})
    assert "".join(item["choices"][0]["tokens"]) == reference
    spellings = {name: request.lora_int_id for name, request in engine.adapters.loaded.items()
                 if name.casefold() == "acme/case-a"}
    assert set(spellings) == {"Acme/Case-A", "acme/case-a", "ACME/CASE-A"} and len(set(spellings.values())) == 1
    assert {d.repo for d in hub.downloads} == {"Acme/Case-A"} and len(hub.downloads) == len(files)
    (item,) = run_openai(openai, "/v1/models")
    assert [card["id"] for card in item["data"]].count("Acme/Case-A") == 1
    for model in ("acme/other", "ACME/OTHER"):  # past LORA_HUB_MAX_ADAPTERS=1: refused, nothing fetched
        (item,) = run_openai(openai, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert item["error"]["code"] == 400 and "past LORA_HUB_MAX_ADAPTERS=1" in item["error"]["message"]
        (item,) = run_job(engine, {"prompt": PROMPT, "model": model})
        assert item["error"]["code"] == 400 and item["error"]["param"] == "model"
    assert {d.repo for d in hub.downloads} == {"Acme/Case-A"}
    assert text(complete(run_openai, openai, "acme/case-a")) == reference  # serves on


@pytest.fixture
def resolver_dir(engine, folders, tmp_path, monkeypatch):
    """vLLM's filesystem resolver on a folder of its own (VLLM_PLUGINS=lora_filesystem_resolver,
    VLLM_LORA_RESOLVER_CACHE_DIR), with an adapter for the served model in it; beside it, outside
    it, another adapter for the served model and a folder with an unreadable config."""
    from vllm.lora.resolver import LoRAResolverRegistry
    from vllm.plugins.lora_resolvers.filesystem_resolver import FilesystemResolver

    volume, _ = folders
    base = engine.llm.model_config.model
    for name in ("cache/in-cache", "outside"):
        shutil.copytree(volume / "c", tmp_path / name)
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        (tmp_path / name / "adapter_config.json").write_text(
            json.dumps({**config, "base_model_name_or_path": base}))
    (tmp_path / "unreadable").mkdir()
    (tmp_path / "unreadable" / "adapter_config.json").write_text("{not json")
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {"Filesystem Resolver": FilesystemResolver(
        str(tmp_path / "cache"))})
    return tmp_path


def test_names_outside_the_rule_never_reach_vllms_resolvers(openai, run_openai, run_job, engine, resolver_dir):
    """Issue 43: ``/abs/dir`` or ``../x`` reached folders outside the resolver's, and a 404 against a
    500 told whether a file existed there. Now every such name is one 404, whatever is on disk."""
    assert text(complete(run_openai, openai, "in-cache")) == text(complete(run_openai, openai, "c"))
    names = [str(resolver_dir / "outside"), "../outside", "../unreadable", str(resolver_dir / "unreadable"),
             str(resolver_dir / "nothing"), "../nothing"]
    for name in names:
        (item,) = run_openai(openai, "/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 3})
        error = item["error"]  # (a path in an answer shows as <path>)
        assert (error["code"], error["type"], error["param"]) == (404, "NotFoundError", "model")
        assert error["message"].endswith(f"` does not exist. Valid aliases: {SERVED}.")
        (item,) = run_job(engine, {"prompt": PROMPT, "model": name})
        assert item["error"]["code"] == 404 and item["error"]["param"] == "model"
    assert not any(name in engine.adapters.loaded for name in names)


def test_a_resolver_that_fails_on_a_valid_name_is_a_404_too(openai, run_openai, resolver_dir, caplog):
    (resolver_dir / "cache" / "broken").mkdir()
    (resolver_dir / "cache" / "broken" / "adapter_config.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="worker.engine.adapters"):
        (item,) = run_openai(openai, "/v1/completions", {"model": "broken", "prompt": PROMPT, "max_tokens": 3})
    assert item["error"]["code"] == 404
    assert "LoRA adapter broken: a vLLM LoRA resolver failed" in caplog.text  # the cause, in the log


def test_models_shows_no_server_path_and_walks_the_folders_off_the_loop(openai, run_openai, engine,
                                                                       folders, monkeypatch):
    """Issue 43: /v1/models walked the adapter folders on the engine's event loop at every call, and
    each card's root was a folder of the server's."""
    import threading

    walks = []
    walk = engine.adapters.sources.available

    def counted():
        walks.append(threading.current_thread().name)
        return walk()

    monkeypatch.setattr(engine.adapters, "sources", dataclasses.replace(engine.adapters.sources))
    object.__setattr__(engine.adapters.sources, "available", counted)
    monkeypatch.setattr(engine.adapters, "_listing", None)
    listings = [run_openai(openai, "/v1/models")[0] for _ in range(3)]
    assert len(walks) == 1 and walks[0].startswith("lora-adapters")  # once, in the registry's threads
    cards = listings[-1]["data"]
    assert {"a", "only-second", "static-a"} <= {card["id"] for card in cards}
    volume, second = folders
    for card in cards:
        assert not card["root"].startswith("/") and str(volume) not in json.dumps(card)
    assert all(card["root"] == card["id"] for card in cards[1:])
