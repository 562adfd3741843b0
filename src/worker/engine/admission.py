"""Requests enter vLLM in arrival order, each once the KV cache holds what it will need; a request
that this worker will never run is refused at once.

vLLM admits a waiting request as soon as its prompt fits, and preempts running requests (their KV
cache is dropped and computed again later) when the cache runs out as they grow. A burst of young
requests fits at first, so vLLM takes all of it and then preempts. Here a request waits, before vLLM
sees it, until the blocks planned for the requests in vLLM leave room for its own planned size
(``scheduling/concurrency.KvBudget``: the rule, pure logic). A request that waits here holds no KV
cache; it is the worker's few jobs beyond what fits, so that a freed slot is refilled at once.

Requests wait in arrival order, so one that could never run would hold every request behind it for
good. So the gate refuses, with a 400 before the request waits or its response starts, one that asks
for more completions than ``MAX_N``, and one a single sequence of which (its prompt and planned output)
is larger than the whole cache. A request whose ``n`` sequences do not fit together enters once it is
alone, and vLLM runs its sequences as they fit, as it would without the gate. A refused request takes
nothing from the requests in flight or waiting.

Runs on the engine's event loop, as every request does (``vllm_adapter/admission.gate_requests`` wraps
its generate).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from worker.wire.errors import RequestError

__all__ = ["Admission", "Budget"]


class Budget(Protocol):
    blocks: int
    block_size: int

    def need(self, prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int: ...
    def sequence_blocks(self, prompt_tokens: int, max_tokens: int | None) -> int: ...
    def never_fits(self, prompt_tokens: int, max_tokens: int | None) -> bool: ...
    def fits(self, blocks: int) -> bool: ...
    def admit(self, blocks: int) -> None: ...
    def release(self, blocks: int) -> None: ...


class Admission:
    """The gate before vLLM. ``budget()``: the KV budget, None until the engine reported its cache or
    when requests are not gated (they then enter at once, uncounted); ``max_n``: the most
    completions one request may ask for (``MAX_N``; None: no limit)."""

    def __init__(self, budget: Callable[[], Budget | None], max_n: int | None = None) -> None:
        self._budget = budget
        self.max_n = max_n
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def admitted(self, prompt_tokens: int, max_tokens: int | None,
                 n: int = 1) -> AbstractAsyncContextManager[None] | None:
        """Called as the request reaches vLLM: raises ``RequestError`` (400) for one the worker never
        runs, else its place in the queue (inside, it may run in vLLM; leaving frees its room), or None
        when it goes straight to vLLM (no budget)."""
        if self.max_n is not None and n > self.max_n:
            raise RequestError(f"n={n} is above MAX_N={self.max_n}, the most completions one request may "
                               "ask for on this worker", param="n")
        budget = self._budget()
        if budget is None:
            return None
        if budget.never_fits(prompt_tokens, max_tokens):
            raise RequestError(_too_large(budget, prompt_tokens, max_tokens), param="max_tokens")
        return self._place(budget, budget.need(prompt_tokens, max_tokens, n))

    @contextlib.asynccontextmanager
    async def _place(self, budget: Budget, blocks: int) -> AsyncIterator[None]:
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


def _too_large(budget: Budget, prompt_tokens: int, max_tokens: int | None) -> str:
    blocks = budget.sequence_blocks(prompt_tokens, max_tokens)
    return (f"this request can never fit the worker's KV cache: with {prompt_tokens} prompt tokens one "
            f"sequence needs about {blocks} blocks of {budget.block_size} tokens as planned, and the whole "
            f"cache holds {budget.blocks}; ask for fewer tokens (max_tokens) or send a shorter prompt")
