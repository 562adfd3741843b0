"""download_model.py: which files are baked, the baked-args file, and errors that say what to do.

Models are baked offline from a local Hugging Face cache built here (tests/hub_cache.py), LoRA
adapters online from the local hub (tests/image/local_hub.py); hub errors come from a local
stand-in for the hub, through huggingface_hub's real HTTP client.
"""

from __future__ import annotations

import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import safetensors.numpy
from hub_cache import add_cached_repo

from worker.config.engine_args import resolve_args
from worker.config.worker_config import load_config
from worker.model import download_model
from worker.model.download_model import BakeError, adapter_entries, bake, fetch, select_files

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


def bake_env(models: Path, tmp_path: Path, **args: str) -> dict[str, str]:
    """The environment of the Dockerfile's bake step for these build args, baking into ``models``."""
    return {"BAKED_MODELS_DIR": str(models), "LOCAL_MODEL_ARGS_FILE": str(tmp_path / "local_model_args.json"),
            **args}


@pytest.fixture
def build_env(cache, tmp_path):
    """build_env(**args) → bake_env from the offline cache."""
    return functools.partial(bake_env, cache, tmp_path)


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
    assert "Cannot bake: org/no-weights (revision main): no weight files" in caplog.text


# --- hub errors ----------------------------------------------------------------------------------

@pytest.fixture
def no_token(tmp_path, monkeypatch):
    """huggingface_hub without a token, whatever this environment configures."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def error_hub(no_token, monkeypatch):
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
def test_hub_errors_say_what_to_do(error_hub, tmp_path, status, code, message):
    error_hub(status, code)
    with pytest.raises(BakeError, match=message):
        fetch("org/x", None, tmp_path, weights=True)


def test_a_gated_repo_with_a_token_asks_to_check_the_token(error_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    error_hub(403, "GatedRepo")
    with pytest.raises(BakeError, match="is gated: .* check that the token given can read it"):
        fetch("org/x", None, tmp_path, weights=True)


# --- LoRA adapters -------------------------------------------------------------------------------

def adapter(rank: int) -> dict[str, bytes]:
    """A LoRA adapter's files, its own bytes for each rank (the hub cache shares identical files)."""
    config = {"peft_type": "LORA", "r": rank, "base_model_name_or_path": "org/safetensors"}
    weights = {"base_model.model.lm_head.lora_A.weight": np.full((rank, 4), rank, np.float32)}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": safetensors.numpy.save(weights)}


def under(folder: str, files: dict[str, bytes]) -> dict[str, bytes]:
    return {f"{folder}/{name}": content for name, content in files.items()}


ADAPTER = adapter(8)
# Beside the adapter, what a trainer leaves in its repo: none of it is baked.
ADAPTER_REPO = {**ADAPTER, "README.md": b"# adapter", "training_args.bin": b"t",
                "optimizer.pt": bytes(4 << 20), **under("checkpoint-100", adapter(1))}
# Several adapters, one per folder.
CUSTOMERS = {"customer-a": adapter(4), "customer-b": adapter(16)}
ADAPTERS_REPO = {"README.md": b"", **under("customer-a", CUSTOMERS["customer-a"]),
                 **under("customer-b", CUSTOMERS["customer-b"])}


@pytest.fixture
def adapter_hub(hub, online, no_token, tmp_path, monkeypatch):
    """The local hub serving adapter repos, online; temporary folders in tmp_path/tmp."""
    hub.add_repo("org/adapter", ADAPTER_REPO)
    hub.add_repo("org/adapters", ADAPTERS_REPO)
    hub.add_repo("org/weights-only", {"adapter_model.safetensors": ADAPTER["adapter_model.safetensors"]})
    hub.add_repo("org/gated-adapter", ADAPTER, token="hf_gated")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(download_model.tempfile, "tempdir", str(tmp_path / "tmp"))
    return hub


def adapter_env(tmp_path: Path, adapters: str) -> dict[str, str]:
    return bake_env(tmp_path / "models", tmp_path, LORA_ADAPTERS=adapters)


def baked_files(folder: Path) -> dict[str, bytes]:
    """The files under ``folder``, each a plain file (a symlink would point into a removed cache)."""
    files = [path for path in folder.rglob("*") if not path.is_dir()]
    assert not any(path.is_symlink() for path in files)
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in files}


