"""Chat with an image (a base64 data URL) on a tiny random vision-language model (Idefics3, the
SmolVLM architecture): the image reaches the model, and the answer equals ``vllm serve``'s. An
image URL to a loopback address is refused by default (the allowed ones, and redirects, on a real
worker: tests/worker/test_media_urls_worker.py)."""

from __future__ import annotations

import base64
import concurrent.futures
import io
from pathlib import Path

import pytest
from media_server import MediaServer
from PIL import Image
from vllm_server import canonical_stream, normalize, parse_sse, vllm_servers


def data_url(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(served, *images: str, stream: bool = False) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"},
               *({"type": "image_url", "image_url": {"url": url}} for url in images)]
    return {"model": served.served_model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}


# The roots under which vLLM's error answers show a path as <path> (its sanitize_message).
VLLM_HIDDEN_ROOTS = ("home", "usr", "opt", "var", "tmp", "root", "lib", "mnt", "srv")


@pytest.fixture(scope="module")
def server(vlm_env, tmp_path_factory):
    with vllm_servers({"vlm": vlm_env}, tmp_path_factory.mktemp("vllm-serve")) as clients:
        yield clients["vlm"]


def test_the_image_reaches_the_model(vlm_openai, run_openai):
    (text_only,) = run_openai(vlm_openai, "/v1/chat/completions", chat(vlm_openai))
    (red,) = run_openai(vlm_openai, "/v1/chat/completions", chat(vlm_openai, data_url((255, 0, 0))))
    (two,) = run_openai(vlm_openai, "/v1/chat/completions",
                        chat(vlm_openai, data_url((255, 0, 0)), data_url((0, 0, 255))))
    prompts = [answer["usage"]["prompt_tokens"] for answer in (text_only, red, two)]
    assert prompts[0] < prompts[1] < prompts[2]
    assert red["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_an_image_answers_as_vllm_serve(vlm_openai, server, run_openai, stream):
    body = chat(vlm_openai, data_url((0, 128, 255)), stream=stream)
    items = run_openai(vlm_openai, "/v1/chat/completions", body)
    http = server.post("/v1/chat/completions", json=body)
    if stream:
        assert canonical_stream(parse_sse("".join(items))) == canonical_stream(parse_sse(http.text))
    else:
        (item,) = items
        assert normalize(item) == normalize(http.json())


def test_a_broken_image_is_a_400(vlm_openai, run_openai):
    (item,) = run_openai(vlm_openai, "/v1/chat/completions",
                         chat(vlm_openai, "data:image/png;base64,bm90IGFuIGltYWdl"))
    assert item["error"]["code"] == 400


def test_a_local_file_outside_the_allowed_folder_is_a_400_that_names_no_server_path(vlm_openai, server,
                                                                                   run_openai, vlm_env):
    """vLLM's own answer quotes the server's allowed folder; the worker's shows it as <path>. (vLLM
    hides a folder under /tmp, /home and a few more roots itself: a checkout there sees <path> in
    both; the worker's answer is held to the same text either way.)"""
    body = chat(vlm_openai, "file:///etc/hostname")
    (item,) = run_openai(vlm_openai, "/v1/chat/completions", body)
    theirs = server.post("/v1/chat/completions", json=body)
    folder = str(Path(vlm_env["ALLOWED_LOCAL_MEDIA_PATH"]).resolve())  # as vLLM quotes it
    quoted = folder if folder.split("/")[1] not in VLLM_HIDDEN_ROOTS else "<path>"
    assert theirs.status_code == 400
    assert f"--allowed-local-media-path {quoted}`" in theirs.json()["error"]["message"]
    error = item["error"]
    assert error["code"] == 400 and folder not in error["message"] and "/etc/hostname" not in error["message"]
    assert error["message"] == theirs.json()["error"]["message"].replace(folder, "<path>").replace(
        "/etc/hostname", "<path>")


@pytest.fixture(scope="module")
def media_server():
    with MediaServer() as server:
        yield server


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_an_image_url_to_a_loopback_address_is_a_400_and_the_worker_serves_on(vlm_openai, run_openai,
                                                                            media_server, host):
    url = media_server.url(host=host)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a job with an image beside it
        beside = pool.submit(run_openai, vlm_openai, "/v1/chat/completions", chat(vlm_openai, data_url((0, 0, 255))))
        (refused,) = run_openai(vlm_openai, "/v1/chat/completions", chat(vlm_openai, url))
        assert beside.result()[0]["usage"]["completion_tokens"] == 8
    error = refused["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["message"].startswith(f"media URL {url}: ")
    assert "is loopback" in error["message"] and "ALLOWED_PRIVATE_MEDIA_NETWORKS" in error["message"]
    assert media_server.hits == []  # never asked
    (served,) = run_openai(vlm_openai, "/v1/chat/completions", chat(vlm_openai, data_url((255, 0, 0))))
    assert served["usage"]["completion_tokens"] == 8
