"""Which media URLs the worker's vLLM may fetch: the policy that ``media_clients`` holds every
request vLLM sends for media to (``vllm_adapter/media.guard_media_urls`` installs them), the URL's own
and each redirect's.

A caller's image, audio or video URL makes the worker fetch it, from inside the endpoint's network.
So a host is refused when any address it resolves to is not on the public internet (loopback,
private, link-local, shared, reserved, multicast, unspecified; an IPv6 address that carries an
IPv4 one, IPv4-mapped, 6to4, Teredo or NAT64's, as that IPv4 one), unless ``ALLOWED_PRIVATE_MEDIA_NETWORKS`` holds it; and, when vLLM's
``ALLOWED_MEDIA_DOMAINS`` is set, a host it does not list. Both hold for every redirect.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["MediaURLPolicy", "origin", "resolve"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# The kinds of non-public address, by the ipaddress property that says so, in the order named.
_KINDS = ("loopback", "link_local", "unspecified", "multicast", "private", "reserved")
_PORTS = {"http": 80, "https": 443}


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to, as a connection to it would (the system's resolver)."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def origin(url: str) -> tuple[str, str, int]:
    """The scheme, host and port a URL reaches, however its text is spelled (``HTTP://Host:80``)."""
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port or _PORTS.get(parts.scheme, 80)


def _kind(address: Address) -> str | None:
    """What makes ``address`` non-public ("loopback", ...), or None for a public one."""
    if kind := next((kind for kind in _KINDS if getattr(address, f"is_{kind}")), None):
        return kind.replace("_", "-")
    return None if address.is_global else "not public"  # 100.64.0.0/10, shared by carriers


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # the well-known prefix: a NAT64 gateway reaches its IPv4


def _unmapped(address: Address) -> Address:
    """An IPv6 address that carries an IPv4 one as the IPv4 address it reaches: IPv4-mapped
    (``::ffff:127.0.0.1``), 6to4 (``2002:7f00:1::``), Teredo's client, NAT64's (``64:ff9b::7f00:1``).
    Python reads 6to4 and NAT64 addresses as global whatever they carry."""
    if address.version == 4:
        return address
    if carried := address.ipv4_mapped or address.sixtofour or (address.teredo or (None, None))[1]:
        return carried
    return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) if address in _NAT64 else address


@dataclass(frozen=True)
class MediaURLPolicy:
    """``private_networks``: the non-public networks media may come from (ALLOWED_PRIVATE_MEDIA_NETWORKS);
    ``domains``: the only hosts it may come from, when any (vLLM's ALLOWED_MEDIA_DOMAINS)."""

    private_networks: tuple[Network, ...] = ()
    domains: tuple[str, ...] = ()

    def refusal(self, url: str, lookup: Callable[[str, int], list[str]] = resolve,
                proxied: bool = False) -> str | None:
        """Why ``url`` may not be fetched, in words naming the variable that decides; None when it
        may. A host that does not resolve is left to the fetch, which fails on it as before, unless
        the fetch goes through a proxy (``proxied``): the proxy would resolve it, on its own network."""
        _, host, port = origin(url)
        if (refused := self.hop_refusal(url)) is not None or _address(host) is not None:
            return refused
        try:
            found = lookup(host, port)
        except OSError:
            return (f"{host} does not resolve here, so the addresses a proxy (HTTP_PROXY, HTTPS_PROXY) would "
                    "fetch it from cannot be checked; media through a proxy comes from hosts that resolve "
                    "here") if proxied else None
        return self.addresses_refusal(host, found)

    def hop_refusal(self, url: str) -> str | None:
        """Why ``url`` is refused before its host is resolved: the host not in ALLOWED_MEDIA_DOMAINS,
        or an address itself that is refused."""
        _, host, _ = origin(url)
        if (refused := self.host_refusal(host)) is not None:
            return refused
        if (literal := _address(host)) is not None:
            return self._address_refusal([literal], "the address {address} is")
        return None

    def addresses_refusal(self, host: str, addresses: Iterable[str]) -> str | None:
        """Why the addresses ``host`` resolved to are refused, when any one is: for a client that
        resolves the host itself and connects to these addresses alone."""
        return self._address_refusal(map(ipaddress.ip_address, addresses), f"{host} resolves to {{address}}, which is")

    def host_refusal(self, host: str | None) -> str | None:
        """Why ``host`` is refused by name: not in ALLOWED_MEDIA_DOMAINS, when that is set."""
        if not self.domains or host in self.domains:
            return None
        return f"{host} is not in ALLOWED_MEDIA_DOMAINS ({', '.join(self.domains)})"

    def _address_refusal(self, addresses: Iterable[Address], subject: str) -> str | None:
        """Why one of the addresses is refused (non-public, in no allowed network), ``subject``
        naming it; None when none is."""
        for address in map(_unmapped, addresses):
            if (kind := _kind(address)) and not any(address in net for net in self.private_networks):
                return (f"{subject.format(address=address)} {kind}; media from loopback, private, link-local "
                        "and other non-public addresses is refused unless ALLOWED_PRIVATE_MEDIA_NETWORKS "
                        "holds them")
        return None


def _address(host: str) -> Address | None:
    """``host`` as an IP address, when it is one."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None
