"""The ASGI exchanges of the worker's HTTP face (``load_balancer/app``), none of them vLLM's: a
request's headers and its body, read within a limit and handed on to vLLM's app as if unread; its
client's disconnect, which cancels the work; JSON responses; and ``Reply``, the app's ``send`` to
vLLM's app, which notes how far the response has got (so that a deadline can end it) and puts vLLM's
JSON errors in the route's dialect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from worker.routes.route_table import Route
from worker.wire import nesting
from worker.wire.body_envelope import is_json
from worker.wire.dialects import anthropic_status
from worker.wire.errors import ErrorPayload
from worker.wire.sse import frame

__all__ = ["BodyTooLarge", "Reply", "content_length", "read_body", "replay_body", "send_json", "status_of",
           "too_deep", "until_disconnect"]


def status_of(error: ErrorPayload) -> int:
    """An error item's HTTP status, which both dialects carry (Anthropic's as its type)."""
    inner = error["error"]
    return int(inner["code"]) if "code" in inner else anthropic_status(inner.get("type"))


async def send_json(send: Callable, status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _header(scope: dict, name: bytes) -> str | None:
    value = next((v for k, v in scope["headers"] if k == name), None)
    return None if value is None else value.decode("latin-1")


def content_length(scope: dict) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


class BodyTooLarge(Exception):
    """The request's body passed the limit it is read within."""


async def read_body(receive: Callable, limit: int) -> bytes | None:
    """The request's body, read until it ends or passes ``limit`` (BodyTooLarge: the rest is left
    unread, however it is sent: chunked, or past a Content-Length that said less); None: the client
    left."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def replay_body(body: bytes, receive: Callable) -> Callable:
    """``receive`` for vLLM's app: the body read already, then the client's own messages (vLLM's
    routes watch them for a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay


def too_deep(scope: dict, body: bytes) -> bool:
    """Whether a JSON body nests deeper than the worker serves (``wire/nesting``). FastAPI reads a
    body without a content type as JSON too; one that is not JSON is vLLM's to answer."""
    content_type = _header(scope, b"content-type")
    if not body or (content_type is not None and not is_json(content_type)):
        return False
    try:
        return nesting.too_deep(nesting.loads(body))
    except ValueError:
        return False


@contextlib.asynccontextmanager
async def until_disconnect(receive: Callable) -> AsyncIterator[None]:
    """The body runs until it ends or the client disconnects, which cancels it (vLLM then aborts the
    job's request). vLLM's own routes watch for this themselves."""
    task, gone = asyncio.current_task(), False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()  # the client left: nothing is left to answer
    finally:
        watcher.cancel()


class Reply:
    """The app's ``send``, noting how far the response has got, so that a deadline can end it, and
    putting vLLM's JSON errors in the route's dialect (``Route.error_item``, as on the queue)."""

    def __init__(self, send: Callable, route: Route) -> None:
        self._send, self._route = send, route
        self.status = 0  # none sent yet
        self.stream = False
        self.ended = False
        self._error: list[bytes] | None = None  # a JSON error's body, held until it is whole

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            content_type = next((v for k, v in message.get("headers", ()) if k == b"content-type"), b"").decode()
            self.stream = content_type.startswith("text/event-stream")
            if self.status >= HTTPStatus.BAD_REQUEST and is_json(content_type):
                self._error = []
                return
        elif self._error is not None:
            self._error.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.ended = True
                await self._send_error(b"".join(self._error))
            return
        elif not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def _send_error(self, body: bytes) -> None:
        try:
            content = json.loads(body) if body else {}
        except ValueError:
            content = {"detail": body.decode(errors="replace")}
        await send_json(self._send, self.status, self._route.error_item(self.status, content))

    async def end_with(self, error: ErrorPayload) -> None:
        """Ends the response with ``error``: the whole answer, or the stream's last event."""
        if not self.status or self._error is not None:
            await send_json(self._send, status_of(error), error)
        elif not self.ended:
            prefix = "event: error\n" if self._route.anthropic else ""
            event = prefix + frame(error) if self.stream else ""
            await self._send({"type": "http.response.body", "body": event.encode(), "more_body": False})
