"""Image URLs on a load-balancing worker process serving the tiny vision-language model, configured
as an operator who serves media from one local host would: ALLOWED_MEDIA_DOMAINS names 127.0.0.1
and 127.0.0.2, ALLOWED_PRIVATE_MEDIA_NETWORKS lets 127.0.0.1 (not 127.0.0.2) be reached. Every
redirect is held to both. The default, everything loopback refused, on the queue's path:
tests/engine/test_vision.py."""

from __future__ import annotations

import base64
import concurrent.futures

import pytest
from conftest import engine_env
from media_server import MediaServer
from test_load_balancer_worker import Worker


@pytest.fixture(scope="module")
def worker(models, tmp_path_factory):
    worker = Worker(engine_env(models["tiny-vlm"], ALLOWED_MEDIA_DOMAINS="127.0.0.1,127.0.0.2",
                               ALLOWED_PRIVATE_MEDIA_NETWORKS="127.0.0.1/32"),
                    tmp_path_factory.mktemp("media-worker") / "worker.log")
    worker.wait_serving()
    yield worker
    worker.kill()


@pytest.fixture(scope="module")
def model(worker) -> str:
    return worker.http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture
def media():
    with MediaServer() as server:
        yield server


@pytest.fixture
def other():
    """A server on 127.0.0.2: a domain allowed, an address outside ALLOWED_PRIVATE_MEDIA_NETWORKS."""
    with MediaServer("127.0.0.2") as server:
        yield server


def chat(worker, model: str, url: str, stream: bool = False):
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": url}}]
    return worker.http.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
        "temperature": 0, "ignore_eos": True, "stream": stream})


def refusal(answer) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    return error["message"]


def inline(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_an_image_url_the_configuration_allows_reaches_the_model(worker, model, media):
    fetched = chat(worker, model, media.url())
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["usage"] == chat(worker, model, inline(media.image)).json()["usage"]
    assert media.hits == ["/image.png"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_redirect_to_an_address_outside_the_allowed_networks_is_refused(worker, model, media, other, stream):
    target = other.url(host="127.0.0.2")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a request with an image beside it
        beside = pool.submit(chat, worker, model, inline(media.image), stream)
        message = refusal(chat(worker, model, media.redirect(target), stream))
        assert beside.result().status_code == 200
    assert message.startswith(f"media URL {media.redirect(target)} redirects to {target}: ")
    assert "the address 127.0.0.2 is loopback" in message and "ALLOWED_PRIVATE_MEDIA_NETWORKS" in message
    assert other.hits == []


def test_a_redirect_to_a_host_not_in_allowed_media_domains_is_refused(worker, model, media):
    target = media.url(host="localhost")
    message = refusal(chat(worker, model, media.redirect(target)))
    assert message.startswith(f"media URL {media.redirect(target)} redirects to {target}: ")
    assert "localhost is not in ALLOWED_MEDIA_DOMAINS (127.0.0.1, 127.0.0.2)" in message
    assert [hit.partition("?")[0] for hit in media.hits] == ["/redirect"]


def test_a_host_not_in_allowed_media_domains_is_refused_and_the_worker_serves_on(worker, model, media):
    url = media.url(host="localhost")
    assert refusal(chat(worker, model, url)).startswith(
        f"media URL {url}: localhost is not in ALLOWED_MEDIA_DOMAINS (127.0.0.1, 127.0.0.2)")
    assert media.hits == []
    assert chat(worker, model, media.url()).status_code == 200
