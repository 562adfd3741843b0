"""tests/image/local_hub.py: a local Hugging Face hub that huggingface_hub lists and downloads from,
checked through huggingface_hub itself and through ``src/download_model.py`` run as the image's
build runs it (the token as a file at HF_TOKEN_PATH, like the BuildKit secret)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import huggingface_hub.constants
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.image.local_hub import LocalHub

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_local_hub_secret"

RELEASE = {"config.json": b'{"v": 1}', "tokenizer.json": b'{"tok": 1}', "README.md": b"# v1",
           "model.safetensors": b"weights v1", "pytorch_model.bin": b"bin v1"}
LATEST = {**RELEASE, "config.json": b'{"v": 2}', "model.safetensors": b"weights v2",
          "generation_config.json": b"{}"}
TOKENIZER = {"tokenizer.json": b'{"tok": "other"}', "tokenizer_config.json": b"{}", "README.md": b""}


@pytest.fixture
def hub():
    with LocalHub() as hub:
        yield hub


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """huggingface_hub in this process as if started with HF_ENDPOINT at ``hub`` and HF_HUB_OFFLINE=0
    (tests/conftest.py sets it), its agent-registry cache in tmp_path: it asks no other server."""
    for name, value in {"HF_HUB_OFFLINE": False, "ENDPOINT": hub.url,
                        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
                        "AGENT_HARNESSES_PATH": str(tmp_path / "agent_harnesses.json")}.items():
        monkeypatch.setattr(huggingface_hub.constants, name, value)


def bake(hub: LocalHub, tmp_path: Path, token: str | None = None,
         **settings: str) -> subprocess.CompletedProcess[str]:
    """Run download_model.py against ``hub``, online, with no HF_* setting from this environment
    (tests/conftest.py sets HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE, either of which means offline)."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("HF_", "HUGGING_FACE_"))}
    token_file = tmp_path / "secrets" / "HF_TOKEN"  # absent when the build is given no token
    if token is not None:
        token_file.parent.mkdir(exist_ok=True)
        token_file.write_text(token)
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN_PATH": str(token_file), "BAKED_MODELS_DIR": str(tmp_path / "models"),
            "LOCAL_MODEL_ARGS_FILE": str(tmp_path / "local_model_args.json"),
            "MODEL_NAME": "", "MODEL_REVISION": "", "TOKENIZER_NAME": "", "TOKENIZER_REVISION": "",
            "QUANTIZATION": "", **settings}
    return subprocess.run([sys.executable, str(REPO / "src" / "download_model.py")], env=env,
                          capture_output=True, text=True, timeout=120)


def snapshot_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# --- download_model.py against the hub -----------------------------------------------------------

def test_bakes_a_tag_and_a_tokenizer_from_another_repo(hub, tmp_path):
    release = hub.add_repo("org/model", RELEASE, tags=["v1.0"])
    hub.add_repo("org/model", LATEST)  # main moves on; the tag stays
    tokenizer = hub.add_repo("org/tokenizer", TOKENIZER)
    result = bake(hub, tmp_path, MODEL_NAME="org/model", MODEL_REVISION="v1.0",
                  TOKENIZER_NAME="org/tokenizer", TOKENIZER_REVISION="main", QUANTIZATION="fp8")
    assert result.returncode == 0, result.stderr

    models = tmp_path / "models"
    baked = json.loads((tmp_path / "local_model_args.json").read_text())
    assert baked == {
        "MODEL_NAME": str(models / "models--org--model" / "snapshots" / release),
        "BAKED_MODEL_NAME": "org/model",
        "TOKENIZER_NAME": str(models / "models--org--tokenizer" / "snapshots" / tokenizer),
        "BAKED_TOKENIZER_NAME": "org/tokenizer",
        "QUANTIZATION": "fp8",
    }
    # The tag's files, one weight format, no README.
    assert snapshot_files(Path(baked["MODEL_NAME"])) == {
        name: RELEASE[name] for name in ("config.json", "tokenizer.json", "model.safetensors")}
    assert snapshot_files(Path(baked["TOKENIZER_NAME"])) == {
        name: TOKENIZER[name] for name in ("tokenizer.json", "tokenizer_config.json")}
    assert not any(auth for _, _, auth in hub.requests)  # no token given, none sent


@pytest.mark.parametrize("token", [TOKEN, None, "hf_someone_else"])
def test_a_gated_repo_bakes_with_its_token_only(hub, tmp_path, token):
    hub.add_repo("org/gated", RELEASE, token=TOKEN)
    result = bake(hub, tmp_path, token, MODEL_NAME="org/gated")
    asked = [auth for _, path, auth in hub.requests if "org/gated" in path]
    assert asked and all(auth == (token is not None) for auth in asked)
    if token == TOKEN:
        assert result.returncode == 0, result.stderr
        assert json.loads((tmp_path / "local_model_args.json").read_text())["BAKED_MODEL_NAME"] == "org/gated"
        return
    assert result.returncode == 1
    hint = "build with a token" if token is None else "check that the token given can read it"
    assert f"Cannot bake the model: org/gated (revision main) is gated: accept its terms on " \
           f"huggingface.co, then {hint}" in result.stderr
    assert not (tmp_path / "local_model_args.json").exists()


@pytest.mark.parametrize(("model", "revision", "message"), [
    ("org/missing", "", "org/missing (revision main) does not exist on the Hugging Face hub, or is "
                        "private: build with a token"),
    ("org/model", "v9", "org/model (revision v9): no such revision"),
])
def test_unknown_repos_and_revisions_fail_the_build(hub, tmp_path, model, revision, message):
    hub.add_repo("org/model", RELEASE)
    result = bake(hub, tmp_path, MODEL_NAME=model, MODEL_REVISION=revision)
    assert result.returncode == 1
    assert f"Cannot bake the model: {message}" in result.stderr


