"""BackgroundLoop: streaming across loops, errors, and cancellation of the source."""

import asyncio

import pytest
from conftest import wait_for

from worker.engine.background_loop import BackgroundLoop


@pytest.fixture(scope="module")
def loop():
    background = BackgroundLoop("test-loop")
    yield background
    background.close()


def test_run_and_stream_from_other_loops(loop):
    async def source():
        for i in range(3):
            await asyncio.sleep(0)
            yield i

    async def consume():
        return [x async for x in loop.stream(source())]

    assert loop.run(asyncio.sleep(0, result=5)) == 5
    assert asyncio.run(consume()) == [0, 1, 2]
    assert asyncio.run(consume()) == [0, 1, 2]  # a second caller loop works too


def test_errors_reach_the_consumer(loop):
    async def source():
        yield 1
        raise ValueError("boom")

    async def consume():
        return [x async for x in loop.stream(source())]

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(consume())


def test_closing_the_consumer_cancels_the_source(loop):
    state = {}

    async def source():
        try:
            while True:
                yield 1
                await asyncio.sleep(0.01)
        finally:
            state["closed"] = True

    async def consume():
        stream = loop.stream(source())
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(consume())
    wait_for(lambda: state == {"closed": True}, 5)  # cancelled in the background loop's thread


def test_many_streams_each_get_their_items_in_order_with_fewer_wake_ups(loop):
    """Items produced in one burst for many streams share the consumer loop's wake-ups."""
    async def source(tag: int):
        for i in range(50):
            yield (tag, i)
            await asyncio.sleep(0)  # all streams advance together, as with one engine step each

    async def consume():
        consumer = asyncio.get_running_loop()
        calls = 0
        threadsafe = consumer.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal calls
            calls += 1
            return threadsafe(*args, **kwargs)

        consumer.call_soon_threadsafe = counted
        async def collect(tag: int) -> list:
            return [x async for x in loop.stream(source(tag))]

        results = await asyncio.gather(*(collect(t) for t in range(20)))
        return results, calls

    results, calls = asyncio.run(consume())
    assert results == [[(t, i) for i in range(50)] for t in range(20)]
    assert calls < 20 * 51  # one per item and end without the mailbox


def test_a_closed_consumer_loop_does_not_break_the_background_loop(loop):
    async def endless():
        while True:
            yield 1
            await asyncio.sleep(0.001)

    async def take_one():
        async for _ in loop.stream(endless()):
            return  # the generator is left for the garbage collector; the loop then closes

    asyncio.run(take_one())
    assert loop.run(asyncio.sleep(0.05, result="alive"), timeout=5) == "alive"
    assert asyncio.run(asyncio.wait_for(_first(loop), 5)) == 0


async def _first(loop):
    async def count():
        for i in range(3):
            yield i

    async for item in loop.stream(count()):
        return item
