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
    from worker.config.settings import WorkerSettings
    from worker.jobs.job_input import JobInput

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
    """Where a stream of items is cut into batches of ``size`` units: as soon as the units since the
    last cut reach the current batch size (an item is never split, so a batch can weigh more).

    ``needed()`` is the rule: how many more units complete the current batch. Items of one unit
    each (SSE events) go to ``add``, which cuts; a reader weighing its items itself (tokens) waits
    for ``needed()`` units and hands them to ``fill``, so nothing is counted twice.

    ``free`` leading units do not count (the events vLLM sends before any output): they ride in
    the first batch, with everything that arrived together with the unit that completed it, so
    that batch carries the first token, as a raw stream's does.
    """

    __slots__ = ("free", "filled", "pending", "size")

    def __init__(self, size: BatchSize, free: int = 0) -> None:
        self.size, self.free = size, free
        self.pending: list[T] = []
        self.filled = 0

    def needed(self) -> int:
        """Units still to arrive before the next cut: what a reader can wait for in one go."""
        return max(1, self.free + math.ceil(self.size.current_batch_size) - self.filled)

    def add(self, items: Sequence[T]) -> list[list[T]]:
        """Items of one unit each that arrived together; the batches they complete, in order."""
        if not self.free:
            return self._slice(self.pending + list(items))
        self.pending += items
        self.filled += len(items)
        if self.filled - self.free < self.size.current_batch_size:
            return []
        return [self._cut()]

    def fill(self, items: Sequence[T]) -> list[T]:
        """Items that bring the ``needed()`` units, counted by the reader: the batch they complete."""
        self.pending += items
        return self._cut()

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
    """``source`` in the batches ``Batches`` cuts, items weighing ``weight(item)`` units; the
    remainder when it ends. Counted here, in locals: this loop runs once per streamed token."""
    batches: Batches[T] = Batches(size)
    group: list[T] = []
    due = batches.needed()
    async for item in source:
        group.append(item)
        due -= weight(item)
        if due <= 0:
            yield batches.fill(group)
            group, due = [], batches.needed()
    if group:
        yield group
