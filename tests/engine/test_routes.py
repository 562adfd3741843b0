"""Every route of vLLM's app a job can carry, derived from the app: each route is reviewed as
served or denied, denied ones answer a 404 with the reason, routes outside /v1/ are reachable
under /v1 (RunPod relays only those), worker-vllm 2.24's job shape works, and the pooling, scoring,
token-counting and rendering routes answer on the real engine."""

from __future__ import annotations

import json

import pytest
import sse_events
from conftest import cosine
from vllm_server import created_id
from fastapi.routing import APIRoute

from worker.routes.route_table import DENIED, REVIEWED, unclassified_routes

QUERY = "What is the capital of France?"
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "I like trains."]


def model_of(served) -> str:
    return served.served_model_name


# --- the route table ---------------------------------------------------------------------------

@pytest.mark.parametrize("served", ["tiny_openai", "minilm_openai", "tiny_opt_in_openai"])
def test_every_route_of_the_app_is_reviewed_and_served_unless_denied(request, served):
    served = request.getfixturevalue(served)
    assert unclassified_routes(served.app) == []
    api_paths = {route.path for route in served.app.routes if isinstance(route, APIRoute)}
    assert set(served.routes.routes) == api_paths - set(DENIED)
    assert set(served.routes.routes) <= REVIEWED
    assert all(served.routes.find(path) is None for path in DENIED)


def test_a_route_unknown_to_the_review_is_reported(tiny_openai):
    class App:
        routes = [*tiny_openai.app.routes, APIRoute("/v1/brand_new", lambda: None)]

    assert unclassified_routes(App) == ["/v1/brand_new"]


@pytest.mark.parametrize("route", ["/health", "/metrics", "/v1/load_lora_adapter",
                                   "/inference/v1/abort_requests", "/ping"])
def test_denied_routes_answer_404_with_the_reason(tiny_openai, run_openai, route):
    (item,) = run_openai(tiny_openai, route, {})
    assert item["error"]["code"] == 404 and DENIED[route] in item["error"]["message"]


