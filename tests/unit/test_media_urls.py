"""The media-URL policy (wire/media_urls), and vLLM's media connector held to it
(vllm_adapter/media.guard_media_urls), fetching from local servers over both of vLLM's HTTP clients. On
the real engine and a real worker: tests/engine/test_vision.py, tests/worker/test_media_urls_worker.py."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import pytest
from media_server import MediaServer

from worker.config.settings import load_settings
from worker.vllm_adapter.errors import REQUEST_ERRORS, error_status
from worker.vllm_adapter.media import guard_media_urls
from worker.wire.errors import ConfigError
from worker.wire.media_urls import MediaURLPolicy, origin

LOOPBACK_1 = (ipaddress.ip_network("127.0.0.1/32"),)


@pytest.mark.parametrize(("host", "kind"), [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("[::1]", "loopback"),
    ("[::ffff:127.0.0.1]", "loopback"), ("169.254.169.254", "link-local"), ("[fe80::1]", "link-local"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("[fd00::1]", "private"),
    ("[::ffff:10.0.0.1]", "private"), ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"),
    ("240.0.0.1", "private"), ("100.64.0.1", "not public")])
def test_a_non_public_address_is_refused_naming_its_kind(host, kind):
    reason = MediaURLPolicy().refusal(f"http://{host}:8080/cat.png")
    assert reason.startswith(f"the address {host.strip('[]').removeprefix('::ffff:')} is {kind}; ")
    assert reason.endswith("refused unless ALLOWED_PRIVATE_MEDIA_NETWORKS holds them")


@pytest.mark.parametrize(("host", "carried", "kind"), [
    ("[2002:7f00:1::]", "127.0.0.1", "loopback"), ("[2002:a00:1::1]", "10.0.0.1", "private"),
    ("[64:ff9b::a9fe:a9fe]", "169.254.169.254", "link-local"),
    ("[2001:0:4136:e378:8000:63bf:80ff:fffe]", "127.0.0.1", "loopback")])
def test_an_ipv6_address_carrying_a_non_public_ipv4_one_is_refused_as_that(host, carried, kind):
    """6to4, NAT64 and Teredo addresses, which Python reads as global (the first two) whatever they carry."""
    assert MediaURLPolicy().refusal(f"http://{host}/cat.png").startswith(f"the address {carried} is {kind}; ")


@pytest.mark.parametrize("host", ["8.8.8.8", "[2606:4700:4700::1111]", "[2002:808:808::]"])
def test_a_public_address_is_fetched(host):
    assert MediaURLPolicy().refusal(f"https://{host}/cat.png") is None


def test_a_name_is_refused_when_any_address_it_resolves_to_is():
    asked = []

    def lookup(host: str, port: int) -> list[str]:
        asked.append((host, port))
        return ["93.184.215.14", "10.0.0.7"]

    assert MediaURLPolicy().refusal("https://images.example/cat.png", lookup).startswith(
        "images.example resolves to 10.0.0.7, which is private; ")
    assert asked == [("images.example", 443)]
    assert MediaURLPolicy().refusal("http://images.example:81/", lambda host, port: ["93.184.215.14"]) is None


def test_addresses_already_resolved_are_held_to_the_same_rule_and_a_hop_by_name_alone():
    assert MediaURLPolicy().addresses_refusal("images.example", ["93.184.215.14", "::ffff:10.0.0.7"]).startswith(
        "images.example resolves to 10.0.0.7, which is private; ")
    assert MediaURLPolicy().addresses_refusal("images.example", ["93.184.215.14"]) is None
    assert MediaURLPolicy().hop_refusal("http://localhost/a.png") is None  # its addresses: the connection's
    assert MediaURLPolicy().hop_refusal("http://127.0.0.1/a.png").startswith("the address 127.0.0.1 is loopback")


def test_a_name_that_does_not_resolve_is_left_to_the_fetch():
    def lookup(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    assert MediaURLPolicy().refusal("http://nowhere.invalid/cat.png", lookup) is None


def test_allowed_private_networks_admit_their_addresses_only():
    policy = MediaURLPolicy((ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")))
    assert policy.refusal("http://10.9.8.7/a.png") is None
    assert policy.refusal("http://[::1]/a.png") is None
    assert policy.refusal("http://[::ffff:10.9.8.7]/a.png") is None  # the IPv4 address it reaches
    assert "the address 169.254.169.254 is link-local" in policy.refusal("http://169.254.169.254/")


def test_allowed_media_domains_refuse_every_other_host_before_any_lookup():
    policy = MediaURLPolicy(LOOPBACK_1, ("127.0.0.1", "images.example"))

    def lookup(host: str, port: int) -> list[str]:
        raise AssertionError("looked up")

    assert policy.refusal("http://localhost/a.png", lookup) == \
        "localhost is not in ALLOWED_MEDIA_DOMAINS (127.0.0.1, images.example)"
    assert policy.refusal("http://127.0.0.1:9/a.png", lookup) is None


def test_origin_is_the_scheme_host_and_port_reached():
    assert origin("HTTP://Example.COM/a?b") == origin("http://example.com:80/c") == ("http", "example.com", 80)
    assert origin("https://[::1]/") == ("https", "::1", 443)


def test_allowed_private_media_networks_is_a_comma_separated_list_of_networks():
    settings = load_settings({"ALLOWED_PRIVATE_MEDIA_NETWORKS": "10.0.0.0/8, fd00::/8,127.0.0.1"})
    assert settings.allowed_private_media_networks == tuple(
        map(ipaddress.ip_network, ["10.0.0.0/8", "fd00::/8", "127.0.0.1/32"]))
    assert load_settings({}).allowed_private_media_networks is None
    with pytest.raises(ConfigError, match=r"env ALLOWED_PRIVATE_MEDIA_NETWORKS='10\.0\.0\.1/8': .*network"):
        load_settings({"ALLOWED_PRIVATE_MEDIA_NETWORKS": "10.0.0.1/8"})


# --- vLLM's connector, over aiohttp (vLLM's async path) and requests (its sync one) ----------------

@pytest.fixture
def servers():
    with MediaServer() as first, MediaServer("127.0.0.2") as second:
        yield first, second
    guard_media_urls(MediaURLPolicy())  # the default, as a worker holds it


@pytest.fixture
def fetch():
    """fetch(url, sync) → ``url``'s image, fetched by vLLM's media connector as a chat message's is;
    on one event loop, as in a worker (the connector's aiohttp session belongs to it)."""
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    with asyncio.Runner() as loop:
        def fetch(url: str, sync: bool):
            connector = MEDIA_CONNECTOR_REGISTRY.load("http")
            return connector.fetch_image(url) if sync else loop.run(connector.fetch_image_async(url))

        yield fetch


@pytest.fixture
def refusal(fetch):
    """refusal(url, sync) → the message of the 400 that fetching ``url`` gets."""

    def refusal(url: str, sync: bool) -> str:
        with pytest.raises(REQUEST_ERRORS) as refused:
            fetch(url, sync)
        assert error_status(refused.value) == 400
        return str(refused.value)

    return refusal


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_the_connector_refuses_a_loopback_url_unasked_by_default(servers, refusal, sync):
    first, _ = servers
    guard_media_urls(MediaURLPolicy())
    assert refusal(first.url(), sync).startswith(f"media URL {first.url()}: the address 127.0.0.1 is loopback; ")
    assert first.hits == []


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_the_connector_fetches_from_an_allowed_network_and_checks_every_redirect(servers, fetch, refusal, sync):
    first, second = servers
    guard_media_urls(MediaURLPolicy(LOOPBACK_1))
    assert fetch(first.url(), sync).size == (64, 48)
    assert fetch(first.redirect(first.url("/image.png?again")), sync).size == (64, 48)
    target = second.url(host="127.0.0.2")
    assert refusal(first.redirect(target), sync).startswith(
        f"media URL {first.redirect(target)} redirects to {target}: the address 127.0.0.2 is loopback; ")
    assert second.hits == []


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_the_connector_holds_every_redirect_to_allowed_media_domains(servers, refusal, sync):
    first, _ = servers
    guard_media_urls(MediaURLPolicy(LOOPBACK_1, ("127.0.0.1",)))
    target = first.url(host="localhost")
    assert refusal(first.redirect(target), sync) == \
        f"media URL {first.redirect(target)} redirects to {target}: localhost is not in ALLOWED_MEDIA_DOMAINS (127.0.0.1)"
    assert refusal(target, sync) == f"media URL {target}: localhost is not in ALLOWED_MEDIA_DOMAINS (127.0.0.1)"
    assert [hit.partition("?")[0] for hit in first.hits] == ["/redirect"]


def answering(monkeypatch, name: str, *addresses: str) -> None:
    """``name`` resolves to each of ``addresses`` in turn, the last one from then on, on both of
    vLLM's HTTP clients (each resolves through socket.getaddrinfo); every other name as it does."""
    getaddrinfo, answers = socket.getaddrinfo, iter(addresses)

    def lookup(host, port, *args, **kwargs):
        if host != name:
            return getaddrinfo(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers, addresses[-1]), port))]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_the_connector_refuses_a_redirect_to_a_name_by_the_addresses_it_resolves_to(
        monkeypatch, servers, refusal, sync):
    first, second = servers
    guard_media_urls(MediaURLPolicy(LOOPBACK_1))
    answering(monkeypatch, "media.example", "127.0.0.2")
    target = second.url(host="media.example")
    assert refusal(first.redirect(target), sync).startswith(
        f"media URL {first.redirect(target)} redirects to {target}: media.example resolves to 127.0.0.2, "
        "which is loopback; ")
    assert second.hits == []


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_the_connector_connects_to_the_addresses_it_checked_whatever_dns_answers_next(monkeypatch, fetch, sync):
    """DNS rebinding: a name answering an allowed address (127.0.0.2, standing in for a public one:
    no traffic leaves loopback) the first time and a refused one (127.0.0.1) every time after must
    not reach the refused one."""
    with MediaServer("127.0.0.2") as allowed, MediaServer("127.0.0.1", allowed.port) as refused:
        guard_media_urls(MediaURLPolicy((ipaddress.ip_network("127.0.0.2/32"),)))
        answering(monkeypatch, "rebinding.example", "127.0.0.2", "127.0.0.1")
        try:
            assert fetch(allowed.url(host="rebinding.example"), sync).size == (64, 48)
        finally:
            guard_media_urls(MediaURLPolicy())
        assert refused.hits == [] and allowed.hits == ["/image.png"]


