"""The admission gate before vLLM (``engine/admission``), over the KV budget's rule (pure logic: the
real engine behind it is tested in tests/engine/test_concurrency_on_the_engine.py)."""

from __future__ import annotations

import asyncio

from worker.engine.admission import Admission
from worker.scheduling.concurrency import KvBudget


async def settle() -> None:
    """Lets every task that can run go as far as it can (a few hops of the loop)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _hold(gate: Admission, name: str, blocks: int, entered: list[str], leave: asyncio.Event) -> None:
    async with gate.admitted(blocks * 128 - 100, 100):  # ``blocks`` blocks as planned
        entered.append(name)
        await leave.wait()


def test_requests_enter_in_arrival_order_once_their_planned_blocks_fit():
    async def scenario() -> None:
        budget = KvBudget(blocks=6, block_size=128)
        gate, entered = Admission(lambda: budget), []
        leave = {name: asyncio.Event() for name in "abcd"}
        tasks = {name: asyncio.create_task(_hold(gate, name, blocks, entered, leave[name]))
                 for name, blocks in zip("abcd", (3, 2, 4, 1), strict=True)}
        await settle()
        assert entered == ["a", "b"] and gate.waiting == 2  # c (4 blocks) waits; d waits behind it
        leave["b"].set()
        await settle()
        assert entered == ["a", "b"]  # 3 blocks free: not c's 4, and d keeps its turn
        leave["a"].set()
        await settle()
        assert entered == ["a", "b", "c", "d"] and (budget.used, gate.waiting) == (5, 0)
        leave["c"].set()
        leave["d"].set()
        await asyncio.gather(*tasks.values())
        assert (budget.used, budget.admitted) == (0, 0)

    asyncio.run(scenario())


def test_a_request_stopped_while_it_waits_leaves_its_place_and_the_next_may_enter():
    async def scenario() -> None:
        budget = KvBudget(blocks=4, block_size=128)
        gate, entered = Admission(lambda: budget), []
        leave = asyncio.Event()
        first = asyncio.create_task(_hold(gate, "first", 2, entered, leave))
        big = asyncio.create_task(_hold(gate, "big", 4, entered, leave))
        small = asyncio.create_task(_hold(gate, "small", 2, entered, leave))
        await settle()
        assert entered == ["first"] and gate.waiting == 2
        big.cancel()  # its job was stopped, or its client left
        await settle()
        assert entered == ["first", "small"] and gate.waiting == 0 and budget.used == 4
        leave.set()
        await asyncio.gather(first, small)
        assert big.cancelled() and (budget.used, budget.admitted) == (0, 0)

    asyncio.run(scenario())


def test_a_request_that_fails_in_vllm_gives_its_room_back():
    async def scenario() -> None:
        budget = KvBudget(blocks=4, block_size=128)
        gate = Admission(lambda: budget)
        try:
            async with gate.admitted(10, 100):
                assert budget.admitted == 1
                raise ValueError("the prompt is too long")
        except ValueError:
            pass
        assert (budget.used, budget.admitted) == (0, 0)

    asyncio.run(scenario())


def test_before_the_cache_is_known_requests_enter_at_once_uncounted():
    async def scenario() -> None:
        gate = Admission(lambda: None)
        async with gate.admitted(10_000, 10_000):
            assert gate.waiting == 0

    asyncio.run(scenario())
