"""The sockets of a worker on a load-balancing endpoint and the servers on them, for its whole life.

RunPod's balancer asks ``/ping`` from the start, so ``WorkerServer`` binds PORT (and PORT_HEALTH
when it differs) before anything else happens and serves ``WorkerApp`` at once, on a small event
loop of its own: 204, starting. Once the engine is up, ``serve`` moves the app's server to the
engine's loop, where vLLM's app and AsyncLLM run: as in `vllm serve`, a request and its engine share
one loop, with no thread hop per event. The listening sockets stay open through the move (each
server is given duplicates of them): a connection that arrives meanwhile waits in the kernel's
backlog, none is refused. A separate health port (PORT_HEALTH) has a server of its own on the small
loop, from the start to the end, which answers ``/ping`` only (``PingOnly``): the routes are served
on PORT alone, on the engine's loop.

SIGTERM (RunPod stopping the worker) drains: ``/ping`` answers 503, new requests are refused, and
those in flight get SHUTDOWN_GRACE_PERIOD to finish (then they end with a 503 error) before the
servers stop and ``serve`` returns. A failed start answers every request with the cause instead
(``answer_failure``), as a queue worker answers jobs, until STARTUP_FAILURE_ANSWER_SECONDS pass.
"""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import socket
import threading
import time
from typing import Any

import uvicorn

from worker.config.early_settings import EndpointKind
from worker.engine.background_loop import BackgroundLoop
from worker.load_balancer.app import PingOnly, Serving, WorkerApp
from worker.wire.errors import StartupError

log = logging.getLogger(__name__)

__all__ = ["WorkerServer", "bind"]

_BACKLOG = 2048  # vLLM's uvicorn default: connections waiting to be accepted
_STOP_SECONDS = 5.0  # for a server to close its connections once the requests have drained


def bind(port: int) -> socket.socket:
    """A listening socket on every interface (RunPod connects from outside), of protocol IPPROTO_TCP:
    asyncio sets TCP_NODELAY only on accepted sockets of that protocol (``socket.create_server``'s is
    0), and without it each small write of a stream waits for the client's delayed ACK (~40 ms)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))  # noqa: S104
    sock.listen(_BACKLOG)
    return sock


class _Running:
    """A uvicorn server serving on a loop until stopped."""

    def __init__(self, app: WorkerApp | PingOnly, loop: BackgroundLoop, sockets: list[socket.socket]) -> None:
        # No access log: a line per request (and per ping) is not an operator's event.
        config = uvicorn.Config(app, lifespan="off", ws="none", log_config=None, access_log=False,
                                backlog=_BACKLOG, timeout_graceful_shutdown=_STOP_SECONDS)
        self.server = uvicorn.Server(config)  # in a thread that is not the main one: no signal handlers
        self.done: concurrent.futures.Future = loop.submit(self.server.serve(sockets=[s.dup() for s in sockets]))
        while not self.server.started:
            if self.done.done():
                self.done.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped as it started")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.done.result(timeout=_STOP_SECONDS * 2)


class WorkerServer:
    """Binds the ports at construction and answers ``/ping`` from then on."""

    def __init__(self, kind: EndpointKind) -> None:
        self.kind = kind
        self.app = WorkerApp()
        self._socket = bind(kind.port)
        health = bind(kind.health_port) if kind.health_port != kind.port else None
        self._side = BackgroundLoop("http-ping")
        self._early = _Running(self.app, self._side, [self._socket])
        self._health = None if health is None else _Running(PingOnly(self.app), self._side, [health])
        self._stopping = threading.Event()
        log.info("Load-balancing endpoint: HTTP on port %d, /ping on port %d (204 until the worker serves)",
                 kind.port, kind.health_port)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("%s: draining", signal.Signals(signum).name)
        self._stopping.set()

    def _catch_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def answer_failure(self, failure: StartupError, seconds: float, status: int) -> None:
        """Answer every request with ``failure`` (``/ping`` 200: RunPod routes callers here to learn
        why) for ``seconds``, or until SIGTERM; then stop serving (the caller exits with ``status``)."""
        self.app.fail(failure)
        self._catch_signals()
        log.error("Answering every request with this failure for %g s (STARTUP_FAILURE_ANSWER_SECONDS), "
                  "then exiting with status %d so that RunPod replaces the worker", seconds, status)
        if not self._stopping.wait(seconds):  # as startup/failed_start logs it
            log.error("Stopping after the answer window (STARTUP_FAILURE_ANSWER_SECONDS): exit %d", status)
        self._early.stop()
        if self._health:
            self._health.stop()

    def serve(self, serving: Serving, engine_loop: BackgroundLoop) -> None:
        """Serve ``serving`` on the engine's loop until SIGTERM (or SIGINT), then drain and stop."""
        self._catch_signals()
        self._early.stop()
        self.app.serve(serving)
        servers = [_Running(self.app, engine_loop, [self._socket]), *filter(None, [self._health])]
        while not self._stopping.wait(0.5):  # a plain wait() would hold off the signal handler
            pass
        grace = serving.settings.shutdown_grace_period
        try:
            engine_loop.run(self.app.drain(), timeout=grace + _STOP_SECONDS)
        except concurrent.futures.TimeoutError:
            log.error("Requests still in flight %g s after the grace period: stopping anyway", _STOP_SECONDS)
        for server in servers:
            server.stop()
        log.info("Stopped serving HTTP")
