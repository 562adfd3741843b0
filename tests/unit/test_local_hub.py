"""tests/image/local_hub.py: a local Hugging Face hub that huggingface_hub lists and downloads from,
checked through huggingface_hub itself and through ``src/download_model.py`` run as the image's
build runs it (the token as a file at HF_TOKEN_PATH, like the BuildKit secret).

Tests that need a download in progress throttle the hub and wait for bytes to have gone out, never
for time to pass: a slow machine only makes them wait longer."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx2
import huggingface_hub.constants
import huggingface_hub.file_download
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import hf_raise_for_status

from tests.image.local_hub import INVALID_TOKEN, USER, Download, LocalHub

REPO = Path(__file__).resolve().parents[2]
TOKEN = "hf_local_hub_secret"
OTHER = "hf_someone_else"  # a valid token, of a user without access
REVOKED = "hf_revoked"  # a token the hub does not know

RELEASE = {"config.json": b'{"v": 1}', "tokenizer.json": b'{"tok": 1}', "README.md": b"# v1",
           "model.safetensors": b"weights v1", "pytorch_model.bin": b"bin v1"}
LATEST = {**RELEASE, "config.json": b'{"v": 2}', "model.safetensors": b"weights v2",
          "generation_config.json": b"{}"}
TOKENIZER = {"tokenizer.json": b'{"tok": "other"}', "tokenizer_config.json": b"{}", "README.md": b""}


def bake(hub: LocalHub, tmp_path: Path, token: str | None = None,
         **settings: str) -> subprocess.CompletedProcess[str]:
    """Run download_model.py against ``hub``, online, with no HF_* setting from this environment."""
    token_file = tmp_path / "secrets" / "HF_TOKEN"  # absent when the build is given no token
    if token is not None:
        token_file.parent.mkdir(exist_ok=True)
        token_file.write_text(token)
    env = hub_env(hub, tmp_path) | {
        "HF_TOKEN_PATH": str(token_file), "BAKED_MODELS_DIR": str(tmp_path / "models"),
        "LOCAL_MODEL_ARGS_FILE": str(tmp_path / "local_model_args.json"),
        "MODEL_NAME": "", "MODEL_REVISION": "", "TOKENIZER_NAME": "", "TOKENIZER_REVISION": "",
        "QUANTIZATION": "", **settings}
    return subprocess.run([sys.executable, str(REPO / "src" / "download_model.py")], env=env,
                          capture_output=True, text=True, timeout=120)


def snapshot_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0%s" % (len(content), content)).hexdigest()


def wait_for(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Poll until `condition()` holds: a slow machine makes this slower, never wrong."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def sent_at_least(hub: LocalHub, size: int) -> Callable[[], bool]:
    return lambda: bool(hub.downloads) and hub.downloads[0].sent >= size


def hub_env(hub: LocalHub, tmp_path: Path) -> dict[str, str]:
    """This environment without its HF_* settings (tests/conftest.py sets HF_HUB_OFFLINE and
    TRANSFORMERS_OFFLINE, either of which means offline), online against ``hub``, over plain HTTP."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("HF_", "HUGGING_FACE_"))}
    return env | {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
                  "HF_HOME": str(tmp_path / "hf-home")}


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


@pytest.mark.parametrize("token", [TOKEN, None, OTHER])
def test_a_gated_repo_bakes_with_its_token_only(hub, tmp_path, token):
    hub.add_repo("org/gated", RELEASE, token=TOKEN)
    hub.add_token(OTHER)
    result = bake(hub, tmp_path, token, MODEL_NAME="org/gated")
    asked = [auth for _, path, auth in hub.requests if "org/gated" in path]
    assert asked and all(auth == (token is not None) for auth in asked)
    if token == TOKEN:
        assert result.returncode == 0, result.stderr
        assert json.loads((tmp_path / "local_model_args.json").read_text())["BAKED_MODEL_NAME"] == "org/gated"
        return
    assert result.returncode == 1
    hint = "build with a token" if token is None else "check that the token given can read it"
    assert f"Cannot bake: org/gated (revision main) is gated: accept its terms on " \
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
    assert f"Cannot bake: {message}" in result.stderr


# --- huggingface_hub against the hub -------------------------------------------------------------

