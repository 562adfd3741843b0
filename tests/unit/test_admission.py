"""The admission gate before vLLM (``engine/admission``), over the KV budget's rule (pure logic: the
real engine behind it is tested in tests/engine/test_concurrency_on_the_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from worker.engine.admission import Admission
from worker.scheduling.concurrency import KvBudget
from worker.wire.errors import RequestError


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


def test_before_the_cache_is_known_requests_go_straight_to_vllm_uncounted():
    assert Admission(lambda: None).admitted(10_000, 10_000) is None  # no place: no layer before vLLM


def test_a_request_above_max_n_is_refused_whatever_the_budget():
    for budget in (None, KvBudget(blocks=4, block_size=128)):
        with pytest.raises(RequestError, match=r"^n=9 is above MAX_N=8") as refused:
            Admission(lambda budget=budget: budget, max_n=8).admitted(10, 10, n=9)
        assert (refused.value.param, refused.value.status) == ("n", 400)
    assert Admission(lambda: None, max_n=8).admitted(10, 10, n=8) is None


def test_a_request_larger_than_the_whole_cache_is_refused_at_once_and_the_queue_is_unchanged():
    async def scenario() -> None:
        budget = KvBudget(blocks=6, block_size=128)
        gate, entered = Admission(lambda: budget), []
        leave = asyncio.Event()
        tasks = [asyncio.create_task(_hold(gate, name, blocks, entered, leave))
                 for name, blocks in (("running", 4), ("waiting", 4))]
        await settle()
        assert entered == ["running"] and gate.waiting == 1 and budget.used == 4
        sizes = budget.requests_that_fit()
        with pytest.raises(RequestError, match="can never fit the worker's KV cache: with 768 prompt tokens one "
                                               "sequence needs about 7 blocks of 128") as refused:
            gate.admitted(6 * 128, 100, n=2)  # one sequence: its prompt and output need 7 blocks
        assert refused.value.param == "max_tokens"
        # Nothing in flight or waiting was touched, nor the sizes the jobs to hold are planned from.
        assert (budget.used, budget.admitted, gate.waiting, budget.requests_that_fit()) == (4, 1, 1, sizes)
        leave.set()
        await asyncio.gather(*tasks)
        assert entered == ["running", "waiting"] and (budget.used, budget.admitted) == (0, 0)

    asyncio.run(scenario())


def test_a_request_that_fits_the_whole_cache_alone_still_enters_once_the_others_leave():
    async def scenario() -> None:
        budget = KvBudget(blocks=6, block_size=128)
        gate, entered = Admission(lambda: budget), []
        leave = {name: asyncio.Event() for name in ("small", "whole")}
        tasks = [asyncio.create_task(_hold(gate, name, blocks, entered, leave[name]))
                 for name, blocks in (("small", 1), ("whole", 6))]
        await settle()
        assert entered == ["small"] and gate.waiting == 1
        leave["small"].set()
        await settle()
        assert entered == ["small", "whole"] and budget.used == 6
        leave["whole"].set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_request_whose_sequences_fit_only_one_by_one_enters_alone_and_the_rest_wait_behind_it():
    """n=7 sequences of one block each in a 6-block cache: each fits, so vLLM would run them as they
    fit. It waits for the cache to empty, then enters alone; a request after it waits for it."""
    async def scenario() -> None:
        budget = KvBudget(blocks=6, block_size=128)
        gate, entered = Admission(lambda: budget), []
        leave = {name: asyncio.Event() for name in ("small", "many", "after")}

        async def many() -> None:
            async with gate.admitted(10, 100, n=7):
                entered.append("many")
                await leave["many"].wait()

        tasks = [asyncio.create_task(_hold(gate, "small", 1, entered, leave["small"])),
                 asyncio.create_task(many()), asyncio.create_task(_hold(gate, "after", 1, entered, leave["after"]))]
        await settle()
        assert entered == ["small"] and gate.waiting == 2
        leave["small"].set()
        await settle()
        assert entered == ["small", "many"] and budget.used == 7 and gate.waiting == 1
        leave["many"].set()
        await settle()
        assert entered == ["small", "many", "after"]
        leave["after"].set()
        await asyncio.gather(*tasks)
        assert (budget.used, budget.admitted, gate.waiting) == (0, 0, 0)

    asyncio.run(scenario())
