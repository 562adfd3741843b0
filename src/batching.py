"""Dynamic stream batching, shared by the raw and the OpenAI paths. Pure: no vLLM here.

A stream starts with small batches, so the first tokens arrive at once, and grows them
geometrically up to a cap, so long streams cost few messages:
``BatchSize(50, 1, 3)`` gives batches of 1, 3, 9, 27, 50, 50, ... units (tokens on the raw
path, SSE events on the OpenAI path).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["BatchSize", "batched"]


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


async def batched(source: AsyncIterable[T], size: BatchSize,
                  weight: Callable[[T], int] = lambda _: 1) -> AsyncIterator[list[T]]:
    """Group ``source`` into lists whose summed ``weight`` reaches the current batch size.

    The remainder is flushed when the source ends. An item is never split, so a batch can
    exceed the target when one item weighs several units.
    """
    batch: list[T] = []
    filled = 0
    async for item in source:
        batch.append(item)
        filled += weight(item)
        if filled >= size.current_batch_size:
            yield batch
            batch, filled = [], 0
            size.update()
    if batch:
        yield batch
