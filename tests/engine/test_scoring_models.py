"""A cross-encoder (a 1-label sequence classifier) and a 3-label classifier on the real engine:
/score, /rerank and /classify answer with consistent content, and as ``vllm serve`` answers."""

from __future__ import annotations

import pytest
from vllm_server import normalize, vllm_servers

QUERY = "What is the capital of France?"
DOCUMENTS = ["Bananas are yellow.", "Paris is the capital of France.", "I like trains."]
TEXTS = ["I love this!", "This is terrible.", "It is a chair."]


@pytest.fixture(scope="module")
def servers(cross_encoder_env, classifier_env, tmp_path_factory):
    envs = {"cross-encoder": cross_encoder_env, "classifier": classifier_env}
    with vllm_servers(envs, tmp_path_factory.mktemp("vllm-serve")) as clients:
        yield clients


def paths(served) -> set[str]:
    return {getattr(route, "path", None) for route in served.app.routes}


def test_a_cross_encoder_scores_and_ranks_consistently(cross_encoder_openai, run_openai):
    model = cross_encoder_openai.served_model_name
    assert {"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"} <= paths(cross_encoder_openai)
    (score,) = run_openai(cross_encoder_openai, "/score", {"model": model, "text_1": QUERY,
                                                          "text_2": DOCUMENTS})
    scores = [d["score"] for d in score["data"]]
    assert all(0 < s < 1 for s in scores) and len({round(s, 3) for s in scores}) == 3
    (v1,) = run_openai(cross_encoder_openai, "/v1/score", {"model": model, "queries": QUERY,
                                                           "documents": DOCUMENTS})
    assert [d["score"] for d in v1["data"]] == pytest.approx(scores, abs=1e-5)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        (ranked,) = run_openai(cross_encoder_openai, route, {"model": model, "query": QUERY,
                                                             "documents": DOCUMENTS})
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
            [scores[i] for i in order], abs=1e-5)


def test_a_classifier_gives_a_distribution_over_its_labels(classifier_openai, run_openai):
    assert "/classify" in paths(classifier_openai) and "/score" not in paths(classifier_openai)
    model = classifier_openai.served_model_name
    (answer,) = run_openai(classifier_openai, "/classify", {"model": model, "input": TEXTS})
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    labels = ["negative", "neutral", "positive"]
    for item in answer["data"]:
        assert item["num_classes"] == 3 and sum(item["probs"]) == pytest.approx(1, abs=1e-4)
        assert item["label"] == labels[max(range(3), key=item["probs"].__getitem__)]
    (single,) = run_openai(classifier_openai, "/v1/classify", {"model": model, "input": TEXTS[0]})
    assert single["data"][0]["probs"] == pytest.approx(answer["data"][0]["probs"], abs=1e-5)


CASES = [
    ("cross-encoder", "/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ("cross-encoder", "/v1/score", {"queries": QUERY, "documents": DOCUMENTS}),
    ("cross-encoder", "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
    ("cross-encoder", "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ("classifier", "/classify", {"input": TEXTS}),
    ("classifier", "/classify", {"input": "x" * 5000}),  # too long: vLLM's own error
]


@pytest.mark.parametrize(("model", "route", "body"), CASES, ids=[f"{m}{r}" for m, r, _ in CASES])
def test_worker_answers_as_vllm_serve(request, servers, run_openai, model, route, body):
    served = request.getfixturevalue(model.replace("-", "_") + "_openai")
    body = {"model": served.served_model_name, **body}
    (item,) = run_openai(served, route, body)
    http = servers[model].post(route, json=body)
    assert normalize(item) == normalize(http.json())
