"""Chat with an image (a base64 data URL) on a tiny random vision-language model (Idefics3, the
SmolVLM architecture): the image reaches the model, and the answer equals ``vllm serve``'s."""

from __future__ import annotations

import base64
import io

import pytest
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