def test_a_token_the_hub_refuses_fails_the_build_saying_so(hub, tmp_path):
    hub.add_repo("org/model", RELEASE)
    result = bake(hub, tmp_path, REVOKED, MODEL_NAME="org/model")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "Cannot bake: org/model (revision main): the hub refused the token (invalid or " \
           "revoked): build with a valid read token" in result.stderr


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


def test_revisions_asked_are_each_repos_as_requests_named_them(hub, tmp_path, online):
    release = hub.add_repo("org/model", RELEASE, tags=["v1.0"])
    hub.add_repo("org/tokenizer", TOKENIZER)
    api = HfApi(token=False)
    api.model_info("org/model", revision="v1.0")
    hf_hub_download("ORG/Model", "config.json", revision=release, cache_dir=tmp_path, token=False)
    api.list_repo_files("org/tokenizer")
    with pytest.raises(RevisionNotFoundError):  # asked, though the repo has no such revision
        api.model_info("org/tokenizer", revision="v1.0")
    assert hub.revisions_asked() == {"org/model": {"v1.0", release}, "org/tokenizer": {"main", "v1.0"}}


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
    url = f"{hub.url}/org/model/resolve/main/model.safetensors"
    reply = httpx2.head(url)
    assert reply.status_code == 200
    assert reply.headers["X-Repo-Commit"] == commit
    assert reply.headers["ETag"] == f'"{git_blob_id(weights)}"'
    assert reply.headers["Content-Length"] == str(len(weights))
    assert reply.headers["Accept-Ranges"] == "bytes" and "Content-Range" not in reply.headers
    assert not [name for name in reply.headers if name.lower().startswith("x-xet")]  # plain HTTP
    assert hub.downloads == []  # no body sent
    got = httpx2.get(url)
    assert got.content == weights
    assert {**got.headers, "date": ""} == {**reply.headers, "date": ""}  # HEAD answers as GET does
    assert hub.downloads == [Download("org/model", "main", "model.safetensors", 0, len(weights), True)]


@pytest.mark.parametrize(("repo", "revision", "filename", "token", "error", "status"), [
    ("org/missing", "main", "config.json", False, RepositoryNotFoundError, 401),
    ("org/missing", "main", "config.json", TOKEN, RepositoryNotFoundError, 404),
    ("org/model", "v9", "config.json", False, RevisionNotFoundError, 404),
    ("org/model", "0" * 40, "config.json", False, RevisionNotFoundError, 404),
    ("org/model", "main", "missing.json", False, RemoteEntryNotFoundError, 404),
    ("org/gated", "main", "config.json", False, GatedRepoError, 401),
    ("org/gated", "main", "config.json", OTHER, GatedRepoError, 403),
    ("org/private", "main", "config.json", False, RepositoryNotFoundError, 401),  # as if missing
    ("org/private", "main", "config.json", OTHER, RepositoryNotFoundError, 404),
    ("org/private", "main", "config.json", TOKEN, RepositoryNotFoundError, 404),  # gated's token: not a reader
    # An unknown token fails every request, even for a public repo, and is no RepositoryNotFoundError.
    ("org/model", "main", "config.json", REVOKED, HfHubHTTPError, 401),
    ("org/missing", "main", "config.json", REVOKED, HfHubHTTPError, 401),
])
def test_errors_arrive_as_huggingface_hub_exceptions(hub, tmp_path, online, repo, revision,
                                                     filename, token, error, status):
    hub.add_repo("org/model", RELEASE)
    hub.add_repo("org/gated", RELEASE, token=TOKEN)
    hub.add_repo("org/private", RELEASE, private=True, readers={"hf_reader"})
    hub.add_token(OTHER)
    with pytest.raises(error) as raised:
        hf_hub_download(repo, filename, revision=revision, cache_dir=tmp_path, token=token)
    assert type(raised.value) is error and raised.value.response.status_code == status
    if error is not RemoteEntryNotFoundError:  # the listing and the info fail the same way
        for call in (HfApi(token=token).list_repo_files, HfApi(token=token).model_info):
            with pytest.raises(error) as raised:
                call(repo, revision=revision)
            assert type(raised.value) is error and raised.value.response.status_code == status
    assert hub.downloads == []


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


