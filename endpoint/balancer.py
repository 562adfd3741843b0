"""The load-balancing face of the local endpoint: ``python -m endpoint --load-balancer``.

A RunPod load-balancing endpoint has no queue: RunPod's balancer sends each HTTP request (any
method, any path: ``https://ENDPOINT_ID.api.runpod.ai/<path>``) straight to the HTTP server of one
ready worker and relays its answer. This does the same, on one port, in front of the workers' own:

- readiness: each worker's ``GET /ping`` on its ``PORT_HEALTH``, asked every 0.5 s: 204 while it
  starts, 200 when ready (only then is it sent requests), anything else or no answer: not ready.
  A worker whose connection fails, or whose process exits, stops being ready at once;
- choice: the ready worker with the fewest requests in flight (ties: the next one in turn), unless
  the request names one (RunPod's worker affinity, below);
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
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from .app import api_key_check, json_error

__all__ = ["WORKER_ID", "Affinity", "BalancerConfig", "Pool", "Worker", "create_balancer_app", "free_ports"]

MIB = 2**20
# Headers about one connection (RFC 9110, 7.6.1), which a proxy does not pass on; a header that
# ``Connection`` names is one of them too.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade"})
WORKER_ID = "X-Runpod-Worker-Id"  # RunPod's: the worker that answered; sent back, the one to route to
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


@dataclass(frozen=True)
class Affinity:
    """The worker a request names in ``X-Runpod-Worker-Id``: preferred, or, ``strict``, required."""
    worker_id: str
    strict: bool

    @classmethod
    def of(cls, header: str | None) -> Affinity | None:
        """The header's affinity (None: none asked); ValueError names a value that is neither
        ``<id>``, ``strict <id>`` nor ``strict-resume <id>``."""
        words = (header or "").split()
        if not words:
            return None
        strict = words[0] in ("strict", "strict-resume")
        if len(words) != 1 + strict:
            raise ValueError(f"{WORKER_ID} must be <worker-id>, strict <worker-id> or strict-resume "
                             f"<worker-id>, not {header!r}")
        return cls(words[-1], strict)


@dataclass(eq=False)
class Worker:
    """One worker's HTTP server, as the balancer sees it."""
    id: str
    port: int
    health_port: int
    ready: bool = False  # its last /ping answered 200, and no request to it has failed since
    state: str = "not started"  # why it is or is not ready, for the 400 that finds none
    in_flight: int = 0
    answered: bool = False  # its latest process has answered 200 (it was ready once)
    lost_at: float = float("-inf")  # a /ping answer to a question asked before then is stale

    def where(self) -> str:
        health = f", /ping on port {self.health_port}" if self.health_port != self.port else ""
        return f"port {self.port}{health}"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now (held together while chosen: none comes twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("0.0.0.0", 0))  # as the workers bind them
        return [sock.getsockname()[1] for sock in sockets]


