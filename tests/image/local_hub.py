"""A local Hugging Face hub: the part of the hub's HTTP API that huggingface_hub uses to list and
download model repos, served from memory and disk on 127.0.0.1 (point ``HF_ENDPOINT`` at ``url``).

Implemented, as huggingface_hub 2.x calls it and with the headers it reads:

- ``GET /api/models/{repo}[/revision/{revision}]``: the repo's info (``sha``, ``private``, ``gated``,
  ``siblings``), which ``snapshot_download`` uses to resolve a branch or tag to a commit; with
  ``?blobs=true`` (``model_info(files_metadata=True)``) each sibling also has its ``size`` and
  ``blobId``;
- ``GET /api/models/{repo}/tree/{revision}[/{folder}]?recursive=``: the listing behind
  ``list_repo_files`` and ``snapshot_download``, paged as the hub does (``page_size`` entries, the
  next page's URL in a ``Link: <…>; rel="next"`` header; here the cursor is an offset);
- ``HEAD``/``GET /{repo}/resolve/{revision}/{path}``: a file, with ``X-Repo-Commit`` (the commit the
  revision names), ``ETag`` (the file's git blob id, which names the blob in the cache),
  ``Content-Length`` and ``Accept-Ranges: bytes``, and no Xet headers, so clients download over plain
  HTTP. One range (``Range: bytes=START-``, ``bytes=START-END``, ``bytes=-SUFFIX``) gets a 206 with
  ``Content-Range: bytes START-END/SIZE``, which is how huggingface_hub resumes a download cut
  short; a range starting at or after the end gets a 416 with ``Content-Range: bytes */SIZE``, as
  the hub's CDN answers; several ranges, another unit or a malformed range get the whole file (200),
  as servers may answer. File bodies go at ``bytes_per_second`` (unthrottled when None), each is
  logged in ``downloads`` (a ``Download`` per GET, filled in as bytes go), and ``interrupt()`` cuts
  those in progress short, as a dropped connection would;
- ``api_delay``: seconds each answer about a repo waits before it goes, as a slow hub's would;
- ``GET /api/whoami-v2``: the user a token belongs to (``name``, ``auth.accessToken``), as
  ``HfApi().whoami()`` reads it;
- tokens: only known ones are valid (``add_token``; a gated repo's token and a private repo's readers
  are known), and an unknown ``Authorization: Bearer`` token fails any request with 401 ``Invalid
  credentials in Authorization header`` (header and body), as the hub fails a revoked token even
  for a public repo; huggingface_hub raises that as a plain ``HfHubHTTPError``, not as
  ``RepositoryNotFoundError``;
- errors as the hub reports them, by status and ``X-Error-Code``/``X-Error-Message`` headers (and a
  JSON ``{"error": …}`` body), which huggingface_hub raises as its own exceptions: ``RepoNotFound``
  (401 to an anonymous request, 404 to one with a token, for a missing repo and for a private one
  the token may not read), ``RevisionNotFound`` (404), ``EntryNotFound`` (404, with
  ``X-Repo-Commit``) and ``GatedRepo`` (401 without a token, 403 with another token than the repo's);
- ``GET /api/agent-harnesses``: an empty registry of AI agents, which huggingface_hub fetches once
  to build its user agent (best effort: a 404 would do too, but would show in every run's log).

Every request is recorded (``requests``); ``revisions_asked`` reads from them which revision each
repo was asked at. A repo id is matched in any case, as the hub matches it, and the repo's info
answers with its own spelling (``id``). A revision is a branch, a tag or a full commit sha; every
commit keeps its own files. Deliberately left out: datasets and spaces, organizations, token roles
and fine-grained scopes, uploads and every other endpoint (404), LFS metadata (``lfs`` in siblings
and trees) and CDN redirects, Xet, multi-range (``multipart/byteranges``) answers and ``expand``ed
metadata. The server speaks HTTP/1.0, one request per connection, so after ``stop`` no kept-alive
connection can still answer.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, NoReturn
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

__all__ = ["Download", "LocalHub"]

CHUNK = 1 << 20  # files on disk are hashed and sent this many bytes at a time (at most)
TICK = 0.02  # a throttled body goes out in one chunk per tick, so a new rate applies within a tick
USER = "local-user"  # the user a token belongs to unless add_token names another
# A repo id is "name" or "org/name"; huggingface_hub percent-encodes a revision, and a tree's folder,
# into one path segment, and a file's path segment by segment.
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
API_ROUTE = re.compile(
    rf"/api/models/{_REPO}(?:/(?P<kind>revision|tree)/(?P<revision>[^/]+)(?P<folder>/[^/]+)?)?")
RESOLVE_ROUTE = re.compile(rf"/{_REPO}/resolve/(?P<revision>[^/]+)/(?P<path>.+)")
RANGE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.IGNORECASE)  # one range; as huggingface_hub
INVALID_TOKEN = "Invalid credentials in Authorization header"  # the hub's words, which huggingface_hub tests


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

    def open(self) -> BinaryIO:
        return self.content.open("rb") if isinstance(self.content, Path) else io.BytesIO(self.content)


@dataclass
class _Repo:
    commits: dict[str, dict[str, _Blob]] = field(default_factory=dict)  # sha → path → file
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag → sha
    token: str | None = None  # gated: only this token may read it
    private: bool = False  # only `readers` may see it
    readers: set[str] = field(default_factory=set)


@dataclass
class Download:
    """A file body the hub sent (one per resolve GET that got one), updated as its bytes go out, so a
    test can wait for a download to be half-way, then check what was sent and from where."""

    repo: str
    revision: str  # as the request named it (a branch, a tag or a sha)
    path: str
    start: int  # the first byte sent: 0 unless a Range asked for a later one
    sent: int = 0  # bytes of the body handed to the connection so far (counted before each write)
    complete: bool = False  # the whole body (the range, if one was asked) was handed over


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, dict(headers or {})


class LocalHub:
    """Model repos served over the hub's HTTP API; ``with LocalHub() as hub:`` starts and stops it."""

    page_size = 1000  # tree entries per page, as the hub lists them

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[tuple[str, str, bool]] = []  # (method, path, had Authorization)
        # Pace of file bodies, read before each chunk: None sends them as fast as possible, 0 holds
        # them (after their headers) until it changes or `interrupt` cuts them.
        self.bytes_per_second: float | None = None
        # Seconds each answer about a repo (its info or tree) waits before it goes: a slow hub.
        self.api_delay = 0.0
        self.downloads: list[Download] = []  # appended when a body starts, in order
        self._repos: dict[str, _Repo] = {}
        self._tokens: dict[str, str] = {}  # valid token → its user's name
        self._cut = threading.Condition()  # notified by `interrupt`, which bumps `_cuts`
        self._cuts = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def add_repo(self, repo_id: str, files: Mapping[str, bytes | Path], *, revision: str = "main",
                 tags: Iterable[str] = (), token: str | None = None, private: bool | None = None,
                 readers: Iterable[str] = ()) -> str:
        """Add (or add a new commit to) a model repo; returns the commit sha (40 hex chars, derived
        deterministically from the content). `revision` is the branch the commit is on; `tags` name
        the same commit; `token` makes the repo gated: only `Authorization: Bearer <token>` may read it.
        `private=True` hides the repo from every request but those with a token of `readers` (None
        leaves it as it was: public for a new repo). Tokens given here become valid (see add_token).
        Files given as Path are served from disk, streamed (they must not change afterwards)."""
        blobs = {path: _Blob.of(content) for path, content in files.items()}
        listing = "".join(f"{path}\0{blob.oid}\n" for path, blob in sorted(blobs.items()))
        sha = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        repo = self._repos.setdefault(self.spelling(repo_id), _Repo())
        repo.commits[sha] = blobs
        for ref in (revision, *tags):
            repo.refs[ref] = sha
        if token is not None:
            repo.token = token
        if private is not None:
            repo.private = private
        repo.readers.update(readers)
        for known in (token, *readers):
            if known is not None:
                self._tokens.setdefault(known, USER)
        return sha

    def spelling(self, repo_id: str) -> str:
        """The repo's id as it was added (``repo_id`` itself for a repo not added)."""
        return next((known for known in self._repos if known.casefold() == repo_id.casefold()), repo_id)

    def revisions_asked(self) -> dict[str, set[str]]:
        """The revisions each repo was asked at, as requests named them (a branch, a tag or a commit;
        ``main`` for a repo's info without one), by the repo's id as added: which pin reached which repo."""
        asked: dict[str, set[str]] = {}
        for _, path, _ in self.requests:
            url = urlsplit(path).path
            if route := API_ROUTE.fullmatch(url) or RESOLVE_ROUTE.fullmatch(url):
                revision = unquote(route["revision"] or "main")
                asked.setdefault(self.spelling(route["repo"]), set()).add(revision)
        return asked

    def add_token(self, token: str, *, name: str = USER) -> None:
        """Make `token` valid, as the token of user `name` (what whoami answers). Any other token is
        refused as the hub refuses a revoked or mistyped one, so a test can tell "no access" (a valid
        token without rights: 403/404) from "bad token" (401)."""
        self._tokens[token] = name

    def interrupt(self) -> None:
        """Cut every file body being sent, at its next chunk, as a dropped connection would: the
        client gets fewer bytes than the Content-Length it was promised, then end of stream. Later
        requests are served as usual (so a client may resume with a Range request)."""
        with self._cut:
            self._cuts += 1
            self._cut.notify_all()

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
        """Close the listening socket: later requests are refused; bodies still being sent (a
        throttled or held download) are cut, so that no handler thread outlives the hub for long."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self.interrupt()
        assert self._thread is not None
        self._thread.join()
        self._server = self._thread = None

    def _wait_unless_cut(self, cuts: int, timeout: float) -> bool:
        """Wait `timeout` seconds; True (at once) if `interrupt` was called since `cuts` was read."""
        with self._cut:
            return self._cut.wait_for(lambda: self._cuts != cuts, timeout)

    def __enter__(self) -> LocalHub:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _flag(query: Mapping[str, list[str]], name: str) -> bool:
    """A boolean query parameter as huggingface_hub sends it (``true``) or a user types it."""
    return query.get(name, ["false"])[0].lower() in ("true", "1")


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The bytes [start, end) that a Range header asks of a file of `size` bytes; None for the whole
    file: no header, or one a server may ignore (several ranges, another unit, last < first). Raises
    the 416 the hub's CDN answers when the range starts at or after the end of the file."""
    match = RANGE.fullmatch(header) if header else None
    if match is None or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:  # a suffix: the last `last` bytes (all of them if the file is shorter)
        if size == 0:  # no byte to name: the whole (empty) file
            return None
        if int(last) == 0:
            _unsatisfiable(size)
        return max(size - int(last), 0), size
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        _unsatisfiable(size)
    return start, min(int(last) + 1 if last else size, size)


