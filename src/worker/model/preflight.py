"""Preflight: the model's repos checked on the Hugging Face hub and downloaded into its cache before
vLLM is imported (huggingface_hub only), so that a mistyped name, a missing token or a full volume
is answered in seconds, naming the variable to change.

For a repo id (not a local folder, not the image's baked copy) ``prepare`` makes, per repo (the
model, and the tokenizer when it comes from another repo or revision):

1. one ``model_info`` call (bounded by MODEL_PREFLIGHT_TIMEOUT): the repo exists at the revision,
   the token may read it (a gated repo and a private or missing one are told apart; a refused token
   is checked with ``whoami``), and the file list with sizes;
2. the file choice of a baked image (``download_model.select_files``: configs, tokenizer files, one
   weight format) and a free-space check on the cache's disk (the network volume, ``BASE_PATH``),
   counting what is already there;
3. ``snapshot_download`` into the Hugging Face cache (``HF_HOME``; on the volume in the image),
   logging its progress, which the start-up watchdog reads too (``on_phase``). huggingface_hub
   locks each file while it downloads it, so workers of one endpoint starting together download
   each file once and wait for each other. A file that a killed worker left half-downloaded is
   resumed where it stopped (``_resume``: huggingface_hub 2.x gives each download a file of its own
   and starts a later one from zero).

With ``HF_HUB_OFFLINE=1`` the repos are taken from the cache, without the hub. vLLM is then given
the local snapshots, so it needs no hub either and serves exactly the revision checked here.
A hub that cannot be reached, or that fails mid-download, is a transient ``StartupError``: the
caller tries once more.

A failure's message names the variable to change and says what happened in words; the cache's
path, a mirror's address (``HF_ENDPOINT``, which may carry credentials) and the exception's own text
are its ``detail``, which only the log gets.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client
import huggingface_hub
from huggingface_hub import HfApi, constants, hf_hub_url, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionResolutionError
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers

from worker.model.download_model import select_files
from worker.model.hub_errors import (
    HUB_ERRORS,
    HubFailure,
    endpoint_detail,
    http_status,
    hub_failure,
    hub_name,
    hub_url,
)
from worker.wire.errors import StartupError

log = logging.getLogger(__name__)

__all__ = ["Fetched", "ModelRequest", "prepare"]

PROGRESS_SECONDS = 5.0  # a download logs its progress this often
READ_ONLY = "the cache is read-only"  # why a repo is taken from the cache without the hub
GB = 1e9

# Told of each step: ("preflight") before a repo's checks, ("download", bytes so far) before its
# download (``startup/watchdog.Watchdog.enter``).
OnPhase = Callable[..., None]


def _no_phases(*_: object) -> None:
    return None


@dataclass(frozen=True)
class RepoRequest:
    """One repo to fetch, and the variables that named it and its revision (for messages)."""

    repo: str
    revision: str | None
    variable: str
    revision_variable: str
    timeout: float | None = None  # seconds for the hub's answer to the checks (MODEL_PREFLIGHT_TIMEOUT)


@dataclass(frozen=True)
class ModelRequest:
    """What the configuration asks for, read before vLLM (``config/model_request``)."""

    model: RepoRequest
    tokenizer: RepoRequest | None = None  # only when it is another repo or revision
    # The hub token when a layer above the environment gives it (VLLM_EXTRA_ARGS' --hf-token, the
    # config file's hf-token): huggingface_hub reads HF_TOKEN alone.
    token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Fetched:
    """A repo in the local cache: its snapshot folder, at the commit the revision named."""

    repo: str
    revision: str | None
    path: Path

    @property
    def commit(self) -> str:
        return self.path.name


@dataclass
class _Plan:
    """The files to download from one repo, with their sizes and names in the cache."""

    files: list[str]
    commit: str
    sizes: dict[str, int] = field(default_factory=dict)
    blobs: dict[str, str] = field(default_factory=dict)  # file → blob name in the cache

    def blob_paths(self, folder: Path) -> Iterator[tuple[str, Path]]:
        """Each file with its blob's path in the repo's cache ``folder`` (files the hub gave no
        blob id are left out: nothing to find)."""
        for name in self.files:
            if self.blobs[name]:
                yield name, folder / "blobs" / self.blobs[name]


def prepare(request: ModelRequest, on_phase: OnPhase = _no_phases) -> tuple[Fetched, Fetched | None]:
    """Check and download the model (and another tokenizer repo): their local snapshots."""
    if request.token is not None:  # for the hub adapters fetched later too, as vLLM is given it
        os.environ["HF_TOKEN"] = request.token
    model = _fetch(request.model, on_phase, weights=True)
    tokenizer = _fetch(request.tokenizer, on_phase, weights=False) if request.tokenizer else None
    return model, tokenizer


def _fetch(request: RepoRequest, on_phase: OnPhase, *, weights: bool) -> Fetched:
    cache = Path(constants.HF_HUB_CACHE)
    if _read_only(_repo_folder(cache, request.repo)):
        return _from_cache(request, cache, weights=weights, why=READ_ONLY)
    if constants.HF_HUB_OFFLINE:
        return _from_cache(request, cache, weights=weights, why="HF_HUB_OFFLINE is set")
    on_phase("preflight")
    plan = _plan(request, weights=weights)
    _check_space(request, plan, cache)
    on_phase("download", lambda: _have(_repo_folder(cache, request.repo), plan))
    return _download(request, plan, cache)


def _read_only(folder: Path) -> bool:
    """Whether nothing can be written where the repo is cached (its folder, else the nearest parent
    that exists): RunPod mounts its model cache read-only."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return not os.access(folder, os.W_OK)


