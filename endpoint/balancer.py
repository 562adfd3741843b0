"""The load-balancing face of the local endpoint: ``python -m endpoint --load-balancer``.

A RunPod load-balancing endpoint has no queue: RunPod's balancer sends each HTTP request (any
method, any path: ``https://ENDPOINT_ID.api.runpod.ai/<path>``) straight to the HTTP server of one
ready worker and relays its answer. This does the same, on one port, in front of the workers' own,
to the worker its pool chooses (``pool.py``: readiness, choice, affinity):

- relay: the method, the path and query string as sent, the body and the headers, except the
  hop-by-hop ones and the caller's API key (RunPod's business, not the worker's); back, the status,
  headers and body, chunk by chunk as they come (server-sent events token by token);
- RunPod's limits: 30 MiB per request body (413, before any worker is asked) and per response,
  120 s to find a ready worker (400), 330 s per request (524). A worker that fails before it answers
  is a 502, and the request is not tried on another one (RunPod's balancer does not retry either).
  Past a limit, or when the worker fails, an answer under way is cut off, never ended cleanly, so
  that the client cannot take it for a complete one; the worker's request is closed either way, so
  the worker aborts it.

Worker affinity, as RunPod's: every answer from a worker carries ``X-Runpod-Worker-Id: <its id>``, and
a request that sends the header back with ``<id>`` prefers that worker while it is ready (soft: else
the usual choice), with ``strict <id>`` (or ``strict-resume <id>``) goes to that worker only: it waits
up to 5 min for it to be ready (then a 400, "timed out waiting for worker"); an id the endpoint does
not have is a 404 (``affinity_worker_gone``). Here a restarted worker keeps its id (``local-worker-N``).

The balancer's own ``GET /ping`` answers what RunPod's would: 200 while a worker is ready, else 204.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from .app import api_key_check, json_error
from .pool import WORKER_ID, Affinity, Pool, Worker

__all__ = ["BalancerConfig", "create_balancer_app"]

MIB = 2**20
# Headers about one connection (RFC 9110, 7.6.1), which a proxy does not pass on; a header that
# ``Connection`` names is one of them too.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade"})
# Also kept from the worker: the caller's key, which RunPod checks itself, its worker affinity (the
# balancer's business), and what the relay's own request states anew (its host; the body's length,
# read whole: nothing to expect a 100 for).
NOT_FORWARDED = HOP_BY_HOP | {"authorization", "x-api-key", WORKER_ID.lower(), "host", "content-length",
                              "expect"}
# Headers aiohttp would add on its own: the worker gets only what the caller sent.
NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")


@dataclass(frozen=True)
class BalancerConfig:
    api_key: str | None = None
    max_body_bytes: int = 30 * MIB  # RunPod's limit per request body ...
    max_response_bytes: int = 30 * MIB  # ... and per response
    worker_wait_seconds: float = 120.0  # RunPod's: no ready worker by then is a 400
    affinity_wait_seconds: float = 300.0  # RunPod's, for the worker a request strictly names
    request_timeout_seconds: float = 330.0  # RunPod's: a request running longer is a 524
    ping_interval_seconds: float = 0.5
    ping_timeout_seconds: float = 10.0  # a worker busy with a burst may be slow to answer


def _forwarded(headers: Mapping[str, str], dropped: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without ``dropped`` and those their ``Connection`` header names."""
    named = {token.strip().lower() for value in headers.getall("Connection", [])
             for token in value.split(",")}
    return CIMultiDict((name, value) for name, value in headers.items()
                       if name.lower() not in dropped and name.lower() not in named)


