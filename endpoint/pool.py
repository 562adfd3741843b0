"""The load-balancing endpoint's workers as its balancer sees them (``balancer.py`` relays to them):

- readiness: each worker's ``GET /ping`` on its ``PORT_HEALTH``, asked every 0.5 s: 204 while it
  starts, 200 when ready (only then is it sent requests), anything else or no answer: not ready.
  A worker whose connection fails, or whose process exits, stops being ready at once;
- choice: the ready worker with the fewest requests in flight (ties: the next one in turn), unless
  the request names one in ``X-Runpod-Worker-Id`` (RunPod's worker affinity: ``<id>`` preferred
  while it is ready, ``strict <id>`` or ``strict-resume <id>`` required);
- the Supervisor's registry: told when a worker's process starts and exits, it says whether the
  worker has been ready once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

__all__ = ["WORKER_ID", "Affinity", "Pool", "Worker", "free_ports"]

WORKER_ID = "X-Runpod-Worker-Id"  # RunPod's: the worker that answered; sent back, the one to route to


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

    async def watch(self, session: aiohttp.ClientSession, interval: float, timeout: float) -> None:
        """Ask each worker's /ping every ``interval`` seconds (an answer may take ``timeout``), until
        cancelled."""
        async with asyncio.TaskGroup() as group:
            for worker in self.workers:
                group.create_task(self._watch(worker, session, interval, timeout))

    async def _watch(self, worker: Worker, session: aiohttp.ClientSession, interval: float,
                     timeout: float) -> None:
        while True:
            asked = time.monotonic()
            status, state = await _ping(session, worker, timeout)
            if asked > worker.lost_at:  # else the worker failed while this question was out
                self._set(worker, status == 200, state)
            await asyncio.sleep(interval)

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
