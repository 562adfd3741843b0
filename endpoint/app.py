"""HTTP faces of the local endpoint (aiohttp), both under ``/v2/<endpoint_id>/``.

Client face, as RunPod's serverless API: ``POST run``, ``POST runsync``, ``GET stream/<id>``,
``GET status/<id>``, ``POST cancel/<id>``, ``GET health`` (RunPod's job and worker counts, and
``local``: each worker's state and restarts), ``POST purge-queue`` and
``POST|GET openai/v1/<route>`` (a job ``{"openai_route", "openai_input"}``, the query string
included in the route, answered as JSON, as the non-JSON answer a ``body_envelope`` item carries,
or, for ``"stream": true``, as ``text/event-stream`` relayed chunk by chunk); any other path under
``openai/`` is a 404, as RunPod relays nothing else.

Worker face, RunPod's job protocol, which the real ``runpod.serverless.start`` loop speaks:
``GET job-take/<worker>``, ``GET job-take-batch/<worker>``, ``POST job-stream/<worker>/<job>``,
``POST job-done/<worker>/<job>``, ``GET job-stop/<worker>``, ``GET ping/<worker>``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from worker.wire import nesting
from worker.wire.body_envelope import Envelope
from worker.wire.dialects import anthropic_status, is_anthropic_route
from worker.wire.errors import error_item, error_response
from worker.wire.sse import frame

from .jobs import Job, JobStore, Status

__all__ = ["EndpointConfig", "api_key_check", "create_app", "json_error"]

# How long an idle job-take or job-stop request is held open (a worker's JobLoop re-polls at once).
LONG_POLL_SECONDS = 3.0
# How FastAPI reads a bool query parameter such as vLLM's ``GET /v1/responses/{id}?stream=true``.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})

@dataclass(frozen=True)
class EndpointConfig:
    endpoint_id: str = "local"
    api_key: str | None = None
    max_body_bytes: int = 20 * 2**20  # RunPod's /runsync payload limit
    runsync_wait_seconds: float = 90.0  # /runsync only: OpenAI routes wait for their job
    stream_wait_seconds: float = 10.0
    worker_alive_seconds: float = 30.0
    # Each job-take answer that carries jobs is sent this long after they were taken: RunPod's queue
    # is a network round trip away from its workers (here, 1 ms).
    job_take_delay: float = 0.0


def json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def api_key_check(key: str | None):
    """A middleware that answers 401 to a request without ``Authorization: Bearer KEY`` or
    ``x-api-key: KEY`` (Anthropic's SDK sends its key there); none with no key."""

    @web.middleware
    async def authenticate(request: web.Request, handler):
        if key is not None:
            given = request.headers.get("Authorization", request.headers.get("x-api-key", ""))
            if given.removeprefix("Bearer ").strip() != key:
                return json_error(401, "missing or wrong API key")
        return await handler(request)

    return authenticate


def _openai_error(status: int, message: str, anthropic: bool) -> web.Response:
    return web.json_response(error_response(status, message, anthropic=anthropic), status=status)


def _error_event(status: int, message: str, anthropic: bool) -> str:
    """An error inside a started stream, as vLLM sends it (Anthropic's SDK reads ``event: error``)."""
    return ("event: error\n" if anthropic else "") + frame(error_response(status, message, anthropic=anthropic))


def _failed_job_response(job: Job, anthropic: bool) -> web.Response:
    """A failed OpenAI-route job as the HTTP error its worker described.

    The runpod SDK fails a job with ``str()`` of the yielded item's ``error`` value, which the
    worker makes JSON: OpenAI's ``{"message", "type", "param", "code"}`` or Anthropic's
    ``{"type", "message"}``.
    """
    try:
        error = json.loads(job.error) if isinstance(job.error, str) else job.error
    except ValueError:
        error = None
    if not isinstance(error, dict) or "message" not in error:
        return _openai_error(500, str(job.error), anthropic)
    status = anthropic_status(error.get("type")) if anthropic else int(error.get("code") or 500)
    return web.json_response(error_item(error, anthropic=anthropic), status=status)


def _unanswered(job: Job, anthropic: bool) -> web.Response:
    """A final job without an answer (failed, timed out or cancelled) as an HTTP error."""
    if job.status is Status.FAILED:
        return _failed_job_response(job, anthropic)
    if job.status is Status.TIMED_OUT:
        return _openai_error(504, job.error, anthropic)
    return _openai_error(500, f"the job was {job.status.lower()}", anthropic)


def _http_answer(output: Any) -> web.Response:
    """A completed job's answer: vLLM's JSON, or the non-JSON HTTP answer an envelope carries."""
    if (envelope := Envelope.from_output(output)) is None:
        return web.json_response(output)
    return web.Response(status=envelope.status, body=envelope.body,
                        headers={**envelope.headers, "Content-Type": envelope.content_type})


def _sse(chunk: Any) -> str:
    """A streamed chunk as SSE text: raw-mode strings as they are, parsed chunks re-framed."""
    if isinstance(chunk, str):
        return chunk
    objects = chunk if isinstance(chunk, list) else [chunk]
    return "".join(map(frame, objects))


class Endpoint:
    def __init__(self, config: EndpointConfig, store: JobStore) -> None:
        self.config, self.store = config, store

    # --- shared --------------------------------------------------------------------------------

    def _job(self, request: web.Request) -> Job:
        job = self.store.get(request.match_info["job_id"])
        if job is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "job not found"}),
                                   content_type="application/json")
        return job

    async def _body(self, request: web.Request) -> Any:
        """The body's JSON. A part nested too deep for Python's parser stays ``nesting.Raw`` text, passed
        on as it came: RunPod's parser takes such JSON, and refusing it is the worker's business."""
        try:
            return nesting.loads(await request.read() or b"null", levels=1)
        except ValueError as exc:
            raise web.HTTPBadRequest(text=json.dumps({"error": f"body is not JSON: {exc}"}),
                                     content_type="application/json") from None

    async def _submit(self, request: web.Request) -> Job:
        body = await self._body(request)
        if not isinstance(body, dict) or "input" not in body:
            raise web.HTTPBadRequest(text=json.dumps({"error": 'expected {"input": ...}'}),
                                     content_type="application/json")
        return await self.store.submit(body["input"])

    # --- client face ---------------------------------------------------------------------------

    async def run(self, request: web.Request) -> web.Response:
        job = await self._submit(request)
        return web.json_response({"id": job.id, "status": str(job.status)})

    async def runsync(self, request: web.Request) -> web.Response:
        job = await self._submit(request)
        wait = float(request.query.get("wait", self.config.runsync_wait_seconds * 1000)) / 1000
        await self.store.wait_for(lambda: job.final, wait)
        return web.json_response(job.public())

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request).public())

    async def stream(self, request: web.Request) -> web.Response:
        """The chunks produced since the previous call, waiting briefly for new ones."""
        job = self._job(request)
        await self.store.wait_for(lambda: job.final or len(job.chunks) > job.read,
                                  self.config.stream_wait_seconds)
        new, job.read = job.chunks[job.read:], len(job.chunks)
        body: dict[str, Any] = {"id": job.id, "status": str(job.status),
                                "stream": [{"output": chunk} for chunk in new]}
        if job.error is not None:
            body["error"] = job.error
        return web.json_response(body)

    async def cancel(self, request: web.Request) -> web.Response:
        job = await self.store.cancel(self._job(request).id)
        return web.json_response({"id": job.id, "status": str(job.status)})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.health(self.config.worker_alive_seconds))

    async def purge_queue(self, request: web.Request) -> web.Response:
        return web.json_response({"removed": await self.store.purge(), "status": "completed"})

    async def openai(self, request: web.Request) -> web.StreamResponse:
        """As RunPod's gateway: the request as a job, its answer as vLLM's HTTP answer. No wait
        limit here: a job that runs too long ends at the store's execution timeout."""
        route = "/v1/" + request.match_info["route"]
        anthropic = is_anthropic_route(route)
        body = await self._body(request) if request.method == "POST" else None
        if body is not None and not isinstance(body, dict):
            return _openai_error(400, "the request body must be a JSON object", anthropic)
        # Raw (still percent-encoded): the worker splits it off and hands it to vLLM as it came.
        if query := request.rel_url.raw_query_string:
            route += "?" + query
        # A GET has no body: vLLM reads ``stream`` from its query (a stored response, streamed).
        stream = (bool(body.get("stream")) if body is not None
                  else request.query.get("stream", "").lower() in _TRUE)
        job = await self.store.submit({"openai_route": route, "openai_input": body})
        try:
            return await self._answer(request, job, anthropic, stream)
        finally:  # the client left (aiohttp cancels this handler) or the answer is sent
            if not job.final:
                await asyncio.shield(self.store.cancel(job.id))

    async def openai_unrelayed(self, request: web.Request) -> web.Response:
        return _openai_error(
            404, f"/openai/{request.match_info['rest']} is not relayed: RunPod relays only "
            "/openai/v1/<route>; vLLM's root routes are reachable as /v1/<name> (e.g. "
            "/openai/v1/pooling)", anthropic=False)

    async def _answer(self, request: web.Request, job: Job, anthropic: bool,
                      stream: bool) -> web.StreamResponse:
        if stream:
            return await self._relay_stream(request, job, anthropic)
        await self.store.wait_for(lambda: job.final)
        if job.status is not Status.COMPLETED:
            return _unanswered(job, anthropic)
        return _http_answer(job.output[0] if isinstance(job.output, list) and job.output else job.output)

    async def _relay_stream(self, request: web.Request, job: Job, anthropic: bool) -> web.StreamResponse:
        """SSE chunks as the worker posts them; an error before the first chunk is an HTTP error."""
        await self.store.wait_for(lambda: job.final or job.chunks)
        if not job.chunks and job.status is not Status.COMPLETED:
            return _unanswered(job, anthropic)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        try:
            while True:
                await self.store.wait_for(lambda seen=sent: job.final or len(job.chunks) > seen)
                for chunk in job.chunks[sent:]:
                    await response.write(_sse(chunk).encode())
                sent = len(job.chunks)
                if job.final:
                    break
            if job.status is Status.FAILED:
                await response.write(frame({"error": job.error}).encode())
            elif job.status is Status.TIMED_OUT:
                await response.write(_error_event(504, job.error, anthropic).encode())
            await response.write_eof()
        except ConnectionResetError:  # the client left; the caller stops the job
            pass
        return response

    # --- worker face ---------------------------------------------------------------------------

    async def job_take(self, request: web.Request) -> web.Response:
        worker = request.match_info["worker"]
        batch = "batch_size" in request.query
        count = max(1, int(request.query.get("batch_size", 1))) if batch else 1
        jobs = await self.store.take(worker, count, LONG_POLL_SECONDS)
        if not jobs:
            return web.Response(status=204)
        await asyncio.sleep(self.config.job_take_delay)
        payload = [{"id": j.id, "input": j.input} for j in jobs]
        return web.json_response(payload if batch else payload[0], dumps=nesting.dumps)

    async def job_stream(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        output = body.get("output") if isinstance(body, dict) else None
        await self.store.stream(request.match_info["job_id"], request.match_info["worker"], output)
        return web.json_response({})

    async def job_done(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        await self.store.finish(request.match_info["job_id"], request.match_info["worker"],
                                body if isinstance(body, dict) else {"output": body})
        return web.json_response({})

    async def job_stop(self, request: web.Request) -> web.Response:
        stops = await self.store.stop_signals(request.match_info["worker"], LONG_POLL_SECONDS)
        return web.json_response({"jobsToStop": stops}) if stops else web.Response(status=204)

    async def ping(self, request: web.Request) -> web.Response:
        self.store.ping(request.match_info["worker"])
        return web.json_response({})


_ANY = functools.partial(web.route, "*")  # any method
# RunPod's routes under /v2/<endpoint_id>/, by aiohttp's route kind (``web.get`` answers HEAD too):
# path → the Endpoint's handler; job-* and ping/ are the worker face, the rest the client face.
ROUTES = {
    web.post: {"run": "run", "runsync": "runsync", "cancel/{job_id}": "cancel", "purge-queue": "purge_queue",
               "job-stream/{worker}/{job_id}": "job_stream", "job-done/{worker}/{job_id}": "job_done"},
    web.get: {"stream/{job_id}": "stream", "status/{job_id}": "status", "health": "health",
              "job-take/{worker}": "job_take", "job-take-batch/{worker}": "job_take",
              "job-stop/{worker}": "job_stop", "ping/{worker}": "ping"},
    # The rest of openai/ second: RunPod relays only openai/v1/<route>.
    _ANY: {"openai/v1/{route:.+}": "openai", "openai/{rest:.*}": "openai_unrelayed"},
}


def create_app(config: EndpointConfig | None = None, store: JobStore | None = None) -> web.Application:
    config = config or EndpointConfig()
    endpoint = Endpoint(config, store or JobStore())
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[api_key_check(config.api_key)])
    app.add_routes([route(f"/v2/{config.endpoint_id}/{path}", getattr(endpoint, handler))
                    for route, paths in ROUTES.items() for path, handler in paths.items()])
    return app
