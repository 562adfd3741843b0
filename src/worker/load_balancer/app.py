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
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from worker.config.settings import WorkerSettings
from worker.jobs.deadlines import DeadlinePassed, Deadlines, deadline_error
from worker.load_balancer.asgi_io import (BodyTooLarge, Reply, content_length, read_body, replay_body, send_json,
                                          status_of, too_deep, until_disconnect)
from worker.routes.route_table import DENIED, RouteTable
from worker.wire import nesting
from worker.wire.dialects import is_anthropic_route
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


def _failed_job(job_id: str | None, error: ErrorPayload) -> dict[str, Any]:
    """A failed job as RunPod's /runsync reports it: the error item's ``error`` as JSON text."""
    return {"id": job_id, "status": "FAILED", "error": str(error["error"])}


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
        if self.phase is Phase.FAILED and self.failure is not None:
            return HTTPStatus.SERVICE_UNAVAILABLE, self.failure.refusal
        if self.phase is not Phase.SERVING:
            return HTTPStatus.SERVICE_UNAVAILABLE, {
                Phase.STARTING: "the worker is starting: its /ping answers 200 once it serves",
                Phase.DRAINING: "the worker is shutting down: send the request again, to another worker",
            }[self.phase]
        if (size := content_length(scope)) is not None and size > self.max_body_bytes:
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
        await send_json(send, status, _failed_job(None, error) if path in JOB_ROUTES else error)

    async def _route(self, scope: dict, receive: Callable, send: Callable) -> None:
        """A request to vLLM's app, within its deadline."""
        serving, path = self.serving, scope["path"]
        if (vllm_path := serving.routes.vllm_path(path)) != path:
            scope = {**scope, "path": vllm_path, "raw_path": vllm_path.encode()}
        route = serving.routes.find(path)
        reply, (timeout, limit) = Reply(send, route), serving.settings.timeout_for()
        try:
            async with serving.deadlines.scope(timeout):
                if (body := await self._route_body(scope, receive, send)) is not None:
                    await serving.vllm_app(scope, replay_body(body, receive), reply.send)
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
            body = await read_body(receive, self.max_body_bytes)
        except BodyTooLarge:
            await self._refuse(send, path, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large())
            return None
        if body is not None and too_deep(scope, body):
            await self._refuse(send, path, HTTPStatus.BAD_REQUEST, nesting.refusal("the request body"))
            return None
        return body

    def _too_large(self) -> str:
        return f"the request body is above the {self.max_body_bytes} bytes a load-balancing endpoint passes"

    async def _job(self, path: str, receive: Callable, send: Callable) -> None:
        """A job on ``/runsync`` or ``/stream``, through the handler as a queue's job. An input too
        deep to parse is kept as ``nesting.Raw``, which the handler refuses as a queue job's."""
        try:
            raw = await read_body(receive, self.max_body_bytes)
            # Split down to the input's keys: the error's dialect is that of the route a job names.
            body = None if raw is None else nesting.loads(raw or b"null", levels=2)
        except BodyTooLarge:
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
        async with until_disconnect(receive):
            if path == "/runsync":
                await self._runsync(job["id"], items, send)
            else:
                await self._stream(items, send)

    async def _runsync(self, job_id: str, items: AsyncIterator[Any], send: Callable) -> None:
        started, output = time.monotonic(), []
        async for item in items:
            if isinstance(item, ErrorPayload):
                return await send_json(send, status_of(item), _failed_job(job_id, item))
            output.append(item)
        await send_json(send, HTTPStatus.OK, {
            "id": job_id, "status": "COMPLETED", "executionTime": round((time.monotonic() - started) * 1000),
            "output": output})

    async def _stream(self, items: AsyncIterator[Any], send: Callable) -> None:
        """Events from the first item on; an error before it is the answer's status. An item that is
        SSE text (an OpenAI stream's, ``data: [DONE]`` included) goes as it is, anything else as one
        event of its JSON."""
        first = await anext(items, None)
        if isinstance(first, ErrorPayload):
            return await send_json(send, status_of(first), first)
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
        await send_json(send, HTTPStatus.NOT_FOUND, error_response(HTTPStatus.NOT_FOUND, message))
