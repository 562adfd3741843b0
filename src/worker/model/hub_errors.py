"""What went wrong when the Hugging Face hub was asked, told apart once for both callers: the model's
preflight at start-up (``model/preflight``: a StartupError naming the variable to change) and the LoRA
adapters fetched by name (``model/hub_adapters``: a request's 400, 502 or 507).

``hub_failure(exc)`` reads huggingface_hub's exceptions (and the OSErrors and HTTP errors under them)
as a ``HubFailure``; each caller answers a failure in its own terms. The hub is named to callers as
"the hub", or "the hub (HF_ENDPOINT)" for a mirror: a mirror's address may carry credentials, so it goes
to the log only (``endpoint_detail``).
"""

from __future__ import annotations

import enum
import errno

import httpx2  # huggingface_hub's HTTP client
from huggingface_hub import constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

__all__ = ["HUB_ERRORS", "HubFailure", "endpoint_detail", "hub_failure", "hub_name", "hub_url", "http_status"]

# What asking the hub or writing its cache raises (a hub error is an OSError too).
HUB_ERRORS = (OSError, EntryNotFoundError, httpx2.HTTPError)


class HubFailure(enum.Enum):
    GATED = "a gated repo the token cannot read"
    NO_REPO = "no such repo, or a private one"
    NO_REVISION = "no such branch, tag or commit"
    NO_FILE = "no such file in the repo"
    NOT_CACHED = "not in the cache, and the hub not asked (offline or out of reach)"
    REFUSED = "the hub refused the token (401)"
    HTTP = "the hub answered another error status"
    DISK_FULL = "the cache's disk is full"
    READ_ONLY = "the cache cannot be written"
    IO = "reading or writing the cache failed"
    UNREACHABLE = "the hub could not be reached"


# The cache cannot take a download: full (or over quota), read-only (RunPod's model cache), not ours.
_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return response.status_code if response is not None else None


def hub_failure(exc: BaseException) -> HubFailure:
    """What ``exc``, one of ``HUB_ERRORS``, means (subclasses before their bases: a gated repo's error
    is a missing repo's, a remote missing file's an HTTP error, a local one's an OSError)."""
    for kind, failure in ((GatedRepoError, HubFailure.GATED), (RepositoryNotFoundError, HubFailure.NO_REPO),
                          (RevisionNotFoundError, HubFailure.NO_REVISION),
                          (LocalEntryNotFoundError, HubFailure.NOT_CACHED)):
        if isinstance(exc, kind):
            return failure
    if isinstance(exc, EntryNotFoundError):
        return HubFailure.NO_FILE
    if isinstance(exc, HfHubHTTPError):
        return HubFailure.REFUSED if http_status(exc) == 401 else HubFailure.HTTP
    if isinstance(exc, OSError):
        return HubFailure.DISK_FULL if exc.errno in _FULL else \
            HubFailure.READ_ONLY if exc.errno in _READ_ONLY else HubFailure.IO
    return HubFailure.UNREACHABLE


def _mirror() -> bool:
    return constants.ENDPOINT != constants._HF_DEFAULT_ENDPOINT


def hub_name() -> str:
    """The hub, as a caller is told: a mirror by its variable (its address may carry credentials, and
    says nothing a caller can act on)."""
    return "the hub (HF_ENDPOINT)" if _mirror() else "the hub"


def hub_url() -> str:
    """The hub's address for a repo's page, as a caller is told it: huggingface.co's, or a mirror's by
    its variable."""
    return "HF_ENDPOINT" if _mirror() else constants.ENDPOINT


def endpoint_detail(exc: BaseException | None = None) -> str:
    """For the log: the exception's own text and, for a mirror, its address (the log masks a URL's
    credentials)."""
    parts = [f"{type(exc).__name__}: {exc}"] if exc is not None else []
    return "; ".join([*parts, *([f"HF_ENDPOINT={constants.ENDPOINT}"] if _mirror() else [])])
