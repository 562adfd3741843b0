"""The hook that holds vLLM's media fetches to the worker's media-URL policy (``wire/media_urls``):
vLLM's media connector is replaced by one that fetches over the checked clients
(``wire/media_clients``), and a plugin's connector is held as far as it can be. A refusal is a 400
that names the caller's URL and the redirect refused."""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager

import aiohttp
import requests
from vllm.connections import HTTPConnection
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

from worker.vllm_adapter.errors import RefusedRequest
from worker.wire.media_clients import CheckedClients
from worker.wire.media_urls import MediaURLPolicy, origin
from worker.wire.redact import mask_urls

__all__ = ["guard_media_urls"]

log = logging.getLogger(__name__)


class _RefusedHop(RefusedRequest):
    """A request for media the policy refuses, raised before it is sent: ``hop``, its URL (the
    caller's, or a redirect's), and why. vLLM passes it on as it is (a VLLMValidationError)."""

    def __init__(self, hop: str, reason: str) -> None:
        super().__init__(reason)
        self.hop = hop


class _CheckedConnection(HTTPConnection):
    """vLLM's HTTP connection over the checked clients: aiohttp's session on its async path,
    requests' on its sync one, each asking ``policy`` before every request it sends."""

    def __init__(self, policy: MediaURLPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.clients = CheckedClients(policy, _RefusedHop)

    async def get_async_client(self) -> aiohttp.ClientSession:
        if self._async_client is None:
            self._async_client = self.clients.async_session()
        return self._async_client

    def get_sync_client(self) -> requests.Session:
        if self._sync_client is None:
            self._sync_client = self.clients.sync_session()
        return self._sync_client


class _CheckedMediaConnector(MediaConnector):
    """vLLM's media connector (VLLM_MEDIA_CONNECTOR's default, "http"), fetching through the
    checked connection; a refusal is a 400 that names the caller's URL and the redirect refused."""

    checked = _CheckedConnection(MediaURLPolicy())  # guard_media_urls sets the process's

    def __init__(self, media_io_kwargs: dict | None = None, **kwargs) -> None:
        super().__init__(media_io_kwargs, self.checked, **kwargs)

    def _assert_url_in_allowed_media_domains(self, url_spec) -> None:
        """vLLM's check of ALLOWED_MEDIA_DOMAINS on the caller's URL (also one served from its
        media cache), in the policy's words."""
        if (reason := self.checked.policy.host_refusal(url_spec.hostname)) is not None:
            raise _RefusedHop(url_spec.url, reason)

    def load_from_url(self, url: str, *args, **kwargs):
        with _refusal_of(url):
            return super().load_from_url(url, *args, **kwargs)

    async def load_from_url_async(self, url: str, *args, **kwargs):
        with _refusal_of(url):
            return await super().load_from_url_async(url, *args, **kwargs)


@contextmanager
def _refusal_of(url: str):
    """A refused request, as the refusal of the caller's ``url``: one to another host or port than
    the URL's is a redirect's."""
    try:
        yield
    except _RefusedHop as refused:
        log.warning("Media URL refused: %s", refused)  # the host, not the caller's URL
        hop = "" if origin(refused.hop) == origin(url) else f" redirects to {mask_urls(refused.hop)}"
        raise RefusedRequest(f"media URL {mask_urls(url)}{hop}: {refused}") from None


def guard_media_urls(policy: MediaURLPolicy) -> None:
    """Holds every media URL vLLM fetches in this process from now on to ``policy``, each redirect
    too: vLLM's connector is replaced by ``_CheckedMediaConnector`` (vLLM checks ALLOWED_MEDIA_DOMAINS
    on the caller's URL alone, and asks nothing of the addresses), and a plugin's connector
    (VLLM_MEDIA_CONNECTOR) is held as far as it can be (``_hold_plugin_connector``)."""
    _CheckedMediaConnector.checked = _CheckedConnection(policy)
    MEDIA_CONNECTOR_REGISTRY.register("http")(_CheckedMediaConnector)
    if not getattr(MEDIA_CONNECTOR_REGISTRY.load, "holds_plugins", False):
        load = MEDIA_CONNECTOR_REGISTRY.load

        def load_held(name: str, *args, **kwargs):
            connector = load(name, *args, **kwargs)
            if not isinstance(connector, _CheckedMediaConnector):
                _hold_plugin_connector(connector)
            return connector

        load_held.holds_plugins = True
        MEDIA_CONNECTOR_REGISTRY.load = load_held


def _hold_plugin_connector(connector) -> None:
    """A plugin's media connector (VLLM_MEDIA_CONNECTOR names it; vLLM loads one per request): what
    it fetches through vLLM's HTTP connection goes through the checked one, redirects included, and
    the URL it is given is checked first, its host's addresses resolved here (what it fetches by a
    transport of its own is its own)."""
    if isinstance(getattr(connector, "connection", None), HTTPConnection):
        connector.connection = _CheckedMediaConnector.checked
    policy = _CheckedMediaConnector.checked.policy

    def checked(url: str) -> None:
        if (reason := policy.refusal(url)) is not None:
            raise _RefusedHop(url, reason)

    fetch, fetch_async = connector.load_from_url, connector.load_from_url_async

    def load_from_url(url: str, *args, **kwargs):
        with _refusal_of(url):
            checked(url)
            return fetch(url, *args, **kwargs)

    async def load_from_url_async(url: str, *args, **kwargs):
        with _refusal_of(url):
            await asyncio.to_thread(checked, url)  # resolving a name blocks
            return await fetch_async(url, *args, **kwargs)

    connector.load_from_url, connector.load_from_url_async = load_from_url, load_from_url_async