# --- ranges and resumed downloads ----------------------------------------------------------------

CONTENT = bytes(range(256)) * 4  # 1024 bytes
FILE_URL = "/org/model/resolve/main/model.bin"


@pytest.mark.parametrize(("asked", "start", "end"), [
    ("bytes=0-", 0, 1024),
    ("bytes=1000-", 1000, 1024),  # how huggingface_hub resumes
    ("bytes=10-19", 10, 20),
    ("bytes=1023-1023", 1023, 1024),
    ("bytes=1000-5000", 1000, 1024),  # the end is cut to the file's
    ("bytes=-24", 1000, 1024),  # the last 24 bytes
    ("bytes=-5000", 0, 1024),
])
def test_a_range_gets_206_with_that_part_only(hub, asked, start, end):
    commit = hub.add_repo("org/model", {"model.bin": CONTENT})
    for reply in (httpx2.get(hub.url + FILE_URL, headers={"Range": asked}),
                  httpx2.head(hub.url + FILE_URL, headers={"Range": asked})):
        assert reply.status_code == 206
        assert reply.headers["Content-Range"] == f"bytes {start}-{end - 1}/1024"
        assert reply.headers["Content-Length"] == str(end - start)
        assert reply.headers["Accept-Ranges"] == "bytes"
        assert reply.headers["ETag"] == f'"{git_blob_id(CONTENT)}"' and reply.headers["X-Repo-Commit"] == commit
    assert httpx2.get(hub.url + FILE_URL, headers={"Range": asked}).content == CONTENT[start:end]
    assert hub.downloads == [Download("org/model", "main", "model.bin", start, end - start, True)] * 2


@pytest.mark.parametrize("asked", ["bytes=1024-", "bytes=5000-6000", "bytes=-0"])
def test_a_range_past_the_end_gets_416(hub, asked):
    hub.add_repo("org/model", {"model.bin": CONTENT})
    reply = httpx2.get(hub.url + FILE_URL, headers={"Range": asked})
    assert reply.status_code == 416 and reply.headers["Content-Range"] == "bytes */1024"
    with pytest.raises(HfHubHTTPError) as raised:  # huggingface_hub's own words for a 416
        hf_raise_for_status(reply)
    assert f"Requested range: {asked}. Content-Range: bytes */1024." in str(raised.value)
    assert hub.downloads == []


@pytest.mark.parametrize("asked", ["bytes=20-10", "bytes=0-1,5-6", "items=0-1", "bytes=a-", "bytes=-"])
def test_a_range_a_server_may_ignore_gets_the_whole_file(hub, asked):
    hub.add_repo("org/model", {"model.bin": CONTENT})
    reply = httpx2.get(hub.url + FILE_URL, headers={"Range": asked})
    assert reply.status_code == 200 and reply.content == CONTENT and "Content-Range" not in reply.headers


@pytest.fixture
def retry_waits(monkeypatch) -> list[float]:
    """huggingface_hub waits a second before resuming a download cut short: note the wait instead."""
    waits: list[float] = []
    monkeypatch.setattr(huggingface_hub.file_download, "time", SimpleNamespace(sleep=waits.append))
    return waits


