"""download_model.py: which files are baked, the baked-args file, and errors that say what to do.

Baking runs offline against a local Hugging Face cache built here (tests/hub_cache.py); hub errors
come from a local stand-in for the hub, through huggingface_hub's real HTTP client.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest
from hub_cache import add_cached_repo

from worker.model import download_model
from worker.model.download_model import BakeError, bake, fetch, select_files
from worker.config.engine_args import resolve_args

SAFETENSORS_REPO = {
    "config.json": b"{}", "generation_config.json": b"{}", "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}", "chat_template.jinja": b"", "README.md": b"",
    "model-00001-of-00002.safetensors": b"w", "model-00002-of-00002.safetensors": b"w",
    "model.safetensors.index.json": b"{}", "pytorch_model.bin": b"w",
    "original/consolidated.safetensors": b"w",
}
BIN_REPO = {"config.json": b"{}", "pytorch_model.bin": b"w", "tokenizer.model": b"t",
            "special_tokens_map.json": b"{}", "flax_model.msgpack": b"w", "optimizer.bin": b"w",
            "training_args.bin": b"w"}
TOKENIZER_REPO = {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}", "vocab.txt": b"",
                  "merges.txt": b"", "README.md": b""}
NO_WEIGHTS_REPO = {"config.json": b"{}", "README.md": b"", "model.gguf": b"w"}


# --- choosing files (pure) -----------------------------------------------------------------------

@pytest.mark.parametrize(("files", "expected"), [
    pytest.param(SAFETENSORS_REPO, [
        "chat_template.jinja", "config.json", "generation_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"], id="safetensors"),
    pytest.param(BIN_REPO, ["config.json", "pytorch_model.bin", "special_tokens_map.json",
                            "tokenizer.model"], id="bin-only"),
    pytest.param({"config.json": b"", "model.pt": b"", "modeling_custom.py": b""},
                 ["config.json", "model.pt", "modeling_custom.py"], id="pt-and-remote-code"),
    pytest.param({"model.safetensors": b"", "modules.json": b"", "1_Pooling/config.json": b"",
                  "onnx/model.onnx": b""},
                 ["1_Pooling/config.json", "model.safetensors", "modules.json"], id="sentence-transformers"),
])
def test_one_weight_format_and_every_support_file(files, expected):
    assert select_files(files, weights=True) == expected


def test_a_tokenizer_repo_gives_no_weights():
    assert select_files([*TOKENIZER_REPO, "model.safetensors"], weights=False) == [
        "merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]


@pytest.mark.parametrize(("files", "weights", "message"), [
    (["config.json", "original/consolidated.safetensors"], True, "no weight files"),
    (["model.safetensors", "README.md"], True, "no config or tokenizer files"),
    (["README.md"], False, "no config or tokenizer files"),
])
def test_repos_missing_what_vllm_needs_are_refused(files, weights, message):
    with pytest.raises(ValueError, match=message):
        select_files(files, weights=weights)


# --- baking from a local cache -----------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The four repos of a small offline hub."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = tmp_path / "models"
    for repo, files in {"org/safetensors": SAFETENSORS_REPO, "org/bin-only": BIN_REPO,
                        "org/tokenizer": TOKENIZER_REPO, "org/no-weights": NO_WEIGHTS_REPO}.items():
        add_cached_repo(cache, repo, files)
    add_cached_repo(cache, "org/safetensors", {"tokenizer.json": b"{}"}, revision="v2")
    return cache


@pytest.fixture
def build_env(cache, tmp_path):
    """build_env(**args) → the environment of the Dockerfile's bake step for these build args."""
    def env(**args: str) -> dict[str, str]:
        return {"BAKED_MODELS_DIR": str(cache),
                "LOCAL_MODEL_ARGS_FILE": str(tmp_path / "local_model_args.json"), **args}

    return env


def args_file(env: dict[str, str]) -> Path:
    return Path(env["LOCAL_MODEL_ARGS_FILE"])


def test_bakes_safetensors_and_not_the_other_formats(cache):
    snapshot = fetch("org/safetensors", None, cache, weights=True)
    assert snapshot.files == tuple(select_files(SAFETENSORS_REPO, weights=True))
    assert (snapshot.path / "config.json").is_file()


def test_bakes_bin_weights_when_there_are_no_safetensors(cache):
    assert "pytorch_model.bin" in fetch("org/bin-only", None, cache, weights=True).files