def test_adapters_are_baked_by_name_with_their_own_files_alone(adapter_hub, tmp_path):
    env = adapter_env(tmp_path, "org/adapter, customer-a=org/adapters/customer-a,org/adapters/customer-b")
    baked = bake(env)
    loras = tmp_path / "models" / "loras"
    assert baked_files(loras) == (under("org/adapter", ADAPTER) | under("customer-a", CUSTOMERS["customer-a"])
                                  | under("org/adapters/customer-b", CUSTOMERS["customer-b"]))
    # Only the adapters' files were downloaded, through a temporary cache that is gone.
    downloaded = sorted(f"{download.repo}/{download.path}" for download in adapter_hub.downloads)
    assert downloaded == sorted(under("org/adapter", ADAPTER) | under("org/adapters", {
        path: content for path, content in ADAPTERS_REPO.items() if path != "README.md"}))
    assert list((tmp_path / "tmp").iterdir()) == []
    # Baked without a model: the file holds the adapters' keys alone.
    assert json.loads(args_file(env).read_text()) == baked == {"BAKED_LORA_DIR": str(loras),
                                                                "ENABLE_LORA": "true"}


def test_the_worker_serves_adapters_baked_without_a_model(adapter_hub, tmp_path):
    env = adapter_env(tmp_path, "customer-a=org/adapters/customer-a")
    bake(env)
    config = load_config({"MODEL_NAME": "org/safetensors", "VLLM_CONFIG_FILE": "/nonexistent",
                          "LOCAL_MODEL_ARGS_FILE": env["LOCAL_MODEL_ARGS_FILE"],
                          "BASE_PATH": str(tmp_path / "volume")})
    assert config.args.engine_args.enable_lora
    adapter = config.adapters.find("customer-a")
    assert (adapter.path, adapter.source) == (tmp_path / "models" / "loras" / "customer-a", "image")


def test_a_model_and_adapters_are_baked_together(build_env, cache):
    """Offline, the adapters come from the local cache, as the model does."""
    add_cached_repo(cache, "org/adapter", ADAPTER_REPO)
    baked = bake(build_env(MODEL_NAME="org/safetensors", LORA_ADAPTERS="org/adapter"))
    assert baked == {"MODEL_NAME": baked["MODEL_NAME"], "BAKED_MODEL_NAME": "org/safetensors",
                     "BAKED_LORA_DIR": str(cache / "loras"), "ENABLE_LORA": "true"}
    assert baked_files(cache / "loras") == under("org/adapter", ADAPTER)


@pytest.mark.parametrize(("adapters", "message"), [
    ("org/adapters/customer-a/v1", r"'org/adapters/customer-a/v1' cannot name an adapter: .*; give it one: "
                                   r"name=org/adapters/customer-a/v1"),
    ("my adapter=org/adapter", r"'my adapter' cannot name an adapter"),
    (".hidden=org/adapter", r"'.hidden' cannot name an adapter"),
    ("a=b=org/adapter", r"'a=b' cannot name an adapter"),
    ("adapter", r"'adapter' is neither a hub repo \(org/repo\) nor a folder in one"),
    ("a=org/adapters/../x", r"'org/adapters/../x' is neither a hub repo"),
    ("a=", r"'' is neither a hub repo"),
    ("a=org/bad--repo", r"'org/bad--repo': Cannot have -- or \.\."),
    ("a=org/adapter,a=org/adapters/customer-a", r"two adapters are named a"),
])
def test_entries_the_worker_could_not_serve_are_refused(adapters, message):
    with pytest.raises(BakeError, match="^LORA_ADAPTERS: " + message):
        adapter_entries(adapters)


def test_a_bad_entry_fails_the_bake_before_any_download(adapter_hub, tmp_path):
    env = adapter_env(tmp_path, "org/adapter,org/adapters/customer-a/v1")
    with pytest.raises(BakeError, match="LORA_ADAPTERS"):
        bake(env)
    assert adapter_hub.requests == [] and not args_file(env).exists()


@pytest.mark.parametrize(("adapters", "message"), [
    ("org/weights-only", r"LoRA adapter org/weights-only \(org/weights-only\): no adapter_config.json there"),
    ("x=org/adapters/customer-c", r"LoRA adapter x \(org/adapters/customer-c\): no adapter_config.json"),
    ("org/adapters", r"LoRA adapter org/adapters \(org/adapters\): no adapter_config.json there; name the "
                     r"folder of the adapter, as org/repo/sub/folder"),
    ("org/absent", r"LoRA adapter org/absent \(org/absent\) does not exist on the Hugging Face hub"),
    ("org/gated-adapter", r"LoRA adapter org/gated-adapter \(org/gated-adapter\) is gated"),
])
def test_an_adapter_that_cannot_be_baked_fails_the_bake_with_a_reason(adapter_hub, tmp_path, adapters,
                                                                       message):
    env = adapter_env(tmp_path, adapters)
    with pytest.raises(BakeError, match=message):
        bake(env)
    assert not args_file(env).exists()


def test_a_gated_adapter_bakes_with_its_token(adapter_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_gated")
    bake(adapter_env(tmp_path, "org/gated-adapter"))
    assert baked_files(tmp_path / "models" / "loras") == under("org/gated-adapter", ADAPTER)