def _cached_revisions(cache: Path, repo: str) -> str:
    """The revisions a cache holds of ``repo``, for a message."""
    folder = _repo_folder(cache, repo)
    refs, commits = (sorted(p.name for p in (folder / sub).glob("*")) for sub in ("refs", "snapshots"))
    return f"it holds {', '.join(refs + commits)}" if refs or commits else "it holds no copy of it"


def _from_cache(request: RepoRequest, cache: Path, *, weights: bool, why: str) -> Fetched:
    """The repo's snapshot in the cache, checked complete for the files a download would choose:
    the hub is not asked (``why``: HF_HUB_OFFLINE, or a read-only cache, where nothing can be
    downloaded). Found by the revision's ref, not by a file: a tokenizer's repo may have no
    config.json."""
    try:
        commit = HfApi().resolve_revision(request.repo, revision=request.revision, cache_dir=cache,
                                          local_files_only=True).resolved
        snapshot = _repo_folder(cache, request.repo) / "snapshots" / commit
        files = select_files((p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")),
                             weights=weights)
        path = snapshot_download(request.repo, revision=request.revision, cache_dir=cache,
                                 local_files_only=True, allow_patterns=files)
    except (LocalEntryNotFoundError, RevisionResolutionError, ValueError):
        raise _not_cached(request, cache, why) from None
    source = "RunPod's model cache" if why == READ_ONLY else "the Hugging Face cache"
    log.info("Model %s: from %s (%s), commit %s, no download: %s", request.repo, source, why,
             Path(path).name, path)
    return Fetched(request.repo, request.revision, Path(path))


def _not_cached(request: RepoRequest, cache: Path, why: str) -> StartupError:
    if why != READ_ONLY:
        return StartupError(
            f"{_named(request)} is not in the Hugging Face cache (HF_HOME), and HF_HUB_OFFLINE is set: "
            "start once with the hub reachable (HF_HUB_OFFLINE=0), or bake the model into the image",
            detail=f"the cache: {cache}", variables=(request.variable, "HF_HUB_OFFLINE"))
    return StartupError(
        f"{_named(request)} is not in the Hugging Face cache (HF_HOME; "
        f"{_cached_revisions(cache, request.repo)}), which is read-only (RunPod's model cache), so it "
        f"cannot be downloaded there: set {request.variable} and {request.revision_variable} to the model "
        "the endpoint caches, or cache this one in the endpoint's settings",
        detail=f"the cache: {cache}", variables=(request.variable, request.revision_variable))


def _named(request: RepoRequest) -> str:
    revision = f" (revision {request.revision}, {request.revision_variable})" if request.revision else ""
    return f"{request.variable}={request.repo!r}{revision}"


def _plan(request: RepoRequest, *, weights: bool) -> _Plan:
    with _explained(request):
        try:
            info = HfApi().model_info(request.repo, revision=request.revision, files_metadata=True,
                                      timeout=request.timeout)
        except httpx2.TimeoutException:
            raise StartupError(f"{_named(request)}: {hub_name()} did not answer within {request.timeout:g} s "
                               "(MODEL_PREFLIGHT_TIMEOUT)", detail=endpoint_detail(), transient=True) from None
    siblings = {s.rfilename: s for s in info.siblings or ()}
    try:
        files = select_files(siblings, weights=weights)
    except ValueError as exc:
        raise StartupError(f"{_named(request)} cannot be served: {exc}",
                           variables=(request.variable,)) from None
    plan = _Plan(files, info.sha or "")
    for name in files:
        sibling = siblings[name]
        plan.sizes[name] = sibling.size or 0
        plan.blobs[name] = sibling.lfs.sha256 if sibling.lfs else sibling.blob_id or ""
    return plan


def _repo_folder(cache: Path, repo: str) -> Path:
    return cache / repo_folder_name(repo_id=repo, repo_type="model")


def _partials(blob: Path) -> list[Path]:
    """A blob's half-downloaded files, largest first (huggingface_hub 2.x names one per download
    ``<blob>.<8 hex>.incomplete``)."""
    found = [*blob.parent.glob(f"{blob.name}.*.incomplete")]
    return sorted(found, key=lambda path: path.stat().st_size, reverse=True)


def _have(folder: Path, plan: _Plan) -> int:
    """Bytes of the plan's files already in the cache: whole blobs, and the largest partial ones."""
    total = 0
    for _, blob in plan.blob_paths(folder):
        if blob.is_file():
            total += blob.stat().st_size
        elif partials := _partials(blob):
            total += partials[0].stat().st_size
    return total


def _resume(request: RepoRequest, plan: _Plan, cache: Path) -> None:
    """Finish the files a killed download left half-done, from where they stopped (a Range request),
    under huggingface_hub's own lock for each: a partial file found while the lock is held is no
    live download's."""
    folder = _repo_folder(cache, request.repo)
    for name, blob in plan.blob_paths(folder):
        if blob.exists() or not _partials(blob):
            continue
        lock = cache / ".locks" / folder.name / f"{blob.name}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            partials = [] if blob.exists() else _partials(blob)
            if not partials:
                continue
            for stale in partials[1:]:
                stale.unlink(missing_ok=True)
            _finish(request, plan, name, partials[0], blob)


def _finish(request: RepoRequest, plan: _Plan, name: str, partial: Path, blob: Path) -> None:
    size = partial.stat().st_size
    log.info("Model %s: resuming %s at %.2f of %.2f GB", request.repo, name, size / GB, plan.sizes[name] / GB)
    url = hf_hub_url(request.repo, name, revision=plan.commit)
    with partial.open("ab") as file:
        http_get(url, file, resume_size=size, headers=build_hf_headers(), expected_size=plan.sizes[name])
    os.replace(partial, blob)


def _free_bytes(path: Path) -> int:
    while not path.exists():  # the cache may not exist yet: its nearest existing parent's disk
        path = path.parent
    return shutil.disk_usage(path).free


def _check_space(request: RepoRequest, plan: _Plan, cache: Path) -> None:
    missing = sum(plan.sizes.values()) - _have(_repo_folder(cache, request.repo), plan)
    free = _free_bytes(cache)
    if missing > free:
        raise StartupError(
            f"{_named(request)} needs {missing / GB:.2f} GB more in the Hugging Face cache (HF_HOME), "
            f"and its disk has {free / GB:.2f} GB free: give the endpoint a larger network volume "
            "(mounted at BASE_PATH), or bake the model into the image",
            detail=f"the cache: {cache}", variables=("BASE_PATH", "HF_HOME"))


def _download(request: RepoRequest, plan: _Plan, cache: Path) -> Fetched:
    total = sum(plan.sizes.values())
    log.info("Model %s: downloading %d files (%.2f GB) into %s", request.repo, len(plan.files),
             total / GB, cache)
    started = time.monotonic()
    with _explained(request), _progress(request.repo, _repo_folder(cache, request.repo), plan, total):
        _resume(request, plan, cache)
        path = Path(snapshot_download(request.repo, revision=request.revision, cache_dir=cache,
                                      allow_patterns=plan.files))
    seconds = time.monotonic() - started
    log.info("Model %s: ready at commit %s in %.1f s (%s)", request.repo, path.name, seconds, path)
    return Fetched(request.repo, request.revision, path)


@contextmanager
def _progress(repo: str, folder: Path, plan: _Plan, total: int) -> Iterator[None]:
    """One log line every PROGRESS_SECONDS while the download runs (huggingface_hub's own bars
    redraw one terminal line, which a log file turns into noise)."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_SECONDS):
            have = _have(folder, plan)
            log.info("Model %s: %.2f of %.2f GB (%.0f%%)", repo, have / GB, total / GB,
                     100 * have / max(total, 1))

    thread = threading.Thread(target=report, name="download-progress", daemon=True)
    bars = not huggingface_hub.utils.are_progress_bars_disabled()
    huggingface_hub.utils.disable_progress_bars()
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if bars:
            huggingface_hub.utils.enable_progress_bars()


def _token_refused() -> bool:
    """Whether the hub refuses the configured token itself (not just access to one repo)."""
    try:
        HfApi().whoami()
    except HfHubHTTPError as exc:
        return exc.response is not None and exc.response.status_code == 401
    return False


def _access_error(request: RepoRequest, gated: bool) -> StartupError:
    """A repo the hub would not show: a bad token, a gated repo, or a missing or private one."""
    token = huggingface_hub.get_token() is not None
    if token and _token_refused():
        return StartupError("HF_TOKEN: the hub refused the token (invalid or revoked); set HF_TOKEN to "
                            "a valid read token from huggingface.co/settings/tokens",
                            variables=("HF_TOKEN",))
    page = f"{hub_url()}/{request.repo}"
    if gated and token:
        return StartupError(f"{_named(request)} is gated, and the account of HF_TOKEN has no access: "
                            f"request access at {page}, or use a token of an account that has it",
                            detail=endpoint_detail(), variables=("HF_TOKEN",))
    if gated:
        return StartupError(f"{_named(request)} is gated: accept its terms at {page}, then set HF_TOKEN "
                            "to a read token of that account", detail=endpoint_detail(), variables=("HF_TOKEN",))
    if token:
        return StartupError(f"{_named(request)}: no such repo on the hub, or it is private and the "
                            f"account of HF_TOKEN cannot read it: check {request.variable}",
                            variables=(request.variable, "HF_TOKEN"))
    return StartupError(f"{_named(request)}: no such repo on the hub, or it is private: check "
                        f"{request.variable}, or set HF_TOKEN to a token that can read it",
                        variables=(request.variable, "HF_TOKEN"))


@contextmanager
def _explained(request: RepoRequest) -> Iterator[None]:
    """Hub errors as StartupErrors naming the variable to change; network failures transient."""
    try:
        yield
    except HUB_ERRORS as exc:
        raise _startup_error(request, exc, hub_failure(exc)) from None


def _startup_error(request: RepoRequest, exc: BaseException, failure: HubFailure) -> StartupError:
    if failure in (HubFailure.GATED, HubFailure.NO_REPO, HubFailure.REFUSED):
        return _access_error(request, gated=failure is HubFailure.GATED)
    if failure is HubFailure.NO_REVISION:
        return StartupError(f"{request.revision_variable}={request.revision!r}: no such branch, tag or "
                            f"commit in {request.repo}", variables=(request.revision_variable,))
    if failure in (HubFailure.HTTP, HubFailure.NO_FILE):
        status = http_status(exc)
        return StartupError(f"{_named(request)}: {hub_name()} answered {status}", detail=endpoint_detail(exc),
                            transient=status is None or status >= 500 or status == 429)
    if failure is HubFailure.DISK_FULL:
        return StartupError(f"{_named(request)}: the disk of the Hugging Face cache (HF_HOME) is full: "
                            "give the endpoint a larger network volume (mounted at BASE_PATH)",
                            detail=f"the cache: {constants.HF_HUB_CACHE}", variables=("BASE_PATH", "HF_HOME"))
    if failure is HubFailure.UNREACHABLE:  # unreachable, or cut off mid-download
        return StartupError(f"{_named(request)}: download failed: cannot reach {hub_name()}",
                            detail=endpoint_detail(exc), transient=True)
    reason = getattr(exc, "strerror", None) or type(exc).__name__
    return StartupError(f"{_named(request)}: download failed ({reason})", detail=endpoint_detail(exc),
                        transient=True)
