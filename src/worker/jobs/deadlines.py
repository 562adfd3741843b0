"""Job deadlines: each job's own timeout, cut short for every job when the worker shuts down.

A deadline bounds only the handler's waits on the engine, never the time the runpod SDK spends
between two items (posting a chunk): a cancellation landing in the SDK's own awaits would drop
the job without reporting it. When a deadline passes, the wait is cancelled, which aborts the
job's vLLM request, and ``DeadlinePassed`` says which deadline it was.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

T = TypeVar("T")

__all__ = ["DeadlinePassed", "Deadlines"]


class DeadlinePassed(Exception):
    def __init__(self, shutdown: bool) -> None:
        super().__init__("shutdown grace period ended" if shutdown else "job timeout")
        self.shutdown = shutdown


class Deadlines:
    """Deadlines of the jobs running on one event loop (the runpod SDK's)."""

    def __init__(self) -> None:
        self.grace_ends: float | None = None  # loop time at which a shutdown's grace period ends
        self._waiting: set[asyncio.Timeout] = set()
        self.running = 0  # jobs inside ``bound``

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

    async def bound(self, source: AsyncGenerator[T, None], timeout: float | None) -> AsyncIterator[T]:
        """``source``'s items, each awaited within the job's deadline (``timeout`` s from now)."""
        job_ends = asyncio.get_running_loop().time() + timeout if timeout else None
        items = aiter(source)
        self.running += 1
        try:
            while True:
                scope = asyncio.timeout_at(self._earliest(job_ends))
                self._waiting.add(scope)
                try:
                    async with scope:
                        item = await anext(items)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise DeadlinePassed(self._is_shutdown(job_ends)) from None
                finally:
                    self._waiting.discard(scope)
                yield item
        finally:
            self.running -= 1
            await items.aclose()
