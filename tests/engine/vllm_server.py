"""vLLM's own HTTP server beside the worker, for the parity tests: the same model and flags."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sse_events
from starts import record

from worker.wire import sse
from worker.config.engine_args import resolve_args

# Values that differ between any two calls (sequence numbers: see canonical_stream).
VOLATILE_KEYS = frozenset({"id", "request_id", "created", "created_at", "item_id", "completed_at",
                           "sequence_number"})


def _healthy(server: httpx.Client) -> bool:
    try:
        return server.get("/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def vllm_servers(envs: dict[str, dict[str, str]], folder: Path) -> Iterator[dict[str, httpx.Client]]:
    """vLLM's HTTP server (python -m vllm.entrypoints.launchers.api_server.entry) per named env,
    as a client for it. Each listens on its own Unix socket: no TCP port to pick, which another
    server (or the engine's own free-port probe) could take before vLLM binds it."""
    servers, procs = {}, []
    for name, env in envs.items():
        log, uds = folder / f"{name}.log", folder / f"{name}.sock"
        argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", *resolve_args(env).serve_argv(),
                "--uds", str(uds)]
        # vLLM's own env vars (VLLM_ENABLE_RESPONSES_API_STORE, ...) are the process's, as for the worker.
        process_env = {**os.environ, **{k: v for k, v in env.items() if k.startswith("VLLM_")}}
        procs.append((subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=process_env),
                      log))
        servers[name] = httpx.Client(transport=httpx.HTTPTransport(uds=str(uds)), base_url="http://vllm",
                                     timeout=120)
    try:
        started = time.monotonic()
        deadline = started + 300 * len(envs)
        for (proc, log), server in zip(procs, servers.values(), strict=True):
            while not _healthy(server):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM server did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
            record("vllm serve", time.monotonic() - started)
        yield servers
    finally:
        for server in servers.values():
            server.close()
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=60)


def normalize(value):
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE_KEYS else normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def parse_sse(text: str) -> list[tuple[str | None, object]]:
    return [(name, data if data == sse.DONE else normalize(json.loads(data)))
            for name, data in sse_events.parse(text)]


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
        if "role" in choice.get("delta", {}):  # a chat stream's first chunk, before any text
            return None
        # A step's text may be empty (a token that ends no character yet): still a delta, which a
        # later step's may absorb.
        text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
        return (data["object"], choice["index"]), text or "", choice.get("finish_reason")
    return None


def canonical_stream(events) -> tuple[list, dict]:
    """A stream with its generated text joined per position.

    vLLM merges the tokens of two engine steps into one event when its consumer is a step
    behind, so how text is split into events depends on timing, not on the answer: so does whether
    a step whose text is empty has an event of its own.
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


def created_id(sse_text: str) -> str:
    """The response id in a Responses API stream's ``response.created`` event."""
    (created,) = [json.loads(data) for name, data in sse_events.parse(sse_text) if name == "response.created"]
    return created["response"]["id"]
