"""Requests enter vLLM in arrival order, each once the KV cache holds what it will need.

vLLM admits a waiting request as soon as its prompt fits, and preempts running requests (their KV
cache is dropped and computed again later) when the cache runs out as they grow. A burst of young
requests fits at first, so vLLM takes all of it and then preempts. Here a request waits, before vLLM
sees it, until the blocks planned for the requests in vLLM leave room for its own planned size
(``scheduling/concurrency.KvBudget``: the rule, pure logic). A request that waits here holds no KV
cache; it is the worker's few jobs beyond what fits, so that a freed slot is refilled at once.

Runs on the engine's event loop, as every request does (``vllm_adapter.gate_requests`` wraps its generate).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

__all__ = ["Admission", "Budget"]


class Budget(Protocol):
    def need(self, prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int: ...
    def fits(self, blocks: int) -> bool: ...
    def admit(self, blocks: int) -> None: ...
    def release(self, blocks: int) -> None: ...


class Admission:
    """The gate before vLLM. ``budget()``: the KV budget, None until the engine reported its cache
    (requests then enter at once, uncounted)."""

    def __init__(self, budget: Callable[[], Budget | None]) -> None:
        self._budget = budget
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def admitted(self, prompt_tokens: int, max_tokens: int | None, n: int = 1) -> AsyncIterator[None]:
        """Inside: the request may run in vLLM (it waited its turn); leaving frees its room."""
        budget = self._budget()
        if budget is None:
            yield
            return
        blocks = budget.need(prompt_tokens, max_tokens, n)
        if self._waiting or not budget.fits(blocks):
            await self._wait(budget, blocks)
        else:
            budget.admit(blocks)
        try:
            yield
        finally:
            budget.release(blocks)
            self._admit_waiting(budget)

    async def _wait(self, budget: Budget, blocks: int) -> None:
        entry = (blocks, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:  # its job was stopped or its client left while it waited
            if entry[1].done() and not entry[1].cancelled():  # admitted just before: give the room back
                budget.release(blocks)
            else:
                self._waiting.remove(entry)
            self._admit_waiting(budget)  # the next may fit where this one did not, or in its room
            raise

    def _admit_waiting(self, budget: Budget) -> None:
        while self._waiting and budget.fits(self._waiting[0][0]):
            blocks, admitted = self._waiting.popleft()
            budget.admit(blocks)
            admitted.set_result(None)
