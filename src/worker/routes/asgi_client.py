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
from typing import Any

from worker.wire.sse import event_ends

__all__ = ["Response", "request"]

# How long the app gets to wind down (abort its engine request) after the client goes away.
_DRAIN_SECONDS = 5.0


class _Channel:
    """The app's ``send``: the response start, then body chunks buffered until the reader wants them.

    The reader is woken only once the buffer holds what it waits for (any chunk, or a number of
    complete SSE events), so a stream of one event per engine step costs the reader one wake-up per
    stream batch rather than one per event.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.start: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self.chunks: list[bytes] = []
        self.events = 0  # event ends in ``chunks``
        self._tail = b""  # the last byte received: an event end may straddle two chunks
        self.ended = False
        self.failure: BaseException | None = None
        self._wanted = 0
        self._waiter: asyncio.Future | None = None

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.body":  # once per SSE event: kept lean
            if body := message.get("body"):
                self.chunks.append(body)
                self.events += event_ends(body, self._tail)
                self._tail = body[-1:]
            if not message.get("more_body", False):
                self.ended = True
            self._wake()
        elif kind == "http.response.start":
            self.start.set_result(message)

    def app_done(self, task: asyncio.Task) -> None:
        """The app returned or failed: without a complete response, that is the reader's error."""
        failure = None if task.cancelled() else task.exception()
        failure = failure or RuntimeError(f"{self.what}: the app sent no complete response")
        if not self.start.done():
            self.start.set_exception(failure)
        elif not self.ended:
            self.failure, self.ended = failure, True
            self._wake()

    def _ready(self) -> bool:
        return self.ended or (bool(self.chunks) and self.events >= self._wanted)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done() and self._ready():
            self._waiter.set_result(None)

    async def take(self, events: int = 0) -> list[bytes]:
        """The buffered chunks, once they hold ``events`` event ends or the body ended; [] at its end."""
        self._wanted = events
        while not self._ready():
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        taken, self.chunks, self.events = self.chunks, [], 0
        if not taken and self.failure is not None:
            raise self.failure
        return taken


class Response:
    def __init__(self, start: dict, channel: _Channel) -> None:
        self.status: int = start["status"]
        self.headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
        self._channel = channel
        self.body: AsyncIterator[bytes] = self._chunks()  # chunk by chunk, as the app sent them

    @property
    def is_event_stream(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    async def _chunks(self) -> AsyncIterator[bytes]:
        while chunks := await self._channel.take():
            for chunk in chunks:
                yield chunk

    async def read_events(self, count: int) -> bytes:
        """The body received since the last read, once it completes ``count`` more SSE events (or
        the body ended, with what is left); ``b""`` at the end."""
        return b"".join(await self._channel.take(events=count))


@contextlib.asynccontextmanager
async def request(app: Any, method: str, path: str, body: Any = None,
                  content_type: str = "application/json", query: str = "") -> AsyncIterator[Response]:
    """``async with request(app, "POST", "/v1/completions", {...}) as response: ...``

    ``body`` is sent as JSON, or as it is when it is bytes (of ``content_type``); ``query`` is the
    URL's query string, without its ``?``."""
    payload = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
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
        "query_string": query.encode(), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", content_type.encode()),
                    (b"content-length", str(len(payload)).encode())],
        "state": {},
    }
    channel = _Channel(f"{method} {path}")
    task = asyncio.create_task(app(scope, receive, channel.send))
    task.add_done_callback(channel.app_done)
    try:
        yield Response(await channel.start, channel)
    finally:
        disconnected.set()  # vLLM's handlers watch for this and abort the request
        if not task.done():
            await asyncio.wait({task}, timeout=_DRAIN_SECONDS)
            task.cancel()
        if task.done() and not task.cancelled():
            task.exception()  # already reported through the response; mark it retrieved
