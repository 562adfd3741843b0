"""Calls an ASGI app in-process, streaming the response body as the app sends it.

The worker serves OpenAI routes with vLLM's own FastAPI app (the one ``vllm serve`` runs), so
requests get exactly vLLM's validation, routing, error bodies and SSE framing, without a socket.
Closing the response stream tells the app the client disconnected, which makes vLLM abort the
request. Pure asyncio: no vLLM here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Response", "request"]

_APP_DONE: dict = {"type": "app.done"}
# How long the app gets to wind down (abort its engine request) after the client goes away.
_DRAIN_SECONDS = 5.0


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: AsyncIterator[bytes]

    @property
    def is_event_stream(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")


@contextlib.asynccontextmanager
async def request(app: Any, method: str, path: str, body: Any = None) -> AsyncIterator[Response]:
    """``async with request(app, "POST", "/v1/completions", {...}) as response: ...``"""
    payload = b"" if body is None else json.dumps(body).encode()
    messages: asyncio.Queue[dict] = asyncio.Queue()
    disconnected = asyncio.Event()
    pending = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode())],
        "state": {},
    }
    task = asyncio.create_task(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(_APP_DONE))

    async def next_message() -> dict:
        message = await messages.get()
        if message is _APP_DONE:  # the app returned or failed without finishing its response
            raise task.exception() or RuntimeError(f"{method} {path}: the app sent no complete response")
        return message

    async def body() -> AsyncIterator[bytes]:
        while True:
            message = await next_message()
            if message["type"] != "http.response.body":
                continue
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    try:
        start = await next_message()
        headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
        yield Response(start["status"], headers, body())
    finally:
        disconnected.set()  # vLLM's handlers watch for this and abort the request
        await asyncio.wait({task}, timeout=_DRAIN_SECONDS)
        task.cancel()
        if task.done() and not task.cancelled():
            task.exception()  # already reported through the response; mark it retrieved
