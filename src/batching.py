"""Dynamic stream batching, shared by the raw and the OpenAI paths. Pure: no vLLM here.

A stream starts with small batches, so the first tokens arrive at once, and grows them
geometrically up to a cap, so long streams cost few messages:
``BatchSize(50, 1, 3)`` gives batches of 1, 3, 9, 27, 50, 50, ... units (tokens on the raw
path, SSE events on the OpenAI path). ``Batches`` is the one rule of where a stream is cut.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from job_input import JobInput
    from settings import WorkerSettings

T = TypeVar("T")

__all__ = ["BatchSize", "Batches", "batched", "job_batch_size"]


class BatchSize:
    """Current batch size of one stream; ``update()`` after each emitted batch."""

    def __init__(self, max_batch_size: int, min_batch_size: int,
                 batch_size_growth_factor: float) -> None:
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.batch_size_growth_factor = batch_size_growth_factor
        # Growth needs a factor above 1 and room between min and max; otherwise fixed at max.
        self.is_dynamic = (batch_size_growth_factor > 1 and min_batch_size >= 1
                           and max_batch_size > min_batch_size)
        self.current_batch_size: float = min_batch_size if self.is_dynamic else max_batch_size

    def update(self) -> None:
        if self.is_dynamic:
            self.current_batch_size = min(self.current_batch_size * self.batch_size_growth_factor,
                                          self.max_batch_size)

    def __repr__(self) -> str:
        return (f"BatchSize(max={self.max_batch_size}, min={self.min_batch_size}, "
                f"growth={self.batch_size_growth_factor}, current={self.current_batch_size})")


def job_batch_size(job: JobInput, settings: WorkerSettings) -> BatchSize:
    """Stream batching for one job: the worker's settings, overridden by the job's own."""
    return BatchSize(job.max_batch_size or settings.max_batch_size,
                     job.min_batch_size or settings.min_batch_size,
                     job.batch_size_growth_factor or settings.batch_size_growth_factor)


def _one(_: object) -> int:
    return 1


class Batches(Generic[T]):
    """Where a stream of items is cut into batches of ``size``: as soon as the items since the last
    cut weigh the current batch size (an item is never split, so a batch can weigh more).

    ``free`` leading units do not count (the events vLLM sends before any output): they ride in
    the first batch, with everything that arrived together with the unit that completed it, so
    that batch carries the first token, as a raw stream's does.
    """

    __slots__ = ("free", "filled", "pending", "size", "weight")

    def __init__(self, size: BatchSize, weight: Callable[[T], int] = _one, free: int = 0) -> None:
        self.size, self.weight, self.free = size, weight, free
        self.pending: list[T] = []
        self.filled = 0

    def needed(self) -> int:
        """Units still to arrive before the next cut: what a reader can wait for in one go."""
        return max(1, self.free + math.ceil(self.size.current_batch_size) - self.filled)

    def push(self, item: T) -> list[T] | None:
        """One arrived item; the batch it completes, if it completes one."""
        self.pending.append(item)
        self.filled += self.weight(item)
        if self.filled - self.free >= self.size.current_batch_size:
            return self._cut()
        return None

    def add(self, items: Sequence[T]) -> list[list[T]]:
        """Items that arrived together; the batches they complete, in order."""
        if not self.free:
            if self.weight is _one:  # one unit each (SSE events): cut by slicing, as push would
                return self._slice(self.pending + list(items))
            return [batch for item in items if (batch := self.push(item)) is not None]
        self.pending += items
        self.filled += sum(map(self.weight, items))
        if self.filled - self.free < self.size.current_batch_size:
            return []
        return [self._cut()]

    def _slice(self, pending: list[T]) -> list[list[T]]:
        batches = []
        while len(pending) >= self.size.current_batch_size:
            cut = math.ceil(self.size.current_batch_size)
            batches.append(pending[:cut])
            pending = pending[cut:]
            self.size.update()
        self.pending, self.filled = pending, len(pending)
        return batches

    def rest(self) -> list[T]:
        """What is left once the stream has ended (a last, short batch), and no more."""
        rest, self.pending, self.filled = self.pending, [], 0
        return rest

    def _cut(self) -> list[T]:
        batch, self.pending, self.filled = self.pending, [], 0
        self.free = 0
        self.size.update()
        return batch


async def batched(source: AsyncIterable[T], size: BatchSize,
                  weight: Callable[[T], int] = _one) -> AsyncIterator[list[T]]:
    """``source`` in the batches ``Batches`` cuts; the remainder when it ends."""
    batches = Batches(size, weight)
    async for item in source:
        if (batch := batches.push(item)) is not None:
            yield batch
    if rest := batches.rest():
        yield rest
