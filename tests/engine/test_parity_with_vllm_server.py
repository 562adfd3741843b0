"""The proof of compatibility: for the same body, the worker's answer equals (ids and times
aside) what vLLM's own HTTP server answers, on the same model with the same flags."""

from __future__ import annotations

import json

import pytest
from conftest import opt_in_env
from vllm_server import canonical_stream, created_id, normalize, parse_sse, vllm_servers

from worker.wire.body_envelope import Envelope


@pytest.fixture(scope="module")
def servers(tiny_env, minilm_env, tmp_path_factory):
    # The opt-in routes on for the tiny model (the worker serves them from a second app, OPT_IN).
    envs = {"tiny": {**tiny_env, **opt_in_env()}, "minilm": minilm_env}
    with vllm_servers(envs, tmp_path_factory.mktemp("vllm-serve")) as clients:
        yield clients


TINY, OPT_IN, MINILM = "tiny", "tiny-opt-in", "minilm"
CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12, "temperature": 0}
QUERY, DOCUMENTS = "What is the capital of France?", ["Bananas are yellow.", "Paris is the capital."]
CASES = [
    (TINY, "GET", "/v1/models", None),
    (TINY, "POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}),
    (TINY, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "n": 2, "logprobs": 2,
                                       "seed": 1, "temperature": 0.8}),
    (TINY, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 6, "temperature": 0,
                                       "model": "tiny-lora"}),
    (TINY, "POST", "/v1/chat/completions", CHAT),
    (TINY, "POST", "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
    (TINY, "POST", "/v1/responses", {"input": "Tell me a story", "max_output_tokens": 12,
                                     "temperature": 0}),
    (TINY, "POST", "/v1/messages", CHAT),
    (TINY, "POST", "/tokenize", {"prompt": "Hello world"}),
    (TINY, "POST", "/detokenize", {"tokens": [5, 6, 7]}),
    (TINY, "POST", "/v1/chat/completions", {"messages": "not a list"}),
    (TINY, "POST", "/v1/chat/completions", {**CHAT, "model": "no-such-model"}),
    (TINY, "POST", "/v1/messages/count_tokens", {"messages": CHAT["messages"], "system": "Be brief."}),
    (TINY, "POST", "/v1/chat/completions/batch",
     {"messages": [CHAT["messages"], [{"role": "user", "content": "Hi"}]], "max_tokens": 6,
      "temperature": 0}),
    (OPT_IN, "POST", "/v1/chat/completions/render", {"messages": CHAT["messages"]}),
    (OPT_IN, "POST", "/v1/completions/render", {"prompt": "Once upon a time"}),
    (OPT_IN, "POST", "/v1/messages/render", {"messages": CHAT["messages"], "max_tokens": 5}),
    (OPT_IN, "POST", "/inference/v1/generate",
     {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 6, "temperature": 0}}),
    (MINILM, "POST", "/v1/embeddings", {"input": ["The capital of France is Paris.", "Hello"]}),
    (MINILM, "POST", "/pooling", {"input": "The capital of France is Paris."}),
    (MINILM, "POST", "/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    (MINILM, "POST", "/v1/score", {"queries": QUERY, "documents": DOCUMENTS}),
    (MINILM, "POST", "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}),
    (MINILM, "POST", "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    (MINILM, "POST", "/v2/embed", {"texts": [QUERY], "embedding_types": ["float"]}),
    (MINILM, "POST", "/v1/embeddings", {"input": [QUERY, "Hello"], "encoding_format": "bytes"}),
    (MINILM, "POST", "/v1/embeddings", {"input": [QUERY, "Hello"], "encoding_format": "bytes_only"}),
    (OPT_IN, "GET", "/tokenizer_info", None),
]
STREAMABLE = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}


def case_id(case) -> str:
    model, _, route, body = case
    return f"{model}{route}" + "".join(f"-{body[key]}" for key in ("model", "encoding_format")
                                       if body and key in body)


PARAMS = [pytest.param(case, stream, id=f"{case_id(case)}-{'stream' if stream else 'json'}")
          for case in CASES for stream in (False, True) if not stream or case[2] in STREAMABLE]


@pytest.fixture(scope="module")
def workers(tiny_openai, tiny_opt_in_openai, minilm_openai):
    return {TINY: tiny_openai, OPT_IN: tiny_opt_in_openai, MINILM: minilm_openai}


@pytest.mark.parametrize(("case", "stream"), PARAMS)
def test_worker_answers_as_vllm_serve(servers, workers, run_openai, case, stream):
    model, method, route, body = case
    worker = workers[model]
    if body is not None:
        body = {"model": worker.served_model_name, **body, **({"stream": True} if stream else {})}
    items = run_openai(worker, route, body)
    http = servers[model.removesuffix("-opt-in")].request(method, route, json=body)
    if stream and http.headers["content-type"].startswith("text/event-stream"):
        assert all(isinstance(item, str) for item in items)
        assert canonical_stream(parse_sse("".join(items))) == canonical_stream(parse_sse(http.text))
    elif envelope := Envelope.from_output(items[0]):  # a binary answer, carried whole
        assert (envelope.status, envelope.content_type) == (http.status_code, http.headers["content-type"])
        assert envelope.body == http.content and len(http.content) > 1000
        metadata = [json.loads(side["metadata"]) if "metadata" in side else None
                    for side in (envelope.headers, http.headers)]
        assert normalize(metadata[0]) == normalize(metadata[1])
    else:
        (item,) = items
        assert normalize(item) == normalize(without_server_paths(http.json()) if route == "/v1/models" else http.json())
        if http.status_code >= 400:
            assert item["error"]["code"] == http.status_code


def without_server_paths(listing: dict) -> dict:
    """vLLM's /v1/models as the worker shows it: a card whose ``root`` is a server folder (a local
    model's, an adapter's) shows its id there instead (issue 43: no answer carries a server path)."""
    for card in listing["data"]:
        if card["root"].startswith("/"):
            card["root"] = card["id"]
    return listing


def test_stored_responses_answer_as_vllm_serve(servers, tiny_opt_in_openai, run_openai):
    """Retrieve, replay and cancel by id, each side with the id it gave; an unknown id is vLLM's 404,
    with the worker's note that the store is one worker's."""
    worker, server = tiny_opt_in_openai, servers["tiny"]
    body = {"model": worker.served_model_name, "input": "Tell me a story", "max_output_tokens": 8,
            "temperature": 0, "background": True, "stream": True}
    mine = "".join(run_openai(worker, "/v1/responses", body))
    theirs = server.post("/v1/responses", json=body).text
    assert canonical_stream(parse_sse(mine)) == canonical_stream(parse_sse(theirs))
    for suffix, method in (("", "GET"), ("?stream=true", "GET"), ("?stream=true&starting_after=2", "GET"),
                           ("/cancel", "POST")):
        items = run_openai(worker, f"/v1/responses/{created_id(mine)}{suffix}", method=method)
        http = server.request(method, f"/v1/responses/{created_id(theirs)}{suffix}")
        if "stream" in suffix:
            assert canonical_stream(parse_sse("".join(items))) == canonical_stream(parse_sse(http.text))
        else:
            assert normalize(items[0]) == normalize(http.json())
    (missing,) = run_openai(worker, "/v1/responses/resp_missing", method="GET")
    http = server.get("/v1/responses/resp_missing")
    assert http.status_code == missing["error"]["code"] == 404
    assert missing["error"]["message"].startswith(http.json()["error"]["message"])
    assert "another" in missing["error"]["message"]