def test_writes_the_args_the_config_layer_reads(build_env):
    env = build_env(MODEL_NAME="org/safetensors", TOKENIZER_NAME="org/tokenizer", QUANTIZATION="awq")
    baked = bake(env)
    assert json.loads(args_file(env).read_text()) == baked
    assert baked == {
        "MODEL_NAME": str(fetch("org/safetensors", None, env["BAKED_MODELS_DIR"], weights=True).path),
        "BAKED_MODEL_NAME": "org/safetensors",
        "TOKENIZER_NAME": str(fetch("org/tokenizer", None, env["BAKED_MODELS_DIR"], weights=False).path),
        "BAKED_TOKENIZER_NAME": "org/tokenizer",
        "QUANTIZATION": "awq",
    }
    # The worker, started with MODEL_NAME naming the baked repo, serves the local copies.
    resolved = resolve_args({"MODEL_NAME": "org/safetensors", "VLLM_CONFIG_FILE": "/nonexistent",
                             "LOCAL_MODEL_ARGS_FILE": env["LOCAL_MODEL_ARGS_FILE"]})
    args = resolved.engine_args
    assert (args.model, args.tokenizer, args.quantization) == (
        baked["MODEL_NAME"], baked["TOKENIZER_NAME"], "awq")
    assert args.served_model_name == ["org/safetensors"]


def test_the_model_repo_serves_as_its_own_tokenizer(build_env):
    env = build_env(MODEL_NAME="org/safetensors", TOKENIZER_NAME="org/safetensors")
    assert set(bake(env)) == {"MODEL_NAME", "BAKED_MODEL_NAME"}


def test_a_tokenizer_revision_alone_bakes_the_model_repo_at_that_revision(build_env):
    baked = bake(build_env(MODEL_NAME="org/safetensors", TOKENIZER_REVISION="v2"))
    assert baked["BAKED_TOKENIZER_NAME"] == "org/safetensors"
    assert baked["TOKENIZER_NAME"] != baked["MODEL_NAME"]


def test_no_model_name_bakes_nothing(build_env):
    env = build_env(MODEL_NAME=" ")
    assert bake(env) is None
    assert not args_file(env).exists()


@pytest.mark.parametrize(("model", "message"), [
    ("org/no-weights", r"org/no-weights \(revision main\): no weight files .* among: README.md, "
                       r"config.json, model.gguf"),
    ("org/absent", r"org/absent \(revision main\) is not in the local cache, and HF_HUB_OFFLINE is set"),
])
def test_unbakeable_models_fail_with_a_reason(build_env, model, message):
    env = build_env(MODEL_NAME=model)
    with pytest.raises(BakeError, match=message):
        bake(env)
    assert not args_file(env).exists()


def test_main_reports_the_reason_and_exits_1(build_env, monkeypatch, caplog):
    for name, value in build_env(MODEL_NAME="org/no-weights").items():
        monkeypatch.setenv(name, value)
    assert download_model.main() == 1
    assert "Cannot bake the model: org/no-weights (revision main): no weight files" in caplog.text


# --- hub errors ----------------------------------------------------------------------------------

@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local stand-in for the hub answering every request with one error; no token configured."""
    reply = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            self.send_response(reply["status"])
            self.send_header("X-Error-Code", reply["code"])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)

    def answer(status: int, code: str) -> None:
        reply.update(status=status, code=code)

    yield answer
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("status", "code", "message"), [
    (404, "RepoNotFound", r"org/x \(revision main\) does not exist on the Hugging Face hub, or is "
                          r"private: build with a token: HF_TOKEN=hf_\.\.\. docker buildx bake"),
    (401, "GatedRepo", r"org/x \(revision main\) is gated: accept its terms on huggingface.co, then "
                       r"build with a token"),
    (404, "RevisionNotFound", r"org/x \(revision main\): no such revision"),
])
def test_hub_errors_say_what_to_do(hub, tmp_path, status, code, message):
    hub(status, code)
    with pytest.raises(BakeError, match=message):
        fetch("org/x", None, tmp_path, weights=True)


def test_a_gated_repo_with_a_token_asks_to_check_the_token(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    hub(403, "GatedRepo")
    with pytest.raises(BakeError, match="is gated: .* check that the token given can read it"):
        fetch("org/x", None, tmp_path, weights=True)