def _unsatisfiable(size: int) -> NoReturn:
    raise _HubError(416, None, "Requested Range Not Satisfiable", {"Content-Range": f"bytes */{size}"})


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
            token = self._token()
            if route := API_ROUTE.fullmatch(url.path):
                self._api(route, url.path, parse_qs(url.query), with_body)
            elif route := RESOLVE_ROUTE.fullmatch(url.path):
                self._resolve(route, with_body)
            elif url.path == "/api/whoami-v2":
                self._whoami(token, with_body)
            elif url.path == "/api/agent-harnesses":
                self._json({"standardEnvVars": [], "harnesses": {}}, with_body)
            else:
                raise _HubError(404, None, "Not Found")
        except _HubError as error:
            headers = {"Content-Type": "application/json", "X-Error-Message": error.message, **error.headers}
            if error.code is not None:
                headers["X-Error-Code"] = error.code
            self._send(error.status, headers, json.dumps({"error": error.message}).encode(), with_body)

    def _token(self) -> str | None:
        """The request's token, if it has one: an unknown token (or another scheme than Bearer) fails
        the whole request, whatever it asks, as the hub fails it."""
        authorization = self.headers.get("Authorization")
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or token.strip() not in self.hub._tokens:
            raise _HubError(401, None, INVALID_TOKEN)
        return token.strip()

    def _api(self, route: re.Match[str], path: str, query: dict[str, list[str]], with_body: bool) -> None:
        if self.hub.api_delay and self.hub._wait_unless_cut(self.hub._cuts, self.hub.api_delay):
            return  # the hub stopped meanwhile
        repo_id, revision = self.hub.spelling(route["repo"]), unquote(route["revision"] or "main")
        files, commit = self._files(repo_id, revision)
        if route["kind"] == "tree":
            self._tree(files, unquote(route["folder"] or "/")[1:], path, query, with_body)
            return
        repo = self.hub._repos[repo_id]
        blobs = _flag(query, "blobs")  # model_info(files_metadata=True)
        siblings = [{"rfilename": name, **({"blobId": blob.oid, "size": blob.size} if blobs else {})}
                    for name, blob in sorted(files.items())]
        self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                    "gated": "manual" if repo.token else False, "disabled": False, "tags": [],
                    "siblings": siblings}, with_body)

    def _resolve(self, route: re.Match[str], with_body: bool) -> None:
        revision, path = unquote(route["revision"]), unquote(route["path"])
        files, commit = self._files(route["repo"], revision)
        blob = files.get(path)
        if blob is None:
            raise _HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        span = _byte_range(self.headers.get("Range"), blob.size)
        start, end = span or (0, blob.size)
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{blob.oid}"',
                   "X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
        self._head(206 if span else 200, headers, end - start)
        if with_body:
            download = Download(route["repo"], revision, path, start)
            self.hub.downloads.append(download)
            self._stream(blob, start, end, download)

    def _whoami(self, token: str | None, with_body: bool) -> None:
        """The token's user, in the shape of the hub's answer; a request without a token gets the
        hub's 401 (an invalid one never gets here)."""
        if token is None:
            raise _HubError(401, None, "Invalid username or password.")
        name = self.hub._tokens[token]
        self._json({"type": "user", "id": hashlib.sha1(name.encode()).hexdigest()[:24], "name": name,
                    "fullname": name, "isPro": False, "canPay": False, "orgs": [],
                    "auth": {"type": "access_token", "accessToken": {"displayName": name, "role": "read"}}},
                   with_body)

    def _files(self, repo_id: str, revision: str) -> tuple[dict[str, _Blob], str]:
        """The files of ``repo_id`` at ``revision`` and its commit, if this request may read them."""
        repo = self.hub._repos.get(self.hub.spelling(repo_id))
        token = self._token()
        if repo is None or (repo.private and token not in repo.readers):
            # 401 when anonymous, as for a private repo, so as not to tell missing and private apart
            raise _HubError(404 if token else 401, "RepoNotFound", "Repository not found")
        if repo.token is not None and token != repo.token:
            if token is None:
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
        recursive = _flag(query, "recursive")
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
        self._send(200, {"Content-Type": "application/json", **(headers or {})}, json.dumps(data).encode(),
                   with_body)

    def _send(self, status: int, headers: Mapping[str, str], body: bytes, with_body: bool) -> None:
        self._head(status, headers, len(body))
        if with_body:
            try:
                self.wfile.write(body)
            except ConnectionError:  # the client went away
                pass

    def _head(self, status: int, headers: Mapping[str, str], length: int) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(length)}.items():
            self.send_header(name, value)
        self.end_headers()

    def _stream(self, blob: _Blob, start: int, end: int, download: Download) -> None:
        """Send bytes [start, end) of the file, chunk by chunk at the hub's pace, counting them in
        `download`; stop short (the connection then closes before its Content-Length) when the client
        goes away or `interrupt` is called."""
        pace = _Pace(self.hub)
        download.complete = start == end  # an empty body is sent whole
        with blob.open() as f:
            f.seek(start)
            while download.sent < end - start:
                size = pace.next_chunk(end - start - download.sent)
                if size == 0:  # interrupted
                    return
                # Counted before the write, so that a client that has the bytes finds them counted.
                download.sent += size
                download.complete = download.sent == end - start
                try:
                    self.wfile.write(f.read(size))
                except ConnectionError:  # the client went away mid-download
                    download.complete = False
                    return


class _Pace:
    """The size of a body's next chunk, after waiting as ``bytes_per_second`` asks: throttled, one
    chunk a tick carries the bytes earned at the current rate (a rate below one byte a tick saves up),
    so a test that changes the rate sees it apply within a tick."""

    def __init__(self, hub: LocalHub) -> None:
        self.hub, self.cuts, self.credit = hub, hub._cuts, 0.0

    def next_chunk(self, left: int) -> int:
        """How many bytes to send now (at most `left`); 0 once the hub interrupts the body."""
        while self.hub._cuts == self.cuts:
            rate = self.hub.bytes_per_second
            if rate is None:
                return min(left, CHUNK)
            if self.credit >= 1:
                size = min(left, int(self.credit), CHUNK)
                self.credit -= size
                return size
            if self.hub._wait_unless_cut(self.cuts, TICK):
                break
            self.credit = min(self.credit + max(rate, 0.0) * TICK, CHUNK)
        return 0
