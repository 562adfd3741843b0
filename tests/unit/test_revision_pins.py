"""A revision pins one repo (issue 47): MODEL_REVISION the model's, never another repo's. worker-vllm
rolled back from vLLM 0.29 when first requests failed with RevisionNotFound (a huggingface_hub bug
applied one repo's pinned revision to another); vLLM itself hands the model's revision on to another
tokenizer repo and a config repo when they have none of their own, and the tokenizer's to a draft
model's tokenizer (use_heterogeneous_vocab).

vLLM's engine configuration is built here as the worker builds it (preflight's downloads, then
``resolve_args``), against the local hub, for each way the worker may give vLLM the model; the hub
says which revision each repo was asked at. PIN is a tag only the model's repo has."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import huggingface_hub
import pytest
from conftest import engine_env

from worker.config.engine_args import resolve_args
from worker.config.model_request import model_request
from worker.model.preflight import prepare

PIN = "pinned"
DRAFT_PIN = "draft-v1"  # the draft repo's own tag
SPECULATION = {"model": "org/draft", "num_speculative_tokens": 2}
TOKENIZER = {"TOKENIZER_NAME": "org/tok"}
LEGACY_DRAFT = {"SPECULATIVE_MODEL": "org/draft", "NUM_SPECULATIVE_TOKENS": "2"}
# A draft with a vocabulary of its own: vLLM gives its tokenizer the target tokenizer's revision.
OWN_VOCABULARY = {"SPECULATIVE_CONFIG": json.dumps(
    {**SPECULATION, "method": "draft_model", "use_heterogeneous_vocab": True})}
DROPPED = f"env MODEL_REVISION={PIN} not given to vLLM"  # logged when the model is a local folder


@pytest.fixture
def commits(hub, online, models, tmp_path, monkeypatch) -> dict[str, str]:
    """The repos on the hub, each revision's commit by ``repo@revision``: org/model (main, and PIN),
    org/tok (a tokenizer alone, main), org/draft (main, and DRAFT_PIN), org/cfg (a config, main)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # vLLM keeps one HfApi per process, bound to the hub address of its first use: one for this hub.
    monkeypatch.setattr("vllm.transformers_utils.repo_utils._hf_api", None)
    tiny = {path.name: path for path in models["tiny-llama"].iterdir() if not path.name.startswith(".")}
    hub.add_repo("org/model", {**tiny, "README.md": b"main"})
    tokenizer = {name: path for name, path in tiny.items() if name.startswith("tokenizer")}
    draft_v1 = hub.add_repo("org/draft", {**tiny, "README.md": b"v1"}, tags=[DRAFT_PIN])
    return {f"org/model@{PIN}": hub.add_repo("org/model", tiny, revision="release", tags=[PIN]),
            f"org/draft@{DRAFT_PIN}": draft_v1,
            "org/draft@main": hub.add_repo("org/draft", tiny),
            "org/tok@main": hub.add_repo("org/tok", tokenizer),
            "org/cfg@main": hub.add_repo("org/cfg", {"config.json": tiny["config.json"]})}


def from_hub(**env: str) -> dict[str, str]:
    return {"MODEL_NAME": "org/model", "MODEL_REVISION": PIN, **env}


def from_config_file(tmp_path: Path) -> dict[str, str]:
    config = {"model": "org/model", "revision": PIN, "tokenizer": "org/tok",
              "speculative-config": SPECULATION}
    (tmp_path / "vllm_config.yaml").write_text(json.dumps(config))  # YAML reads JSON
    return {"VLLM_CONFIG_FILE": str(tmp_path / "vllm_config.yaml")}


def from_extra_args() -> dict[str, str]:
    flags = ["--model", "org/model", "--revision", PIN, "--tokenizer", "org/tok",
             "--speculative-config", json.dumps(SPECULATION)]
    return {"VLLM_EXTRA_ARGS": shlex.join(flags)}


def baked(tiny: Path, tmp_path: Path, **env: str) -> dict[str, str]:
    """The image's copy of org/model (``tiny``), named by its repo id at run time."""
    (tmp_path / "local_model_args.json").write_text(json.dumps({"MODEL_NAME": str(tiny),
                                                                "BAKED_MODEL_NAME": "org/model"}))
    return from_hub(LOCAL_MODEL_ARGS_FILE=str(tmp_path / "local_model_args.json"), **env)


# Each way the model reaches vLLM, and the revision each repo must be asked at (only at it).
EVERY_REPO = {"org/model": PIN, "org/tok": "main", "org/draft": "main"}
CASES = [
    pytest.param(lambda tiny, tmp: from_hub(**TOKENIZER, **LEGACY_DRAFT), EVERY_REPO,
                 id="hub repo, legacy draft"),
    pytest.param(lambda tiny, tmp: from_hub(**LEGACY_DRAFT, SPECULATIVE_MODEL_REVISION=DRAFT_PIN,
                                            HF_CONFIG_PATH="org/cfg"),
                 {"org/model": PIN, "org/draft": DRAFT_PIN, "org/cfg": "main"}, id="hub repo, pinned draft"),
    pytest.param(lambda tiny, tmp: from_hub(**OWN_VOCABULARY), {"org/model": PIN, "org/draft": "main"},
                 id="hub repo, draft's own vocabulary"),
    pytest.param(lambda tiny, tmp: from_config_file(tmp), EVERY_REPO, id="config file"),
    pytest.param(lambda tiny, tmp: from_extra_args(), EVERY_REPO, id="VLLM_EXTRA_ARGS"),
    pytest.param(lambda tiny, tmp: from_hub(MODEL_NAME=str(tiny), **TOKENIZER, HF_CONFIG_PATH="org/cfg"),
                 {"org/tok": "main", "org/cfg": "main"}, id="local folder"),
    pytest.param(lambda tiny, tmp: from_hub(MODEL_NAME=str(tiny), **OWN_VOCABULARY), {"org/draft": "main"},
                 id="local folder, draft's own vocabulary"),
    pytest.param(lambda tiny, tmp: baked(tiny, tmp, **TOKENIZER, **OWN_VOCABULARY),
                 {"org/tok": "main", "org/draft": "main"}, id="baked copy"),
]


@pytest.mark.parametrize(("env_of", "expected"), CASES)
def test_each_repo_is_asked_at_its_own_revision_only(commits, hub, models, tmp_path, caplog, capture_info,
                                                     env_of, expected):
    env = {**engine_env(models["tiny-llama"]), "MODEL_NAME": "", **env_of(models["tiny-llama"], tmp_path)}
    request = model_request(env)
    resolved = resolve_args(env, downloaded=prepare(request) if request else None)
    config = resolved.engine_config()

    asked = hub.revisions_asked()
    assert asked.keys() == expected.keys()
    for repo, revision in expected.items():
        assert asked[repo] <= {revision, commits[f"{repo}@{revision}"]}, repo
    if "org/draft" in expected:
        draft = config.speculative_config.draft_model_config
        assert (draft.model, draft.revision) == ("org/draft", expected["org/draft"])
    assert (DROPPED in caplog.text) == ("org/model" not in expected)  # a local folder's, then