def test_routes_outside_v1_are_reachable_under_v1(minilm_openai, run_openai):
    body = {"model": model_of(minilm_openai), "input": "Hello"}
    (root,) = run_openai(minilm_openai, "/pooling", body)
    (aliased,) = run_openai(minilm_openai, "/v1/pooling", body)
    assert aliased["data"] == root["data"] and len(root["data"][0]["data"]) == 384
    (cohere,) = run_openai(minilm_openai, "/v1/v2/rerank",
                           {"model": model_of(minilm_openai), "query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in cohere["results"]][0] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_worker_vllm_2_24_job_shape(tiny_openai, run_job, stream):
    (models,) = run_job(tiny_openai, {"route": "/v1/models", "method": "get"})
    assert models["data"][0]["id"] == model_of(tiny_openai)
    body = {"model": model_of(tiny_openai), "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "ignore_eos": True, "temperature": 0, "stream": stream}
    new_shape = run_job(tiny_openai, {"route": "/v1/chat/completions", "body": body, "method": "POST"})
    old_shape = run_job(tiny_openai, {"openai_route": "/v1/chat/completions", "openai_input": body})
    if stream:  # the same answer (vLLM merges deltas a slow reader has not taken: count tokens, not events)
        assert _streamed(new_shape) == _streamed(old_shape) == (4, "length")
    else:
        assert new_shape[0]["choices"] == old_shape[0]["choices"]
        assert new_shape[0]["usage"]["completion_tokens"] == 4


def _streamed(items: list[str]) -> tuple[int, str]:
    """A streamed chat's output tokens (its text's words: the tiny model repeats one) and finish reason."""
    chunks = [json.loads(data) for _, data in sse_events.parse("".join(items)) if data != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return len(text.split()), chunks[-1]["choices"][0]["finish_reason"]


def test_a_method_the_route_does_not_take_is_a_405(tiny_openai, run_job):
    (item,) = run_job(tiny_openai, {"route": "/v1/chat/completions", "method": "GET"})
    assert item["error"]["code"] == 405


# --- routes that answer on the real engine ------------------------------------------------------

def test_count_tokens_matches_the_messages_routes_input_tokens(smol_openai, run_openai):
    body = {"model": model_of(smol_openai), "system": "You are terse.",
            "messages": [{"role": "user", "content": QUERY}]}
    (count,) = run_openai(smol_openai, "/v1/messages/count_tokens", body)
    (message,) = run_openai(smol_openai, "/v1/messages", {**body, "max_tokens": 1})
    assert count["input_tokens"] == message["usage"]["input_tokens"] > 10


def test_score_and_rerank_on_an_embedding_model_are_cosines(minilm_openai, run_openai):
    model = model_of(minilm_openai)
    (embedded,) = run_openai(minilm_openai, "/v1/embeddings", {"model": model, "input": [QUERY, *DOCUMENTS]})
    query, *documents = [d["embedding"] for d in embedded["data"]]
    expected = [cosine(query, document) for document in documents]
    (score,) = run_openai(minilm_openai, "/score", {"model": model, "text_1": QUERY, "text_2": DOCUMENTS})
    (v1_score,) = run_openai(minilm_openai, "/v1/score", {"model": model, "queries": QUERY,
                                                          "documents": DOCUMENTS})
    for answer in (score, v1_score):
        assert [d["score"] for d in answer["data"]] == pytest.approx(expected, abs=1e-4)
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        (ranked,) = run_openai(minilm_openai, route, {"model": model, "query": QUERY, "documents": DOCUMENTS})
        order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
        assert [r["index"] for r in ranked["results"]] == order and order[0] == 1
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
            [expected[i] for i in order], abs=1e-4)


def test_pooling_and_cohere_embed_give_the_embedding(minilm_openai, run_openai):
    model = model_of(minilm_openai)
    (embedded,) = run_openai(minilm_openai, "/v1/embeddings", {"model": model, "input": QUERY})
    (pooled,) = run_openai(minilm_openai, "/pooling", {"model": model, "input": QUERY})
    (cohere,) = run_openai(minilm_openai, "/v2/embed", {"model": model, "texts": [QUERY],
                                                        "embedding_types": ["float"]})
    expected = embedded["data"][0]["embedding"]
    assert cosine(pooled["data"][0]["data"], expected) > 0.9999
    assert cosine(cohere["embeddings"]["float"][0], expected) > 0.9999


def test_render_routes_give_the_tokens_generation_would_use(tiny_opt_in_openai, run_openai):
    model = model_of(tiny_opt_in_openai)
    messages = [{"role": "user", "content": QUERY}]
    (rendered,) = run_openai(tiny_opt_in_openai, "/v1/chat/completions/render",
                             {"model": model, "messages": messages})
    (tokenized,) = run_openai(tiny_opt_in_openai, "/tokenize", {"model": model, "messages": messages})
    (chat,) = run_openai(tiny_opt_in_openai, "/v1/chat/completions",
                         {"model": model, "messages": messages, "max_tokens": 1})
    assert rendered_ids(rendered) == tokenized["tokens"]
    assert len(tokenized["tokens"]) == chat["usage"]["prompt_tokens"]


def rendered_ids(rendered) -> list[int]:
    """The prompt token ids of a render answer (a GenerateRequest, or a list of them)."""
    request = rendered[0] if isinstance(rendered, list) else rendered
    return request["token_ids"]


def test_tokens_in_generation_continues_the_given_tokens(tiny_opt_in_openai, run_openai):
    model = model_of(tiny_opt_in_openai)
    (tokenized,) = run_openai(tiny_opt_in_openai, "/tokenize", {"model": model, "prompt": "Once upon"})
    body = {"model": model, "token_ids": tokenized["tokens"],
            "sampling_params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}
    (generated,) = run_openai(tiny_opt_in_openai, "/inference/v1/generate", body)
    (completion,) = run_openai(tiny_opt_in_openai, "/v1/completions",
                               {"model": model, "prompt": tokenized["tokens"], "max_tokens": 5,
                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert generated["choices"][0]["token_ids"] == completion["choices"][0]["token_ids"]


# --- answers that are not JSON, routes with parameters, opt-in routes ---------------------------

def test_bytes_embeddings_travel_intact_in_an_envelope(minilm_openai, run_openai):
    import base64
    import json as json_module
    import struct

    model = model_of(minilm_openai)
    (floats,) = run_openai(minilm_openai, "/v1/embeddings", {"model": model, "input": [QUERY, "Hi"]})
    for encoding in ("bytes", "bytes_only"):
        (item,) = run_openai(minilm_openai, "/v1/embeddings",
                             {"model": model, "input": [QUERY, "Hi"], "encoding_format": encoding})
        answer = item["http_response"]
        assert answer["status"] == 200 and answer["content_type"] == "application/octet-stream"
        raw = base64.b64decode(answer["body_base64"])
        assert len(raw) == 2 * 384 * 4  # float32, little endian (vLLM's default)
        values = struct.unpack(f"<{2 * 384}f", raw)
        for i, expected in enumerate(d["embedding"] for d in floats["data"]):
            assert cosine(values[i * 384:(i + 1) * 384], expected) > 0.9999
        assert ("metadata" in answer["headers"]) == (encoding == "bytes")
        if encoding == "bytes":
            assert len(json_module.loads(answer["headers"]["metadata"])["data"]) == 2


def test_the_batch_route_answers_one_choice_per_conversation(tiny_openai, run_openai):
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    (batch,) = run_openai(tiny_openai, "/v1/chat/completions/batch",
                          {"model": model_of(tiny_openai), "messages": conversations, "max_tokens": 3,
                           "ignore_eos": True, "temperature": 0})
    assert [choice["index"] for choice in batch["choices"]] == [0, 1]
    assert batch["usage"]["completion_tokens"] == 6


def test_tokenizer_info_is_reachable_under_v1(tiny_opt_in_openai, run_openai):
    (info,) = run_openai(tiny_opt_in_openai, "/v1/tokenizer_info", method="GET")
    (root,) = run_openai(tiny_opt_in_openai, "/tokenizer_info", method="GET")
    assert info == root and info["tokenizer_class"]


def test_stored_responses_are_retrieved_replayed_and_cancelled_by_id(tiny_opt_in_openai, run_openai):
    # vLLM keeps a response's events for replay when it ran in the background, streamed.
    body = {"model": model_of(tiny_opt_in_openai), "input": "Hello", "max_output_tokens": 4,
            "temperature": 0, "background": True, "stream": True}
    streamed = "".join(run_openai(tiny_opt_in_openai, "/v1/responses", body))
    route = f"/v1/responses/{created_id(streamed)}"
    (retrieved,) = run_openai(tiny_opt_in_openai, route, method="GET")
    assert retrieved["status"] == "incomplete" and retrieved["usage"]["output_tokens"] == 4  # max_output_tokens
    replay = "".join(run_openai(tiny_opt_in_openai, route + "?stream=true", method="GET"))
    assert replay.count("event: ") == streamed.count("event: ") >= 4
    assert "response.completed" in replay and retrieved["id"] in replay
    later = "".join(run_openai(tiny_opt_in_openai, route + "?stream=true&starting_after=1", method="GET"))
    assert later.count("event: ") == replay.count("event: ") - 2  # the query string reached vLLM
    (cancelled,) = run_openai(tiny_opt_in_openai, route + "/cancel")
    assert cancelled["error"]["code"] == 400 and "Cannot cancel" in cancelled["error"]["message"]


def test_an_unknown_stored_response_says_it_may_live_on_another_worker(tiny_opt_in_openai, run_openai):
    for route in ("/v1/responses/resp_unknown", "/v1/responses/resp_unknown/cancel"):
        (item,) = run_openai(tiny_opt_in_openai, route, method="GET" if "cancel" not in route else None)
        assert item["error"]["code"] == 404
        assert "resp_unknown" in item["error"]["message"] and "another" in item["error"]["message"]
