"""Job deadlines: each job's own timeout, cut short for every job when the worker shuts down.

A deadline bounds only the handler's waits on the engine, never the time the runpod SDK spends
between two items (posting a chunk): a cancellation landing in the SDK's own awaits would drop
the job without reporting it. When a deadline passes, the wait is cancelled, which aborts the
job's vLLM request, and ``DeadlinePassed`` says which deadline it was. On a load-balancing
endpoint a request to vLLM's routes runs inside one ``scope``, sending included: there, a socket
write cut short loses nothing that the error sent after it would not replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import TypeVar

from worker.wire.errors import ErrorPayload, error_response

T = TypeVar("T")

log = logging.getLogger(__name__)

__all__ = ["DeadlinePassed", "Deadlines", "deadline_error"]


class DeadlinePassed(Exception):
    def __init__(self, shutdown: bool) -> None:
        super().__init__("shutdown grace period ended" if shutdown else "job timeout")
        self.shutdown = shutdown


def deadline_error(what: str, passed: DeadlinePassed, timeout: float | None, grace_period: float,
                   anthropic: bool, limit: str = "timeout") -> ErrorPayload:
    """The error a job (``what``: "Job <id>") or request cut short by ``passed`` ends with; ``limit``
    names the setting that gave ``timeout`` (``WorkerSettings.timeout_for``)."""
    noun = "job" if what.startswith("Job") else "request"
    if passed.shutdown:
        log.warning("%s still running at the end of the shutdown grace period; aborted", what)
        return error_response(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"the worker is shutting down and the {noun} did not finish within the {grace_period:g} s "
            "grace period (SHUTDOWN_GRACE_PERIOD); it was aborted", anthropic=anthropic)
    log.warning("%s ran past its %s s timeout (%s); aborted", what, timeout, limit)
    return error_response(HTTPStatus.REQUEST_TIMEOUT,
                          f"the {noun} ran past its timeout of {timeout:g} s ({limit}) and was aborted",
                          param="timeout", anthropic=anthropic)


class Deadlines:
    """Deadlines of the jobs running on one event loop (the runpod SDK's, or the HTTP server's)."""

    def __init__(self) -> None:
        self.grace_ends: float | None = None  # loop time at which a shutdown's grace period ends
        self._waiting: set[asyncio.Timeout] = set()
        self.running = 0  # jobs inside ``bound`` or ``scope``

    def begin_shutdown(self, grace_period: float) -> int:
        """From now on no job runs past ``grace_period`` seconds (a repeat never extends it).

        Returns the number of jobs running.
        """
        ends = asyncio.get_running_loop().time() + grace_period
        self.grace_ends = min(ends, self.grace_ends or math.inf)
        for scope in self._waiting:
            scope.reschedule(min(scope.when() or math.inf, self.grace_ends))
        return self.running

    def _earliest(self, job_ends: float | None) -> float | None:
        ends = [t for t in (job_ends, self.grace_ends) if t is not None]
        return min(ends) if ends else None

    def _is_shutdown(self, job_ends: float | None) -> bool:
        return self.grace_ends is not None and (job_ends is None or self.grace_ends < job_ends)

    @contextlib.asynccontextmanager
    async def _within(self, job_ends: float | None) -> AsyncIterator[None]:
        """The body runs until ``job_ends`` (loop time) or the grace period's end, then is cancelled."""
        scope = asyncio.timeout_at(self._earliest(job_ends))
        self._waiting.add(scope)
        try:
            async with scope:
                yield
        except TimeoutError:
            raise DeadlinePassed(self._is_shutdown(job_ends)) from None
        finally:
            self._waiting.discard(scope)

    def _ends(self, timeout: float | None) -> float | None:
        return asyncio.get_running_loop().time() + timeout if timeout else None

    @contextlib.asynccontextmanager
    async def scope(self, timeout: float | None) -> AsyncIterator[None]:
        """One job as a whole, within its deadline (``timeout`` s from now)."""
        self.running += 1
        try:
            async with self._within(self._ends(timeout)):
                yield
        finally:
            self.running -= 1

    async def bound(self, source: AsyncGenerator[T, None], timeout: float | None) -> AsyncIterator[T]:
        """``source``'s items, each awaited within the job's deadline (``timeout`` s from now)."""
        job_ends = self._ends(timeout)
        items = aiter(source)
        self.running += 1
        try:
            while True:
                try:
                    async with self._within(job_ends):
                        item = await anext(items)
                except StopAsyncIteration:
                    return
                yield item
        finally:
            self.running -= 1
            await items.aclose()
