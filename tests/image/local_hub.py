"""A local Hugging Face hub: the part of the hub's HTTP API that huggingface_hub uses to list and
download model repos, served from memory and disk on 127.0.0.1 (point ``HF_ENDPOINT`` at ``url``).

Implemented, as huggingface_hub 2.x calls it and with the headers it reads:

- ``GET /api/models/{repo}[/revision/{revision}]``: the repo's info (``sha``, ``siblings``), which
  ``snapshot_download`` uses to resolve a branch or tag to a commit;
- ``GET /api/models/{repo}/tree/{revision}[/{folder}]?recursive=``: the listing behind
  ``list_repo_files`` and ``snapshot_download``, paged as the hub does (``page_size`` entries, the
  next page's URL in a ``Link: <…>; rel="next"`` header; here the cursor is an offset);
- ``HEAD``/``GET /{repo}/resolve/{revision}/{path}``: a file, with ``X-Repo-Commit`` (the commit the
  revision names), ``ETag`` (the file's git blob id, which names the blob in the cache) and
  ``Content-Length``, and no Xet headers, so clients download over plain HTTP;
- errors as the hub reports them, by status and ``X-Error-Code``/``X-Error-Message`` headers (and a
  JSON ``{"error": …}`` body), which huggingface_hub raises as its own exceptions: ``RepoNotFound``
  (401 to an anonymous request, 404 to one with a token), ``RevisionNotFound`` (404),
  ``EntryNotFound`` (404, with ``X-Repo-Commit``) and ``GatedRepo`` (401 without a token, 403 with
  another token than the repo's);
- ``GET /api/agent-harnesses``: an empty registry of AI agents, which huggingface_hub fetches once
  to build its user agent (best effort: a 404 would do too, but would show in every run's log).

A revision is a branch, a tag or a full commit sha; every commit keeps its own files. Deliberately
left out: datasets and spaces, private repos, uploads and every other endpoint (404), LFS metadata
and CDN redirects, Xet, ``Range`` requests (a resumed download gets the whole file again, which
huggingface_hub handles) and ``expand``ed tree metadata. The server speaks HTTP/1.0, one request
per connection, so after ``stop`` no kept-alive connection can still answer.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

__all__ = ["LocalHub"]

CHUNK = 1 << 20  # files on disk are hashed and sent this many bytes at a time
# A repo id is "name" or "org/name"; huggingface_hub percent-encodes a revision, and a tree's folder,
# into one path segment, and a file's path segment by segment.
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
API_ROUTE = re.compile(
    rf"/api/models/{_REPO}(?:/(?P<kind>revision|tree)/(?P<revision>[^/]+)(?P<folder>/[^/]+)?)?")
RESOLVE_ROUTE = re.compile(rf"/{_REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)")


@dataclass(frozen=True)
class _Blob:
    content: bytes | Path
    size: int
    oid: str  # git's blob id: sha1 of b"blob <size>\0" + content

    @classmethod
    def of(cls, content: bytes | Path) -> _Blob:
        size = content.stat().st_size if isinstance(content, Path) else len(content)
        sha = hashlib.sha1(f"blob {size}\0".encode())
        if isinstance(content, Path):
            with content.open("rb") as f:
                while chunk := f.read(CHUNK):
                    sha.update(chunk)
        else:
            sha.update(content)
        return cls(content, size, sha.hexdigest())


@dataclass
class _Repo:
    commits: dict[str, dict[str, _Blob]] = field(default_factory=dict)  # sha → path → file
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag → sha
    token: str | None = None  # gated: only this token may read it


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class LocalHub:
    """Model repos served over the hub's HTTP API; ``with LocalHub() as hub:`` starts and stops it."""

    page_size = 1000  # tree entries per page, as the hub lists them

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[tuple[str, str, bool]] = []  # (method, path, had Authorization)
        self._repos: dict[str, _Repo] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add_repo(self, repo_id: str, files: Mapping[str, bytes | Path], *, revision: str = "main",
                 tags: Iterable[str] = (), token: str | None = None) -> str:
        """Add (or add a new commit to) a model repo; returns the commit sha (40 hex chars, derived
        deterministically from the content). `revision` is the branch the commit is on; `tags` name
        the same commit; `token` makes the repo gated: only `Authorization: Bearer <token>` may read it.
        Files given as Path are served from disk, streamed (they must not change afterwards)."""
        blobs = {path: _Blob.of(content) for path, content in files.items()}
        listing = "".join(f"{path}\0{blob.oid}\n" for path, blob in sorted(blobs.items()))
        sha = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        repo = self._repos.setdefault(repo_id, _Repo())
        repo.commits[sha] = blobs
        for ref in (revision, *tags):
            repo.refs[ref] = sha
        if token is not None:
            repo.token = token
        return sha

    def start(self) -> str:
        """Serve on a free port of 127.0.0.1; returns the base URL (also ``url``)."""
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        return self.url

    def stop(self) -> None:
        """Close the listening socket: later requests are refused."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join()
        self._server = self._thread = None

    def __enter__(self) -> LocalHub:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub  # set on the subclass each server uses

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self._serve(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server API
        self._serve(with_body=False)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - keep test output clean
        pass

    def _serve(self, with_body: bool) -> None:
        self.hub.requests.append((self.command, self.path, "Authorization" in self.headers))
        url = urlsplit(self.path)
        try:
            if route := API_ROUTE.fullmatch(url.path):
                repo_id, revision = route["repo"], unquote(route["revision"] or "main")
                files, commit = self._files(repo_id, revision)
                if route["kind"] == "tree":
                    folder = unquote(route["folder"] or "/")[1:]
                    self._tree(files, folder, url.path, parse_qs(url.query), with_body)
                else:
                    self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                "gated": "manual" if self.hub._repos[repo_id].token else False,
                                "disabled": False, "tags": [],
                                "siblings": [{"rfilename": path} for path in sorted(files)]}, with_body)
            elif route := RESOLVE_ROUTE.fullmatch(url.path):
                files, commit = self._files(route["repo"], unquote(route["revision"]))
                blob = files.get(unquote(route["path"]))
                if blob is None:
                    raise _HubError(404, "EntryNotFound", "Entry not found", commit)
                self._send(200, {"Content-Type": "application/octet-stream",
                                 "ETag": f'"{blob.oid}"', "X-Repo-Commit": commit},
                           blob.content, blob.size, with_body)
            elif url.path == "/api/agent-harnesses":
                self._json({"standardEnvVars": [], "harnesses": {}}, with_body)
            else:
                raise _HubError(404, None, "Not Found")
        except _HubError as error:
            headers = {"Content-Type": "application/json", "X-Error-Message": error.message}
            if error.code is not None:
                headers["X-Error-Code"] = error.code
            if error.commit is not None:
                headers["X-Repo-Commit"] = error.commit
            body = json.dumps({"error": error.message}).encode()
            self._send(error.status, headers, body, len(body), with_body)

    def _files(self, repo_id: str, revision: str) -> tuple[dict[str, _Blob], str]:
        """The files of ``repo_id`` at ``revision`` and its commit, if this request may read them."""
        repo = self.hub._repos.get(repo_id)
        authorization = self.headers.get("Authorization")
        if repo is None:  # anonymous: 401, as for a private repo, so as not to tell the two apart
            raise _HubError(404 if authorization else 401, "RepoNotFound", "Repository not found")
        if repo.token is not None and authorization != f"Bearer {repo.token}":
            if authorization is None:
                raise _HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must "
                                "have access to it and be authenticated to access it. Please log in.")
            raise _HubError(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are "
                            f"not in the authorized list. Visit {self.hub.url}/{repo_id} to ask for access.")
        commit = repo.refs.get(revision, revision)
        if commit not in repo.commits:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo.commits[commit], commit

    def _tree(self, files: Mapping[str, _Blob], folder: str, path: str,
              query: dict[str, list[str]], with_body: bool) -> None:
        """The folder's files and sub-folders (all below it when ``recursive``), one page of them."""
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        prefix = f"{folder}/" if folder else ""
        entries: dict[str, dict[str, object]] = {}
        for name, blob in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way (only the first unless recursive)
                sub = prefix + "/".join(parts[:depth])
                entries.setdefault(sub, {"type": "directory", "path": sub, "size": 0,
                                         "oid": hashlib.sha1(sub.encode()).hexdigest()})
                if not recursive:
                    break
            if recursive or len(parts) == 1:
                entries[name] = {"type": "file", "path": name, "size": blob.size, "oid": blob.oid}
        if folder and not entries:
            raise _HubError(404, "EntryNotFound", f"{folder} does not exist")
        start = int(query.get("cursor", ["0"])[0])
        end = start + self.hub.page_size
        headers = {}
        if end < len(entries):
            params = urlencode({**{key: values[0] for key, values in query.items()}, "cursor": end})
            headers["Link"] = f'<{self.hub.url}{path}?{params}>; rel="next"'
        self._json(list(entries.values())[start:end], with_body, headers)

    def _json(self, data: object, with_body: bool, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self._send(200, {"Content-Type": "application/json", **(headers or {})}, body, len(body),
                   with_body)

    def _send(self, status: int, headers: Mapping[str, str], content: bytes | Path, size: int,
              with_body: bool) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(size)}.items():
            self.send_header(name, value)
        self.end_headers()
        if not with_body:
            return
        try:
            if isinstance(content, Path):
                with content.open("rb") as f:
                    shutil.copyfileobj(f, self.wfile, CHUNK)
            else:
                self.wfile.write(content)
        except ConnectionError:  # the client went away mid-download
            pass
