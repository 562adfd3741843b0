"""BackgroundLoop: streaming across loops, errors, and cancellation of the source."""

import asyncio

import pytest

from event_loop import BackgroundLoop


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
        await asyncio.sleep(0.2)

    asyncio.run(consume())
    assert state == {"closed": True}
