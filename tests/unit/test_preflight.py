"""preflight.py against the local hub, in this process: each way a repo can be out of reach named
with the variable to change; the download (files chosen, revision pinned, a killed download resumed,
the cache offline); config/model_request's reading of the layers, before vLLM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import huggingface_hub
import pytest

from worker.model import preflight
from worker.wire.errors import StartupError
from worker.wire.redact import mask_urls
from worker.model.preflight import ModelRequest, RepoRequest, prepare
from worker.config.model_request import model_request
from tests.unit.test_local_hub import LATEST, OTHER, RELEASE, REVOKED, TOKEN, TOKENIZER

MODEL = RepoRequest("org/model", None, "MODEL_NAME", "MODEL_REVISION")


@pytest.fixture
def cache(online, tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, and no token unless a test sets HF_TOKEN."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return tmp_path / "hub"


def failure(request: RepoRequest = MODEL) -> StartupError:
    with pytest.raises(StartupError) as raised:
        prepare(ModelRequest(request))
    return raised.value


def test_a_missing_repo_names_the_model_and_the_token(hub, cache):
    error = failure()
    assert "MODEL_NAME='org/model': no such repo on the hub, or it is private" in str(error)
    assert error.variables == ("MODEL_NAME", "HF_TOKEN") and not error.transient


def test_a_private_repo_the_token_cannot_read(hub, cache, monkeypatch):
    hub.add_repo("org/model", RELEASE, private=True, readers=[TOKEN])
    hub.add_token(OTHER)
    monkeypatch.setenv("HF_TOKEN", OTHER)
    assert "it is private and the account of HF_TOKEN cannot read it" in str(failure())
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model, _ = prepare(ModelRequest(MODEL))
    assert (model.path / "model.safetensors").read_bytes() == b"weights v1"


def test_a_gated_repo_without_a_token_and_with_a_token_without_access(hub, cache, monkeypatch):
    hub.add_repo("org/model", RELEASE, token=TOKEN)
    error = failure()
    assert "is gated: accept its terms at" in str(error) and error.variables == ("HF_TOKEN",)
    hub.add_token(OTHER)
    monkeypatch.setenv("HF_TOKEN", OTHER)
    assert "is gated, and the account of HF_TOKEN has no access" in str(failure())


def test_a_token_from_vllm_extra_args_reads_a_gated_repo(hub, cache, tmp_path):
    hub.add_repo("org/model", RELEASE, token=TOKEN)
    request = request_for(tmp_path, MODEL_NAME="org/model", VLLM_EXTRA_ARGS=f"--hf-token {TOKEN} --max-model-len 64")
    model, _ = prepare(request)  # sets HF_TOKEN (the cache fixture's monkeypatch unsets it after)
    assert (model.path / "model.safetensors").read_bytes() == b"weights v1"
    assert os.environ["HF_TOKEN"] == TOKEN and TOKEN not in repr(request)


def test_a_token_the_hub_refuses(hub, cache, monkeypatch):
    hub.add_repo("org/model", RELEASE)
    monkeypatch.setenv("HF_TOKEN", REVOKED)
    error = failure()
    assert str(error).startswith("HF_TOKEN: the hub refused the token") and error.variables == ("HF_TOKEN",)


def test_a_hub_slower_than_model_preflight_timeout_is_a_transient_failure_naming_it(hub, cache):
    hub.add_repo("org/model", RELEASE)
    hub.api_delay = 5
    error = failure(RepoRequest("org/model", None, "MODEL_NAME", "MODEL_REVISION", timeout=0.3))
    assert str(error) == "MODEL_NAME='org/model': the hub (HF_ENDPOINT) did not answer within 0.3 s " \
        "(MODEL_PREFLIGHT_TIMEOUT)" and error.transient
    assert error.detail == f"HF_ENDPOINT={hub.url}"  # a mirror's address: in the log only


def test_each_step_is_told_with_the_downloads_progress(hub, cache):
    hub.add_repo("org/model", RELEASE)
    phases = []
    prepare(ModelRequest(MODEL), lambda phase, progress=None: phases.append((phase, progress and progress())))
    assert phases == [("preflight", None), ("download", 0)]


def test_a_missing_revision_names_its_variable(hub, cache):
    hub.add_repo("org/model", RELEASE)
    error = failure(RepoRequest("org/model", "v9", "MODEL_NAME", "MODEL_REVISION"))
    assert str(error) == "MODEL_REVISION='v9': no such branch, tag or commit in org/model"
    assert error.variables == ("MODEL_REVISION",)


def test_an_unreachable_hub_is_transient(hub, cache):
    hub.stop()
    error = failure()
    assert error.transient and "cannot reach the hub" in str(error)


def test_a_mirrors_address_and_the_exceptions_text_are_left_to_the_log(hub, cache, monkeypatch):
    """A mirror given with credentials (``HF_ENDPOINT=http://user:password@host``): a caller learns
    what failed and the variable; the log gets the address, its credentials masked there."""
    mirror = hub.url.replace("http://", "http://mirror-user:s3cret-pw@")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", mirror)
    hub.stop()
    error = failure()
    assert str(error) == error.answer == \
        "MODEL_NAME='org/model': download failed: cannot reach the hub (HF_ENDPOINT)"
    assert error.detail.startswith("ConnectError: ") and error.detail.endswith(f"HF_ENDPOINT={mirror}")
    assert "s3cret-pw" not in mask_urls(error.logged) and "http://***@127.0.0.1" in mask_urls(error.logged)


def test_downloads_the_pinned_revision_and_one_weight_format(hub, cache):
    release = hub.add_repo("org/model", RELEASE, tags=["v1"])
    hub.add_repo("org/model", LATEST)
    tokenizer = hub.add_repo("org/tokenizer", TOKENIZER)
    model, other = prepare(ModelRequest(RepoRequest("org/model", "v1", "MODEL_NAME", "MODEL_REVISION"),
                                        RepoRequest("org/tokenizer", None, "TOKENIZER_NAME", "TOKENIZER_REVISION")))
    assert model.commit == release and model.path.parent.parent.parent == cache
    assert sorted(p.name for p in model.path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (model.path / "model.safetensors").read_bytes() == b"weights v1"
    assert other.commit == tokenizer and not (other.path / "model.safetensors").exists()
    # Each file was fetched once; a second start finds them all in the cache.
    fetched = len(hub.downloads)
    prepare(ModelRequest(RepoRequest("org/model", "v1", "MODEL_NAME", "MODEL_REVISION")))
    assert len(hub.downloads) == fetched


def test_a_download_a_killed_worker_left_is_resumed_where_it_stopped(hub, cache):
    weights = bytes(range(256)) * 4096  # 1 MiB
    hub.add_repo("org/model", {**RELEASE, "model.safetensors": weights})
    info = huggingface_hub.HfApi().model_info("org/model", files_metadata=True)
    blob_id = next(s.blob_id for s in info.siblings if s.rfilename == "model.safetensors")
    blobs = cache / "models--org--model" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{blob_id}.0badf00d.incomplete").write_bytes(weights[:300_000])  # a killed download's
    (blobs / f"{blob_id}.12345678.incomplete").write_bytes(weights[:1000])  # an older one
    model, _ = prepare(ModelRequest(MODEL))
    assert (model.path / "model.safetensors").read_bytes() == weights
    (resumed,) = [d for d in hub.downloads if d.path == "model.safetensors"]
    assert (resumed.start, resumed.sent, resumed.complete) == (300_000, len(weights) - 300_000, True)
    assert not list(blobs.glob("*.incomplete"))


def test_offline_the_cache_serves_and_a_cold_cache_is_named(hub, cache, monkeypatch):
    release = hub.add_repo("org/model", RELEASE)
    prepare(ModelRequest(MODEL))
    hub.stop()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model, _ = prepare(ModelRequest(MODEL))
    assert model.commit == release
    error = failure(RepoRequest("org/other", None, "MODEL_NAME", "MODEL_REVISION"))
    assert "is not in the Hugging Face cache (HF_HOME)" in str(error) and "HF_HUB_OFFLINE" in error.variables
    assert str(cache) not in str(error) and error.detail == f"the cache: {cache}"  # the path: the log's


def test_offline_a_tokenizers_own_repo_is_found_at_its_own_branch(hub, cache, monkeypatch):
    """A tokenizer's repo may have no config.json: the cache finds it by its ref (its default branch,
    not the model's pin), as it finds the model."""
    release = hub.add_repo("org/model", RELEASE, tags=["v1"])
    hub.add_repo("org/model", LATEST)
    tokenizer = hub.add_repo("org/tokenizer", TOKENIZER)
    request = ModelRequest(RepoRequest("org/model", "v1", "MODEL_NAME", "MODEL_REVISION"),
                           RepoRequest("org/tokenizer", None, "TOKENIZER_NAME", "TOKENIZER_REVISION"))
    prepare(request)
    hub.stop()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model, other = prepare(request)
    assert (model.commit, other.commit) == (release, tokenizer)
    assert sorted(p.name for p in other.path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_too_little_free_space_is_named_before_anything_downloads(hub, cache, monkeypatch):
    hub.add_repo("org/model", {**RELEASE, "model.safetensors": b"w" * 10_000})
    # A stand-in for the disk here; tests/endpoint measures a real one that is too small.
    monkeypatch.setattr(preflight, "_free_bytes", lambda path: 5_000)
    error = failure()
    assert "needs 0.00 GB more in the Hugging Face cache (HF_HOME)" in str(error)
    assert "BASE_PATH" in error.variables
    assert str(cache) not in str(error) and str(cache) in error.logged
    assert hub.downloads == []


# --- config/model_request: which repos, from the same layers as load_config -------------------

def request_for(tmp_path: Path, config: dict | None = None, baked: dict | None = None, **env: str):
    config_file, baked_file = tmp_path / "vllm_config.yaml", tmp_path / "local_model_args.json"
    if config is not None:
        config_file.write_text(json.dumps(config))  # YAML reads JSON
    if baked is not None:
        baked_file.write_text(json.dumps(baked))
    return model_request({"VLLM_CONFIG_FILE": str(config_file), "LOCAL_MODEL_ARGS_FILE": str(baked_file), **env})


def test_model_request_reads_env_over_the_config_file(tmp_path):
    request = request_for(tmp_path, {"model": "org/from-file", "revision": "v2"}, MODEL_NAME="org/from-env")
    assert request == ModelRequest(RepoRequest("org/from-env", "v2", "MODEL_NAME",
                                               f"revision in {tmp_path}/vllm_config.yaml (VLLM_CONFIG_FILE)", 15))
    assert request_for(tmp_path, {"model": "org/from-file"}).model.variable.startswith("model in ")


def test_model_request_carries_a_token_given_above_the_environment(tmp_path):
    assert request_for(tmp_path, MODEL_NAME="org/m", HF_TOKEN="hf_env").token is None  # huggingface_hub reads it
    assert request_for(tmp_path, {"hf-token": "hf_file"}, MODEL_NAME="org/m").token == "hf_file"
    assert request_for(tmp_path, {"hf-token": "hf_file"}, MODEL_NAME="org/m", HF_TOKEN="hf_env",
                       VLLM_EXTRA_ARGS="--hf-token=hf_extra").token == "hf_extra"
    assert request_for(tmp_path / "no-file", MODEL_NAME="org/m", VLLM_EXTRA_ARGS="--hf-token --max-model-len 9").token is None


def test_model_request_has_a_tokenizer_only_for_another_repo_or_revision(tmp_path):
    assert request_for(tmp_path, MODEL_NAME="org/m", TOKENIZER_NAME="org/m").tokenizer is None
    other = request_for(tmp_path, MODEL_NAME="org/m", MODEL_REVISION="v1", TOKENIZER_NAME="org/t").tokenizer
    assert other == RepoRequest("org/t", None, "TOKENIZER_NAME", "TOKENIZER_REVISION", 15)
    pinned = request_for(tmp_path, MODEL_NAME="org/m", TOKENIZER_REVISION="v3", MODEL_PREFLIGHT_TIMEOUT="4").tokenizer
    assert pinned == RepoRequest("org/m", "v3", "MODEL_NAME", "TOKENIZER_REVISION", 4)


@pytest.mark.parametrize("env", [{"MODEL_NAME": "/models/local"}, {"MODEL_NAME": "./here"},
                                 {"MODEL_NAME": "s3://bucket/model"}, {"MODEL_NAME": "org/baked"}, {}])
def test_model_request_skips_local_baked_and_missing_models(tmp_path, env):
    baked = {"MODEL_NAME": "/models/snap", "BAKED_MODEL_NAME": "org/baked"}
    assert request_for(tmp_path, baked=baked, **env) is None