class Stop(Exception):
    """The relay stops: ``status`` and ``message`` for a client whose answer has not begun."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Balancer:
    """The balancer's HTTP face: its own /ping, and every other request relayed to a worker."""

    def __init__(self, pool: Pool, config: BalancerConfig) -> None:
        self.pool, self.config = pool, config
        self.session: aiohttp.ClientSession | None = None

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """The connections to the workers and their readiness checks, while the app runs.

        A connection serves one request (no keep-alive): closing it is how the worker learns that
        its request ended, and no request meets a connection its worker's previous process left.
        """
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None), cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=NO_AUTO_HEADERS) as session:
            # aiohttp sends an idempotent request again when the connection drops before the answer;
            # RunPod's balancer does not (and aiohttp's own test client turns it off the same way).
            session._retry_connection = False
            self.session = session
            watch = asyncio.create_task(self.pool.watch(session, self.config.ping_interval_seconds,
                                                        self.config.ping_timeout_seconds))
            yield
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def ping(self, request: web.Request) -> web.Response:
        """What RunPod's endpoint would answer: 200 while a worker is ready, else 204."""
        return web.Response(status=200 if self.pool.any_ready() else 204)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        limit, wait = self.config.max_body_bytes, self.config.worker_wait_seconds
        try:
            body = await request.read()  # whole: a body over the limit never reaches a worker
        except web.HTTPRequestEntityTooLarge:
            return json_error(413, f"the request body is larger than {limit} bytes (RunPod's limit)")
        try:
            affinity = Affinity.of(request.headers.get(WORKER_ID))
        except ValueError as exc:
            return json_error(400, str(exc))
        strict = affinity is not None and affinity.strict
        if strict and affinity.worker_id not in self.pool.by_id:
            return json_error(404, f"affinity_worker_gone: this endpoint has no worker "
                                   f"{affinity.worker_id!r} ({', '.join(self.pool.by_id)})")
        if strict:
            wait = self.config.affinity_wait_seconds
        worker = await self.pool.choose(wait, affinity)
        if worker is None and strict:
            return json_error(400, f"timed out waiting for worker {affinity.worker_id} ({wait:g} s; "
                                   f"{self.pool.by_id[affinity.worker_id].state})")
        if worker is None:
            return json_error(400, f"no worker was ready within {wait:g} s ({self.pool.states()})")
        worker.in_flight += 1
        try:
            response = await self._relay(request, body, worker)
        finally:
            worker.in_flight -= 1
        if response is not None and not response.prepared:  # the balancer's own error
            response.headers[WORKER_ID] = worker.id
        return response

    async def _relay(self, request: web.Request, body: bytes, worker: Worker) -> web.StreamResponse:
        """The worker's answer, relayed as it comes, within the request timeout."""
        timeout = self.config.request_timeout_seconds
        answer = response = None
        try:
            async with asyncio.timeout(timeout):
                answer = await self._send(request, body, worker)
                response = self._head(answer, worker)
                await response.prepare(request)
                await self._copy(answer, response, worker)
            return response
        except Stop as stop:
            return _failed(request, response, stop.status, stop.message)
        except TimeoutError:
            return _failed(request, response, 524,
                           f"no complete answer within {timeout:g} s (RunPod's limit)")
        except ConnectionResetError:  # the client left: nothing more to send
            return response
        finally:
            if answer is not None:
                answer.close()  # the worker sees its request end, finished or not

    async def _send(self, request: web.Request, body: bytes, worker: Worker) -> aiohttp.ClientResponse:
        # The path and query string as sent, not re-encoded.
        url = URL(f"http://127.0.0.1:{worker.port}{request.raw_path}", encoded=True)
        try:
            return await self.session.request(request.method, url, data=body or None,
                                              headers=_forwarded(request.headers, NOT_FORWARDED),
                                              allow_redirects=False)  # a redirect is the client's
        except aiohttp.ClientError as exc:  # refused, reset, closed, or not HTTP
            raise self._lost(worker, exc, "before answering") from exc

    def _head(self, answer: aiohttp.ClientResponse, worker: Worker) -> web.StreamResponse:
        """The client's response, not begun yet, as the worker's headers describe it, and which
        worker it is."""
        if (answer.content_length or 0) > self.config.max_response_bytes:
            raise Stop(502, f"the worker's answer is larger than {self.config.max_response_bytes} bytes "
                            "(RunPod's limit)")
        headers = _forwarded(answer.headers, HOP_BY_HOP)
        headers[WORKER_ID] = worker.id
        return web.StreamResponse(status=answer.status, reason=answer.reason, headers=headers)

    async def _copy(self, answer: aiohttp.ClientResponse, response: web.StreamResponse,
                    worker: Worker) -> None:
        size, limit = 0, self.config.max_response_bytes
        while chunk := await self._read(answer, worker):
            size += len(chunk)
            if size > limit:
                raise Stop(502, f"the worker's answer grew larger than {limit} bytes (RunPod's limit)")
            await response.write(chunk)
        await response.write_eof()

    async def _read(self, answer: aiohttp.ClientResponse, worker: Worker) -> bytes:
        """What the worker has sent since the last read (b"": its whole answer is in)."""
        try:
            return await answer.content.readany()
        except aiohttp.ClientError as exc:  # reset, or closed before the end of the body
            raise self._lost(worker, exc, "while answering") from exc

    def _lost(self, worker: Worker, exc: Exception, when: str) -> Stop:
        why = f"its connection failed {when} ({type(exc).__name__})"
        self.pool.lost(worker, why)
        return Stop(502, f"worker {worker.id} failed: {why}")


def _failed(request: web.Request, response: web.StreamResponse | None, status: int,
            message: str) -> web.StreamResponse:
    """An error ``status`` when the answer has not begun; otherwise the client's connection cut, so
    that the client sees an incomplete answer (a proper end would pass for a complete one)."""
    if response is None or not response.prepared:
        return json_error(status, message)
    print(f"endpoint: cut off the answer to {request.method} {request.path}: {message}", flush=True)
    if request.transport is not None:
        request.transport.close()
    return response


def create_balancer_app(pool: Pool, config: BalancerConfig | None = None) -> web.Application:
    config = config or BalancerConfig()
    balancer = Balancer(pool, config)
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[api_key_check(config.api_key)])
    app.cleanup_ctx.append(balancer.lifetime)
    app.add_routes([web.get("/ping", balancer.ping), web.route("*", "/{path:.*}", balancer.forward)])
    return app
