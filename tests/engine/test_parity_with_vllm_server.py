"""The proof of compatibility: for the same body, the worker's answer equals (ids and times
aside) what vLLM's own HTTP server answers, on the same model with the same flags."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time

import httpx
import pytest

from engine_args import ZERO_MEANS_UNSET, resolve_args
from openai_engine import OpenAIvLLMEngine

# Values that differ between any two calls (sequence numbers: see canonical_stream).
VOLATILE_KEYS = frozenset({"id", "request_id", "created", "created_at", "item_id", "completed_at",
                           "sequence_number"})


def serve_argv(env: dict[str, str]) -> list[str]:
    """`vllm serve` flags equal to the worker's resolved configuration."""
    resolved = resolve_args(env)
    return [token for setting in resolved.settings.values()
            if not (setting.dest in ZERO_MEANS_UNSET and getattr(resolved.namespace, setting.dest) is None)
            for token in setting.tokens]


@pytest.fixture(scope="module")
def vllm_servers(tiny_env, minilm_env, tmp_path_factory):
    """vLLM's HTTP server (python -m vllm.entrypoints.launchers.api_server.entry) per model, as a
    client for it. Each listens on its own Unix socket: no TCP port to pick, which another server
    (or the engine's own free-port probe) could take before vLLM binds it."""
    servers, procs = {}, []
    # Scale-out (render, token-in) routes on for the tiny model; the worker has its own engine for them.
    for name, env in (("tiny", {**tiny_env, "ENABLE_SCALE_OUT": "true"}), ("minilm", minilm_env)):
        folder = tmp_path_factory.mktemp("vllm-serve")
        log, uds = folder / f"{name}.log", folder / f"{name}.sock"
        argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", *serve_argv(env),
                "--uds", str(uds)]
        procs.append((subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT), log))
        servers[name] = httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://vllm",
                                     timeout=120)
    try:
        deadline = time.monotonic() + 300
        for (proc, log), server in zip(procs, servers.values(), strict=True):
            while not _healthy(server):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield servers
    finally:
        for server in servers.values():
            server.close()
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=60)


def _healthy(server: httpx.Client) -> bool:
    try:
        return server.get("/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def normalize(value):
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE_KEYS else normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def parse_sse(text: str) -> list[tuple[str | None, object]]:
    events = []
    for block in filter(str.strip, text.split("\n\n")):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        events.append((name, data if data == "[DONE]" else normalize(json.loads(data))))
    return events


def _text_delta(data) -> tuple[tuple, str, object] | None:
    """(stream position, text, finish reason) when an event carries generated text."""
    if not isinstance(data, dict):
        return None
    if data.get("type") == "response.output_text.delta":
        return ("response", data["output_index"], data["content_index"]), data["delta"], None
    if data.get("type") == "content_block_delta" and "text" in data["delta"]:
        return ("message", data["index"]), data["delta"]["text"], None
    if data.get("object") in ("chat.completion.chunk", "text_completion") and data["choices"]:
        (choice,) = data["choices"]
        text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        if text or choice.get("finish_reason"):
            return (data["object"], choice["index"]), text or "", choice.get("finish_reason")
    return None


def canonical_stream(events) -> tuple[list, dict]:
    """A stream with its generated text joined per position.

    vLLM merges the tokens of two engine steps into one event when its consumer is a step
    behind, so how text is split into events depends on timing, not on the answer.
    """
    others, texts = [], {}
    for name, data in events:
        delta = _text_delta(data)
        if delta is None:
            others.append((name, data))
            continue
        position, text, finish = delta
        joined, finishes = texts.get(position, ("", []))
        texts[position] = (joined + text, finishes + ([finish] if finish else []))
    return others, texts


TINY, SCALE_OUT, MINILM = "tiny", "tiny-scale-out", "minilm"
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
     {"messages": [CHAT["messages"], [{"role": "user", "content": "Hi"}]], "max_tokens": 6, "temperature": 0}),
    (SCALE_OUT, "POST", "/v1/chat/completions/render", {"messages": CHAT["messages"]}),
    (SCALE_OUT, "POST", "/v1/completions/render", {"prompt": "Once upon a time"}),
    (SCALE_OUT, "POST", "/v1/messages/render", {"messages": CHAT["messages"], "max_tokens": 5}),
    (SCALE_OUT, "POST", "/inference/v1/generate",
     {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 6, "temperature": 0}}),
    (MINILM, "POST", "/v1/embeddings", {"input": ["The capital of France is Paris.", "Hello"]}),
    (MINILM, "POST", "/pooling", {"input": "The capital of France is Paris."}),
    (MINILM, "POST", "/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    (MINILM, "POST", "/v1/score", {"queries": QUERY, "documents": DOCUMENTS}),
    (MINILM, "POST", "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}),
    (MINILM, "POST", "/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    (MINILM, "POST", "/v2/embed", {"texts": [QUERY], "embedding_types": ["float"]}),
]
STREAMABLE = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}


def case_id(case) -> str:
    model, _, route, body = case
    return f"{model}{route}" + (f"-{body['model']}" if body and "model" in body else "")


PARAMS = [pytest.param(case, stream, id=f"{case_id(case)}-{'stream' if stream else 'json'}")
          for case in CASES for stream in (False, True) if not stream or case[2] in STREAMABLE]


@pytest.fixture(scope="module")
def workers(tiny_engine, tiny_openai, minilm_openai):
    namespace = copy.copy(tiny_engine.config.args.namespace)
    namespace.enable_scale_out = True
    return {TINY: tiny_openai, SCALE_OUT: OpenAIvLLMEngine(tiny_engine, namespace), MINILM: minilm_openai}


@pytest.mark.parametrize(("case", "stream"), PARAMS)
def test_worker_answers_as_vllm_serve(vllm_servers, workers, run_openai, case, stream):
    model, method, route, body = case
    worker = workers[model]
    if body is not None:
        body = {"model": worker.served_model_name, **body, **({"stream": True} if stream else {})}
    items = run_openai(worker, route, body)
    http = vllm_servers[model.removesuffix("-scale-out")].request(method, route, json=body)
    if stream and http.headers["content-type"].startswith("text/event-stream"):
        assert all(isinstance(item, str) for item in items)
        assert canonical_stream(parse_sse("".join(items))) == canonical_stream(parse_sse(http.text))
    else:
        (item,) = items
        assert normalize(item) == normalize(http.json())
        if http.status_code >= 400:
            assert item["error"]["code"] == http.status_code