@pytest.fixture
def plugin_fetch():
    """fetch(url, sync) as ``fetch``, by a plugin's connector (VLLM_MEDIA_CONNECTOR=plugin): vLLM's
    own, subclassed, as a plugin's is."""
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    class PluginConnector(MediaConnector):
        pass

    MEDIA_CONNECTOR_REGISTRY.register("plugin")(PluginConnector)
    with asyncio.Runner() as loop:
        def fetch(url: str, sync: bool):
            connector = MEDIA_CONNECTOR_REGISTRY.load("plugin")
            return connector.fetch_image(url) if sync else loop.run(connector.fetch_image_async(url))

        yield fetch
    del MEDIA_CONNECTOR_REGISTRY.name2class["plugin"]


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_plugins_connector_is_held_to_the_policy_too(servers, plugin_fetch, sync):
    first, second = servers
    guard_media_urls(MediaURLPolicy())
    with pytest.raises(REQUEST_ERRORS) as refused:
        plugin_fetch(first.url(), sync)
    assert error_status(refused.value) == 400 and "the address 127.0.0.1 is loopback" in str(refused.value)
    assert first.hits == []
    guard_media_urls(MediaURLPolicy(LOOPBACK_1))  # 127.0.0.1 allowed, and each redirect still checked
    assert plugin_fetch(first.url(), sync).size == (64, 48)
    with pytest.raises(REQUEST_ERRORS, match="redirects to .*127.0.0.2 is loopback"):
        plugin_fetch(first.redirect(second.url(host="127.0.0.2")), sync)
    assert second.hits == []


def test_through_a_proxy_a_name_that_does_not_resolve_here_is_refused():
    def unresolved(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    url = "http://metadata.internal/cat.png"
    assert MediaURLPolicy().refusal(url, lookup=unresolved) is None  # fetched directly: the fetch fails on it
    assert MediaURLPolicy().refusal(url, lookup=unresolved, proxied=True).startswith(
        "metadata.internal does not resolve here, so the addresses a proxy")