# --- huggingface_hub against the hub -------------------------------------------------------------

def test_each_revision_serves_its_own_commit(hub, tmp_path, online):
    release = hub.add_repo("org/model", RELEASE, tags=["v1.0"])
    latest = hub.add_repo("org/model", LATEST)
    assert release != latest and len(release) == 40
    assert hub.add_repo("org/model", LATEST) == latest  # the same content, the same commit
    for revision, files in [("v1.0", RELEASE), (release, RELEASE), ("main", LATEST), (latest, LATEST)]:
        path = hf_hub_download("org/model", "config.json", revision=revision, cache_dir=tmp_path,
                               token=False)
        assert Path(path).read_bytes() == files["config.json"]
        assert Path(path).parent.name == (release if files is RELEASE else latest)
    api = HfApi(token=False)
    assert sorted(api.list_repo_files("org/model", revision="v1.0")) == sorted(RELEASE)
    assert sorted(api.list_repo_files("org/model")) == sorted(LATEST)


def test_listing_follows_pages_and_folders(hub, online):
    hub.page_size = 2
    files = {"config.json": b"{}", "a/b/c.json": b"c", "a/d.txt": b"d", "e.bin": b"e"}
    hub.add_repo("gpt2", files)  # a repo id without an org
    api = HfApi(token=False)
    assert sorted(api.list_repo_files("gpt2")) == sorted(files)
    pages = [path for _, path, _ in hub.requests if "/tree/" in path]
    # 6 entries, 2 a page: a, a/b, a/b/c.json | a/d.txt, config.json | e.bin
    assert len(pages) == 3 and pages[-1].endswith("cursor=4")
    top = {entry.path: type(entry).__name__ for entry in api.list_repo_tree("gpt2")}
    assert top == {"a": "RepoFolder", "config.json": "RepoFile", "e.bin": "RepoFile"}
    assert {entry.path for entry in api.list_repo_tree("gpt2", "a")} == {"a/b", "a/d.txt"}
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree("gpt2", "nowhere"))


def test_files_on_disk_are_streamed(hub, tmp_path, online):
    weights = tmp_path / "big.safetensors"
    weights.write_bytes(os.urandom(3 << 20) + b"end")  # several of the server's chunks
    hub.add_repo("org/big", {"config.json": b"{}", "model.safetensors": weights})
    path = snapshot_download("org/big", cache_dir=tmp_path / "cache", token=False,
                             allow_patterns=["*.safetensors"])
    assert snapshot_files(Path(path)) == {"model.safetensors": weights.read_bytes()}


def test_resolve_answers_with_the_headers_huggingface_hub_reads(hub):
    commit = hub.add_repo("org/model", RELEASE)
    weights = RELEASE["model.safetensors"]
    reply = httpx2.head(f"{hub.url}/org/model/resolve/main/model.safetensors")
    assert reply.status_code == 200
    assert reply.headers["X-Repo-Commit"] == commit
    git_blob_id = hashlib.sha1(b"blob %d\0%s" % (len(weights), weights)).hexdigest()
    assert reply.headers["ETag"] == f'"{git_blob_id}"'
    assert reply.headers["Content-Length"] == str(len(weights))
    assert not [name for name in reply.headers if name.lower().startswith("x-xet")]  # plain HTTP


@pytest.mark.parametrize(("repo", "revision", "filename", "token", "error", "status"), [
    ("org/missing", "main", "config.json", False, RepositoryNotFoundError, 401),
    ("org/missing", "main", "config.json", TOKEN, RepositoryNotFoundError, 404),
    ("org/model", "v9", "config.json", False, RevisionNotFoundError, 404),
    ("org/model", "0" * 40, "config.json", False, RevisionNotFoundError, 404),
    ("org/model", "main", "missing.json", False, EntryNotFoundError, 404),
    ("org/gated", "main", "config.json", False, GatedRepoError, 401),
    ("org/gated", "main", "config.json", "hf_someone_else", GatedRepoError, 403),
])
def test_errors_arrive_as_huggingface_hub_exceptions(hub, tmp_path, online, repo, revision,
                                                     filename, token, error, status):
    hub.add_repo("org/model", RELEASE)
    hub.add_repo("org/gated", RELEASE, token=TOKEN)
    with pytest.raises(error) as raised:
        hf_hub_download(repo, filename, revision=revision, cache_dir=tmp_path, token=token)
    assert raised.value.response.status_code == status
    if error is not EntryNotFoundError:  # the listing fails the same way
        with pytest.raises(error):
            HfApi(token=token).list_repo_files(repo, revision=revision)


def test_stop_refuses_later_requests_and_requests_are_recorded(hub, tmp_path, online):
    commit = hub.add_repo("org/model", RELEASE, token=TOKEN)
    path = hf_hub_download("org/model", "config.json", cache_dir=tmp_path, token=TOKEN)
    assert Path(path).read_bytes() == RELEASE["config.json"] and commit in Path(path).parts
    assert hub.requests[-2:] == [("HEAD", "/org/model/resolve/main/config.json", True),
                                 ("GET", "/org/model/resolve/main/config.json", True)]
    asked = len(hub.requests)

    hub.stop()
    with pytest.raises(LocalEntryNotFoundError) as raised:  # nothing of it cached: the hub was needed
        snapshot_download("org/model", cache_dir=tmp_path / "after", token=TOKEN)
    assert isinstance(raised.value.__cause__, httpx2.ConnectError)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", urlsplit(hub.url).port), timeout=5)
    assert len(hub.requests) == asked