class Pool:
    """The workers' HTTP servers: which are ready, how busy each is. In load-balancing mode it is also
    the registry the Supervisor tells when a worker's process starts (``revive``) and exits
    (``forget``), and asks whether it has been ready once (``called_in``)."""

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)
        self.by_id = {worker.id: worker for worker in workers}
        self._turn = -1  # the index of the worker chosen last
        self._changed = asyncio.Event()  # set (and replaced) when a worker becomes ready

    @classmethod
    def on_free_ports(cls, ids: Sequence[str], separate_health: bool = False) -> Pool:
        """Workers with a port each, and a health port of their own with ``separate_health``."""
        count = len(ids)
        ports = free_ports(2 * count if separate_health else count)
        health = ports[count:] if separate_health else ports
        return cls([Worker(worker, port, health_port)
                    for worker, port, health_port in zip(ids, ports[:count], health, strict=True)])

    def ports(self) -> Mapping[str, tuple[int, int]]:
        """Each worker's ``PORT`` and ``PORT_HEALTH``."""
        return {worker.id: (worker.port, worker.health_port) for worker in self.workers}

    # --- the Supervisor's registry --------------------------------------------------------------

    def revive(self, worker_id: str) -> None:
        """A process starts under ``worker_id``: it calls in when its /ping answers 200."""
        worker = self.by_id[worker_id]
        worker.answered, worker.state = False, "starting"

    async def forget(self, worker_id: str, status: int | None = None,
                     restart_in: float | None = None) -> None:
        """The worker's process exited (with ``status``, to restart in ``restart_in`` s)."""
        self.lost(self.by_id[worker_id], "its process exited")

    def called_in(self, worker_id: str) -> bool:
        return self.by_id[worker_id].answered

    # --- readiness ------------------------------------------------------------------------------

    async def watch(self, session: aiohttp.ClientSession, config: BalancerConfig) -> None:
        """Ask each worker's /ping, again and again, until cancelled."""
        async with asyncio.TaskGroup() as group:
            for worker in self.workers:
                group.create_task(self._watch(worker, session, config))

    async def _watch(self, worker: Worker, session: aiohttp.ClientSession,
                     config: BalancerConfig) -> None:
        while True:
            asked = time.monotonic()
            status, state = await _ping(session, worker, config.ping_timeout_seconds)
            if asked > worker.lost_at:  # else the worker failed while this question was out
                self._set(worker, status == 200, state)
            await asyncio.sleep(config.ping_interval_seconds)

    def lost(self, worker: Worker, why: str) -> None:
        """Not ready from now on (a request to it failed, or its process exited), until a /ping
        asked from now on answers 200."""
        worker.lost_at = time.monotonic()
        self._set(worker, False, why)

    def _set(self, worker: Worker, ready: bool, state: str) -> None:
        worker.state = state
        if ready == worker.ready:
            return
        worker.ready = ready
        if ready:
            worker.answered = True
            self._changed.set()
            self._changed = asyncio.Event()
        print(f"endpoint: {worker.id} " + (f"ready ({worker.where()})" if ready else f"not ready: {state}"),
              flush=True)

    def any_ready(self) -> bool:
        return any(worker.ready for worker in self.workers)

    def states(self) -> str:
        return "; ".join(f"{worker.id}: {worker.state}" for worker in self.workers)

    # --- choice ---------------------------------------------------------------------------------

    async def choose(self, wait: float, affinity: Affinity | None = None) -> Worker | None:
        """The ready worker with the fewest requests in flight, or the one ``affinity`` names while
        it is ready (strict: only that one), waiting up to ``wait`` seconds (None: none was ready by
        then)."""
        try:
            async with asyncio.timeout(wait):
                while (worker := self._pick(affinity)) is None:
                    await self._changed.wait()
        except TimeoutError:
            return None
        return worker

    def _pick(self, affinity: Affinity | None) -> Worker | None:
        if affinity is not None:
            named = self.by_id.get(affinity.worker_id)
            if named is not None and named.ready:
                return named
            if affinity.strict:
                return None
        ready = [i for i, worker in enumerate(self.workers) if worker.ready]
        if not ready:
            return None
        fewest = min(self.workers[i].in_flight for i in ready)
        # Among those as idle as can be, the first after the one chosen last.
        self._turn = min((i for i in ready if self.workers[i].in_flight == fewest),
                         key=lambda i: (i - self._turn - 1) % len(self.workers))
        return self.workers[self._turn]


async def _ping(session: aiohttp.ClientSession, worker: Worker,
                timeout: float) -> tuple[int | None, str]:
    """The worker's /ping status (None: no answer), and its state in words."""
    try:
        async with session.get(f"http://127.0.0.1:{worker.health_port}/ping",
                               timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
            return answer.status, f"/ping answered {answer.status}"
    except TimeoutError:
        return None, f"/ping did not answer within {timeout:g} s"
    except aiohttp.ClientConnectorError:
        return None, f"nothing listens on port {worker.health_port}"
    except aiohttp.ClientError as exc:
        return None, f"/ping failed ({type(exc).__name__})"


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
            watch = asyncio.create_task(self.pool.watch(session, self.config))
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
