"""HTTP clients held to a ``media_urls.MediaURLPolicy``, as vLLM's media connection uses them
(``vllm_adapter.media`` installs them): aiohttp's session (vLLM's async path) asks the policy before
each request it sends, every redirect's included, through a client middleware, and requests'
session (the sync path) through its transport adapter, where each follows redirects.

A name is checked by resolving it where the connection is made, and only the addresses checked are
connected to: resolved once for the check and again to connect, a DNS server answering the two
differently (DNS rebinding) would reach an address never checked.

Through a proxy (HTTP(S)_PROXY, honoured on both paths) the connection is made to the proxy, and
the proxy resolves the media host: its name is then checked on its own resolution, as before, and
rebinding between the two is not caught. aiohttp resolves a proxy's name through the checked
resolver too, so a proxy named on a private network is refused unless its network is allowed.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import aiohttp
import requests
import urllib3

from worker.wire.media_urls import MediaURLPolicy, resolve

__all__ = ["CheckedClients", "Refused"]

# What a refused request raises, from the URL refused (the caller's, or a redirect's) and why.
Refused = Callable[[str, str], Exception]


class _RefusedAddress(Exception):
    """Addresses a host resolved to that the policy refuses, raised in place of connecting to them,
    where the request's URL is unknown; the request's check turns it into its ``Refused``. Not an
    OSError, so that neither aiohttp nor urllib3 takes it for a failed lookup or connection."""


class CheckedClients:
    """Sessions that ask ``policy`` before each request they send and connect only to the addresses
    it allows; a refusal raises ``refused(url, reason)`` before anything is sent (the caller's
    exception, so that its HTTP stack answers it as it answers a bad request)."""

    def __init__(self, policy: MediaURLPolicy, refused: Refused) -> None:
        self.policy = policy
        self.refused = refused

    def check(self, url: str, proxied: bool) -> None:
        """Refuses ``url`` by its host's name or address; by the addresses its name resolves to too
        when ``proxied``, as the connection (the proxy's) cannot."""
        reason = self.policy.refusal(url, proxied=True) if proxied else self.policy.hop_refusal(url)
        if reason is not None:
            raise self.refused(url, reason)

    def addresses(self, host: str, found: list[str]) -> list[str]:
        """``found``, the addresses ``host`` resolved to, when the policy allows them all."""
        if (reason := self.policy.addresses_refusal(host, found)) is not None:
            raise _RefusedAddress(reason)
        return found

    def async_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.addresses))
        return aiohttp.ClientSession(connector=connector, trust_env=True, middlewares=(self._checked,))

    async def _checked(self, request: aiohttp.ClientRequest, send) -> aiohttp.ClientResponse:
        # aiohttp hands an address in the URL to no resolver: that, and the name's place in
        # ALLOWED_MEDIA_DOMAINS, are checked here, for each hop
        url = str(request.url)
        await asyncio.to_thread(self.check, url, request.proxy is not None)  # resolving a name blocks
        try:
            return await send(request)
        except _RefusedAddress as refused:
            raise self.refused(url, str(refused)) from None

    def sync_session(self) -> requests.Session:
        session = requests.Session()
        for scheme in ("http://", "https://"):
            session.mount(scheme, _CheckedAdapter(self))
        return session


class _CheckedResolver(aiohttp.ThreadedResolver):
    """aiohttp's resolver over the system's (as ``resolve``, which the sync path uses), answering
    only addresses ``allowed`` lets through, which are then the ones aiohttp connects to."""

    def __init__(self, allowed: Callable[[str, list[str]], list[str]]) -> None:
        super().__init__()
        self.allowed = allowed

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        found = await super().resolve(host, port, family)
        self.allowed(host, [result["host"] for result in found])
        return found


class _CheckedAdapter(requests.adapters.HTTPAdapter):
    """requests' transport, checking each request's URL before sending it, over connections that
    connect to the addresses of their host that the policy allows alone (``_checked_pool``)."""

    def __init__(self, clients: CheckedClients) -> None:
        self.clients = clients  # before HTTPAdapter's __init__, which makes the pool manager
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        pools = self.poolmanager.pool_classes_by_scheme
        self.poolmanager.pool_classes_by_scheme = {
            scheme: _checked_pool(pool, self.clients.addresses) for scheme, pool in pools.items()}

    def send(self, request: requests.PreparedRequest, *args, **kwargs) -> requests.Response:
        proxied = requests.utils.select_proxy(request.url, kwargs.get("proxies")) is not None
        self.clients.check(request.url, proxied)
        try:
            return super().send(request, *args, **kwargs)
        except _RefusedAddress as refused:
            raise self.clients.refused(request.url, str(refused)) from None


def _checked_pool(pool: type[urllib3.HTTPConnectionPool],
                  allowed: Callable[[str, list[str]], list[str]]) -> type[urllib3.HTTPConnectionPool]:
    """urllib3's ``pool``, whose connections resolve their host once, ask ``allowed`` about its
    addresses, and connect to those, in turn, by address: TLS (SNI, the certificate's name) still
    goes by the host's name, which urllib3 keeps apart from the address it connects to."""

    class CheckedConnection(pool.ConnectionCls):
        def _new_conn(self) -> socket.socket:
            name = self._dns_host
            try:
                found = resolve(name, self.port)
            except socket.gaierror as error:
                raise urllib3.exceptions.NameResolutionError(self.host, self, error) from error
            try:
                for address in allowed(name, found):
                    self._dns_host = address
                    try:
                        return super()._new_conn()
                    except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError) as error:
                        failed = error  # the next address, as urllib3 tries each of a name's
                raise failed
            finally:
                self._dns_host = name

    return type(pool.__name__, (pool,), {"ConnectionCls": CheckedConnection})