@pytest.mark.parametrize("chunk", [64 << 10, huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE])
def test_a_download_cut_mid_file_resumes_from_the_last_whole_chunk_it_kept(hub, tmp_path, online,
                                                                          retry_waits, monkeypatch, chunk):
    """huggingface_hub writes a body in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB) and, cut short, asks
    for the rest from the end of the last whole one (``Range: bytes=START-``): a smaller chunk makes a
    1 MiB file resume with a range; with the real one, it starts over (without a Range)."""
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", chunk)
    weights = os.urandom(1 << 20)
    hub.add_repo("org/model", {**RELEASE, "model.safetensors": weights})
    hub.bytes_per_second = 512 << 10  # an eighth of the file in a quarter of a second, the rest in 2 s
    with ThreadPoolExecutor(1) as pool:
        download = pool.submit(hf_hub_download, "org/model", "model.safetensors", cache_dir=tmp_path,
                               token=False)
        wait_for(sent_at_least(hub, len(weights) // 8), "an eighth of the file to be sent")
        hub.bytes_per_second = 0  # hold the body where it is, and cut it there
        hub.interrupt()
        hub.bytes_per_second = None
        path = download.result(timeout=60)

    assert Path(path).read_bytes() == weights
    cut, rest = hub.downloads
    assert cut == Download("org/model", "main", "model.safetensors", 0, cut.sent, complete=False)
    assert len(weights) // 8 <= cut.sent < len(weights)
    kept = cut.sent // chunk * chunk  # the client got all that was sent, and wrote the whole chunks
    assert (kept > 0) == (chunk < len(weights) // 8)
    assert rest == Download("org/model", "main", "model.safetensors", kept, len(weights) - kept, complete=True)
    assert retry_waits == [1]


def test_a_download_killed_with_its_process_starts_over(hub, tmp_path, online):
    """huggingface_hub 2.x downloads into a file of its own process's (``<etag>.<8 hex>.incomplete``),
    which a killed process leaves behind: the next download does not resume it, but gets the whole
    file again (only a download cut within one process resumes, as above)."""
    weights = os.urandom(1 << 20)
    hub.add_repo("org/model", {**RELEASE, "model.safetensors": weights})
    cache = tmp_path / "cache"
    script = (f"from huggingface_hub import hf_hub_download\n"
              f"hf_hub_download('org/model', 'model.safetensors', cache_dir={str(cache)!r}, token=False)")
    hub.bytes_per_second = 512 << 10
    process = subprocess.Popen([sys.executable, "-c", script], env=hub_env(hub, tmp_path))
    try:
        wait_for(sent_at_least(hub, len(weights) // 8), "an eighth of the file to be sent")
        hub.bytes_per_second = 0
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    hub.interrupt()
    hub.bytes_per_second = None
    [killed] = hub.downloads
    assert killed.start == 0 and 0 < killed.sent < len(weights) and not killed.complete
    blob = cache / "models--org--model" / "blobs" / git_blob_id(weights)
    [leftover] = blob.parent.glob("*.incomplete")
    assert leftover.name.startswith(f"{blob.name}.") and leftover.stat().st_size <= killed.sent

    path = hf_hub_download("org/model", "model.safetensors", cache_dir=cache, token=False)
    assert Path(path).read_bytes() == weights and Path(path).resolve() == blob
    assert hub.downloads[1:] == [Download("org/model", "main", "model.safetensors", 0, len(weights), True)]
    assert leftover.exists()


# --- the throttle --------------------------------------------------------------------------------

def test_the_throttle_holds_paces_and_lets_go_of_overlapping_downloads(hub):
    files = {"a.bin": os.urandom(1 << 20), "b.bin": os.urandom(1 << 20)}
    hub.add_repo("org/model", files)
    hub.bytes_per_second = 0  # bodies wait after their headers
    with ThreadPoolExecutor(2) as pool:
        fetches = {name: pool.submit(httpx2.get, f"{hub.url}/org/model/resolve/main/{name}", timeout=60)
                   for name in files}
        wait_for(lambda: len(hub.downloads) == 2, "both downloads to start")
        assert [download.sent for download in hub.downloads] == [0, 0]
        hub.bytes_per_second = 1000  # a few bytes a tick each: 17 minutes a file
        wait_for(lambda: all(download.sent for download in hub.downloads), "both to be under way")
        assert not any(download.complete for download in hub.downloads)  # at the same time
        hub.bytes_per_second = None  # the rest at once
        replies = {name: fetch.result(timeout=60) for name, fetch in fetches.items()}
    assert {name: reply.content for name, reply in replies.items()} == files
    assert sorted((d.path, d.sent, d.complete) for d in hub.downloads) == [
        ("a.bin", 1 << 20, True), ("b.bin", 1 << 20, True)]


def test_interrupt_and_stop_cut_bodies_short(hub):
    hub.add_repo("org/model", {"model.bin": CONTENT})
    hub.bytes_per_second = 0
    with ThreadPoolExecutor(1) as pool:
        fetch = pool.submit(httpx2.get, hub.url + FILE_URL, timeout=60)
        wait_for(lambda: hub.downloads, "the download to start")
        hub.interrupt()
        with pytest.raises(httpx2.RemoteProtocolError):  # the body ended before its Content-Length
            fetch.result(timeout=60)
        assert hub.downloads == [Download("org/model", "main", "model.bin", 0, 0, complete=False)]

        fetch = pool.submit(httpx2.get, hub.url + FILE_URL, timeout=60)  # served after an interrupt
        wait_for(lambda: len(hub.downloads) == 2, "the next download to start")
        hub.stop()  # does not wait for the held body: it cuts it
        with pytest.raises(httpx2.RemoteProtocolError):
            fetch.result(timeout=60)


# --- tokens, private repos, file metadata --------------------------------------------------------

@pytest.mark.parametrize("authorization", [f"Bearer {REVOKED}", "Bearer", f"Basic {TOKEN}"])
def test_an_unknown_token_gets_the_hubs_invalid_credentials_answer_everywhere(hub, authorization):
    hub.add_repo("org/model", RELEASE, token=TOKEN)
    for path in ("/org/model/resolve/main/config.json", "/api/models/org/model",
                 "/api/models/org/missing/tree/main", "/api/whoami-v2", "/api/nowhere"):
        reply = httpx2.get(hub.url + path, headers={"Authorization": authorization})
        assert reply.status_code == 401, path
        assert reply.headers["X-Error-Message"] == INVALID_TOKEN and "X-Error-Code" not in reply.headers
        assert reply.json() == {"error": INVALID_TOKEN}


def test_whoami_names_the_user_of_a_valid_token(hub, online):
    hub.add_token("hf_alice", name="alice")
    hub.add_repo("org/gated", RELEASE, token=TOKEN)
    hub.add_repo("org/private", RELEASE, private=True, readers={"hf_reader"})
    me = HfApi().whoami(token="hf_alice")
    assert me["name"] == "alice" and me["type"] == "user"
    assert me["auth"] == {"type": "access_token", "accessToken": {"displayName": "alice", "role": "read"}}
    # The tokens add_repo is given are valid, as some user's.
    assert HfApi().whoami(token=TOKEN)["name"] == HfApi().whoami(token="hf_reader")["name"] == USER
    with pytest.raises(HfHubHTTPError) as raised:
        HfApi().whoami(token=REVOKED)
    assert type(raised.value) is HfHubHTTPError and raised.value.response.status_code == 401
    assert str(raised.value).startswith("Invalid user token.")
    anonymous = httpx2.get(f"{hub.url}/api/whoami-v2")  # (HfApi.whoami refuses to ask without a token)
    assert anonymous.status_code == 401 and anonymous.json() == {"error": "Invalid username or password."}


def test_a_private_repo_is_served_to_its_readers_only(hub, tmp_path, online):
    commit = hub.add_repo("org/private", RELEASE, private=True, readers={"hf_reader"})
    reader = HfApi(token="hf_reader")
    info = reader.model_info("org/private")
    assert info.private is True and info.sha == commit
    assert sorted(reader.list_repo_files("org/private")) == sorted(RELEASE)
    path = snapshot_download("org/private", cache_dir=tmp_path, token="hf_reader")
    assert snapshot_files(Path(path)) == RELEASE
    # (Others get RepositoryNotFoundError: test_errors_arrive_as_huggingface_hub_exceptions.)

    hub.add_repo("org/private", LATEST)  # a new commit leaves it private
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).model_info("org/private")
    hub.add_repo("org/private", LATEST, private=False)
    assert HfApi(token=False).model_info("org/private").private is False


def test_file_metadata_gives_each_files_size_and_blob_id(hub, online):
    release = hub.add_repo("org/model", RELEASE, tags=["v1.0"])
    hub.add_repo("org/model", LATEST)
    api = HfApi(token=False)
    info = api.model_info("org/model", revision="v1.0", files_metadata=True)
    assert hub.requests[-1] == ("GET", "/api/models/org/model/revision/v1.0?blobs=true", False)
    assert info.sha == release and info.private is False
    assert {sibling.rfilename: (sibling.size, sibling.blob_id) for sibling in info.siblings} == {
        name: (len(content), git_blob_id(content)) for name, content in RELEASE.items()}
    plain = api.model_info("org/model")  # as the hub answers it: names only
    assert {sibling.rfilename for sibling in plain.siblings} == set(LATEST)
    assert all(sibling.size is None and sibling.blob_id is None for sibling in plain.siblings)
