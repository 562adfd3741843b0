"""``WorkerApp``: the worker's HTTP face on a load-balancing endpoint, the ASGI app that
``load_balancer/server`` runs.

RunPod's balancer sends each request, with the caller's path, straight to a worker whose
``GET /ping`` answered 200:

- ``/ping``: 204 while the worker starts; 200 once it serves, and while it answers a failed start
  with the cause (as a queue worker answers jobs, so that callers learn why); 503 once it drains
  after SIGTERM, or once its engine has died;
- the routes a queue job may call (``routes/route_table``: vLLM's app less its admin and
  operational routes; a root route such as ``/tokenize`` also as ``/v1/tokenize``), answered by the
  same app the queue path calls in-process: vLLM's statuses, errors and events, each event sent as
  vLLM writes it;
- ``POST /runsync``: a job ``{"input": {...}}`` as a queue endpoint takes it (raw, or
  ``openai_route``), answered as RunPod's /runsync answers: ``{"id", "status": "COMPLETED",
  "output": [items]}``, or ``"status": "FAILED"`` with the job's error text and the error's status;
- ``POST /stream``: the same input, its items as server-sent events as the engine produces them
  (``data: <item>``, and ``data: [DONE]`` at the end; an item that is SSE text, an OpenAI stream's,
  as it is): stream batching saves posts to RunPod's queue, which this path does not make, so its
  knobs are ignored;
- anything else: a 404 naming the routes served (or, for the queue's ``/run``, ``/status``, ...,
  saying that there is no queue).

A request body is read within RunPod's limit (``MAX_BODY_BYTES``): past it, a 413, and the rest is
left unread, whether its Content-Length said so or not (a chunked body). A JSON body or job input
nested deeper than ``wire/nesting.MAX_DEPTH`` gets a 400 that says so. On a health port of its own
(PORT_HEALTH), ``PingOnly`` answers ``/ping`` and nothing else.

Every request but ``/ping`` runs within the job deadlines (``jobs/deadlines``): the smaller of
JOB_TIMEOUT and REQUEST_TIMEOUT (raw jobs: also their ``timeout``) and the grace period after
SIGTERM, after which it ends with the worker's 408 or 503 error, as an error event when its stream
has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from worker.config.settings import WorkerSettings
from worker.jobs.deadlines import DeadlinePassed, Deadlines, deadline_error
from worker.routes.route_table import DENIED, Route, RouteTable
from worker.wire import nesting
from worker.wire.body_envelope import is_json
from worker.wire.dialects import anthropic_status, is_anthropic_route
from worker.wire.errors import ErrorPayload, StartupError, error_response
from worker.wire.sse import DONE, frame

log = logging.getLogger(__name__)

__all__ = ["MAX_BODY_BYTES", "Phase", "PingOnly", "Serving", "WorkerApp"]

MAX_BODY_BYTES = 30 * 2**20  # what RunPod's balancer passes, per request and per response (30 MB)
JOB_ROUTES = ("/runsync", "/stream")
# A queue endpoint's own routes, which a caller moving over may try.
_QUEUE_ROUTES = ("/run", "/status", "/cancel", "/purge-queue", "/health", "/requests")
# On /stream, an item per engine step: no batching knobs but these.
_PER_STEP = {"stream": True, "max_batch_size": 1, "min_batch_size": 1, "batch_size_growth_factor": 1}

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
Job = Callable[[dict[str, Any]], AsyncIterator[Any]]


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    FAILED = "failed"  # the start failed: every request is answered with the cause
    DRAINING = "draining"  # SIGTERM: requests in flight finish, new ones are refused


@dataclass(frozen=True)
class Serving:
    """What the app serves once the worker has started."""
    vllm_app: ASGIApp  # vLLM's app, as routes/serving built it
    routes: RouteTable
    run_job: Job  # handler.handler: a job's items, errors as an error item
    deadlines: Deadlines  # the handler's, whose jobs' deadlines the requests share
    settings: WorkerSettings
    is_dead: Callable[[], bool]  # the engine has died
    on_death: Callable[[], None]  # then called once: the worker exits, and RunPod replaces it


def _status_of(error: ErrorPayload) -> int:
    """An error item's HTTP status, which both dialects carry (Anthropic's as its type)."""
    inner = error["error"]
    return int(inner["code"]) if "code" in inner else anthropic_status(inner.get("type"))


async def _send_json(send: Callable, status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _failed_job(job_id: str | None, error: ErrorPayload) -> dict[str, Any]:
    """A failed job as RunPod's /runsync reports it: the error item's ``error`` as JSON text."""
    return {"id": job_id, "status": "FAILED", "error": str(error["error"])}


def _header(scope: dict, name: bytes) -> str | None:
    value = next((v for k, v in scope["headers"] if k == name), None)
    return None if value is None else value.decode("latin-1")


def _content_length(scope: dict) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


class _BodyTooLarge(Exception):
    pass


async def _read_body(receive: Callable, limit: int) -> bytes | None:
    """The request's body, read until it ends or passes ``limit`` (_BodyTooLarge: the rest is left
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
            raise _BodyTooLarge
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    """``receive`` for vLLM's app: the body read already, then the client's own messages (vLLM's
    routes watch them for a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay


def _too_deep(scope: dict, body: bytes) -> bool:
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
async def _until_disconnect(receive: Callable) -> AsyncIterator[None]:
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


class _Reply:
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
        await _send_json(self._send, self.status, self._route.error_item(self.status, content))

    async def end_with(self, error: ErrorPayload) -> None:
        """Ends the response with ``error``: the whole answer, or the stream's last event."""
        if not self.status or self._error is not None:
            await _send_json(self._send, _status_of(error), error)
        elif not self.ended:
            prefix = "event: error\n" if self._route.anthropic else ""
            event = prefix + frame(error) if self.stream else ""
            await self._send({"type": "http.response.body", "body": event.encode(), "more_body": False})


class WorkerApp:
    """The ASGI app; its ``phase`` moves STARTING → SERVING → DRAINING, or STARTING → FAILED."""

    def __init__(self, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self.phase = Phase.STARTING
        self.serving: Serving | None = None
        self.failure: StartupError | None = None

    def serve(self, serving: Serving) -> None:
        self.serving, self.phase = serving, Phase.SERVING

    def fail(self, failure: StartupError) -> None:
        self.failure, self.phase = failure, Phase.FAILED

    async def drain(self) -> None:
        """Refuse new requests and let those in flight finish, within SHUTDOWN_GRACE_PERIOD (on the
        loop the requests run on: their deadlines are its)."""
        self.phase = Phase.DRAINING
        deadlines, grace_period = self.serving.deadlines, self.serving.settings.shutdown_grace_period
        log.info("Draining: %d request(s) in flight get up to %g s to finish",
                 deadlines.begin_shutdown(grace_period), grace_period)
        while deadlines.running:
            await asyncio.sleep(0.05)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # no lifespan (it is off) nor websockets (none served)
            return
        path = scope["path"]
        if path == "/ping":
            # While starting, the server answering is stopped once the engine is up (the port's
            # server moves to the engine's loop): a connection kept open would be closed under the
            # client's next request. A new one waits in the socket's backlog through the move.
            close = [(b"connection", b"close")] if self.phase is Phase.STARTING else []
            await send({"type": "http.response.start", "status": self._ping_status(), "headers": close})
            await send({"type": "http.response.body", "body": b""})
        elif (refusal := self._refusal(scope)) is not None:
            await self._refuse(send, path, *refusal)
        elif path in JOB_ROUTES:
            await self._job(path, receive, send)
        else:
            await self._route(scope, receive, send)

    def _ping_status(self) -> int:
        if self.phase is Phase.SERVING and self.serving.is_dead():
            self.serving.on_death()
            return HTTPStatus.SERVICE_UNAVAILABLE
        return {Phase.STARTING: HTTPStatus.NO_CONTENT, Phase.SERVING: HTTPStatus.OK,
                Phase.FAILED: HTTPStatus.OK, Phase.DRAINING: HTTPStatus.SERVICE_UNAVAILABLE}[self.phase]

    def _refusal(self, scope: dict) -> tuple[int, str] | None:
        """Why this request gets an error without reaching vLLM or the engine, if it does."""
        if self.phase is not Phase.SERVING:
            return HTTPStatus.SERVICE_UNAVAILABLE, {
                Phase.STARTING: "the worker is starting: its /ping answers 200 once it serves",
                Phase.FAILED: f"the worker could not start: {self.failure and self.failure.answer}",
                Phase.DRAINING: "the worker is shutting down: send the request again, to another worker",
            }[self.phase]
        if (size := _content_length(scope)) is not None and size > self.max_body_bytes:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, (
                f"the request body is {size} bytes, above the {self.max_body_bytes} a load-balancing "
                "endpoint passes")
        path = scope["path"]
        if path in JOB_ROUTES or self.serving.routes.find(path) is not None:
            return None
        if path in DENIED:
            return HTTPStatus.NOT_FOUND, f"route {path!r} is not served: {DENIED[path]}"
        if path.startswith(_QUEUE_ROUTES):
            return HTTPStatus.NOT_FOUND, (f"route {path!r} is a queue endpoint's: a load-balancing endpoint "
                                          "has no queue; send a job to POST /runsync or POST /stream")
        return HTTPStatus.NOT_FOUND, (f"route {path!r} is not served; this worker serves: /ping, "
                                      f"{', '.join(JOB_ROUTES)}, {', '.join(self.serving.routes.names())}")

    async def _refuse(self, send: Callable, path: str, status: int, message: str) -> None:
        error = error_response(status, message, anthropic=is_anthropic_route(path))
        await _send_json(send, status, _failed_job(None, error) if path in JOB_ROUTES else error)

    async def _route(self, scope: dict, receive: Callable, send: Callable) -> None:
        """A request to vLLM's app, within its deadline."""
        serving, path = self.serving, scope["path"]
        if (vllm_path := serving.routes.vllm_path(path)) != path:
            scope = {**scope, "path": vllm_path, "raw_path": vllm_path.encode()}
        route = serving.routes.find(path)
        reply, (timeout, limit) = _Reply(send, route), serving.settings.timeout_for()
        try:
            async with serving.deadlines.scope(timeout):
                if (body := await self._route_body(scope, receive, send)) is not None:
                    await serving.vllm_app(scope, _replay(body, receive), reply.send)
        except DeadlinePassed as passed:
            grace = serving.settings.shutdown_grace_period
            await reply.end_with(deadline_error(f"Request {scope['method']} {path}", passed, timeout, grace,
                                                route.anthropic, limit))
        if reply.status >= HTTPStatus.INTERNAL_SERVER_ERROR and serving.is_dead():
            serving.on_death()

    async def _route_body(self, scope: dict, receive: Callable, send: Callable) -> bytes | None:
        """A vLLM route's body, read whole (as vLLM would before it starts), or None: refused (too
        large, or nested too deep) or its client left."""
        path = scope["path"]
        try:
            body = await _read_body(receive, self.max_body_bytes)
        except _BodyTooLarge:
            await self._refuse(send, path, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large())
            return None
        if body is not None and _too_deep(scope, body):
            await self._refuse(send, path, HTTPStatus.BAD_REQUEST, nesting.refusal("the request body"))
            return None
        return body

    def _too_large(self) -> str:
        return f"the request body is above the {self.max_body_bytes} bytes a load-balancing endpoint passes"

    async def _job(self, path: str, receive: Callable, send: Callable) -> None:
        """A job on ``/runsync`` or ``/stream``, through the handler as a queue's job. An input too
        deep to parse is kept as ``nesting.Raw``, which the handler refuses as a queue job's."""
        try:
            raw = await _read_body(receive, self.max_body_bytes)
            # Split down to the input's keys: the error's dialect is that of the route a job names.
            body = None if raw is None else nesting.loads(raw or b"null", levels=2)
        except _BodyTooLarge:
            return await self._refuse(send, path, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large())
        except ValueError as exc:
            return await self._refuse(send, path, HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}")
        if raw is None:
            return  # the client left: nothing to answer
        if not isinstance(body, dict) or "input" not in body:
            return await self._refuse(send, path, HTTPStatus.BAD_REQUEST, 'expected {"input": {...}}')
        job_input = body["input"]
        if path == "/stream" and isinstance(job_input, dict):
            job_input = {**job_input, **_PER_STEP}
        job = {"id": f"http-{uuid.uuid4().hex}", "input": job_input}
        items = aiter(self.serving.run_job(job))
        async with _until_disconnect(receive):
            if path == "/runsync":
                await self._runsync(job["id"], items, send)
            else:
                await self._stream(items, send)

    async def _runsync(self, job_id: str, items: AsyncIterator[Any], send: Callable) -> None:
        started, output = time.monotonic(), []
        async for item in items:
            if isinstance(item, ErrorPayload):
                return await _send_json(send, _status_of(item), _failed_job(job_id, item))
            output.append(item)
        await _send_json(send, HTTPStatus.OK, {
            "id": job_id, "status": "COMPLETED", "executionTime": round((time.monotonic() - started) * 1000),
            "output": output})

    async def _stream(self, items: AsyncIterator[Any], send: Callable) -> None:
        """Events from the first item on; an error before it is the answer's status. An item that is
        SSE text (an OpenAI stream's, ``data: [DONE]`` included) goes as it is, anything else as one
        event of its JSON."""
        first = await anext(items, None)
        if isinstance(first, ErrorPayload):
            return await _send_json(send, _status_of(first), first)
        await send({"type": "http.response.start", "status": HTTPStatus.OK,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        last = ""
        item = first
        while item is not None:
            last = item if isinstance(item, str) else frame(item)
            await send({"type": "http.response.body", "body": last.encode(), "more_body": True})
            item = None if isinstance(item, ErrorPayload) else await anext(items, None)
        done = f"data: {DONE}\n\n"
        await send({"type": "http.response.body", "body": b"" if last.endswith(done) else done.encode()})


class PingOnly:
    """The app on PORT_HEALTH when it is not PORT: ``/ping`` as ``WorkerApp`` answers it, anything
    else a 404. The routes are served on PORT alone, where they run on the engine's loop (this port's
    server runs on a small loop of its own)."""

    def __init__(self, app: WorkerApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/ping":
            return await self.app(scope, receive, send)
        message = (f"route {scope['path']!r} is not served on this port (PORT_HEALTH), which answers /ping "
                   "only: send requests to PORT")
        await _send_json(send, HTTPStatus.NOT_FOUND, error_response(HTTPStatus.NOT_FOUND, message))
