"""Job deadlines bound only the waits on the engine, and a shutdown cuts every job short."""

import asyncio
import time

import pytest

from worker.jobs.deadlines import DeadlinePassed, Deadlines


class Source:
    """Yields an item every ``interval`` seconds (forever when ``count`` is None)."""

    def __init__(self, interval: float, count: int | None = None) -> None:
        self.interval, self.count, self.closed = interval, count, False

    async def items(self):
        try:
            n = 0
            while self.count is None or n < self.count:
                await asyncio.sleep(self.interval)
                yield n
                n += 1
        finally:
            self.closed = True


def test_items_pass_through_and_the_source_is_closed():
    source = Source(0.001, 5)

    async def run():
        return [i async for i in Deadlines().bound(source.items(), timeout=5)]

    assert asyncio.run(run()) == [0, 1, 2, 3, 4] and source.closed


def test_the_consumer_is_never_cancelled_between_items():
    """The runpod SDK posts each item before asking for the next: that time is never cut short."""
    source = Source(0.01)

    async def run():
        consumer_slept = []
        with pytest.raises(DeadlinePassed) as passed:
            async for _ in Deadlines().bound(source.items(), timeout=0.1):
                await asyncio.sleep(0.3)  # past the deadline, yet not cancelled
                consumer_slept.append(True)
        return passed.value, consumer_slept

    passed, consumer_slept = asyncio.run(run())
    assert not passed.shutdown and consumer_slept == [True] and source.closed


@pytest.mark.parametrize(("timeout", "shutdown"), [(None, True), (30, True), (0.15, False)])
def test_a_shutdown_cuts_waiting_jobs_short(timeout, shutdown):
    source, deadlines = Source(3600), Deadlines()

    async def run():
        async def shut_down_soon():
            await asyncio.sleep(0.05)
            assert deadlines.begin_shutdown(0.2) == 1  # the one job running

        started = time.monotonic()
        task = asyncio.create_task(shut_down_soon())
        with pytest.raises(DeadlinePassed) as passed:
            async for _ in deadlines.bound(source.items(), timeout):
                pass
        await task
        return passed.value.shutdown, time.monotonic() - started

    was_shutdown, took = asyncio.run(run())
    assert was_shutdown is shutdown and took < 0.4 and source.closed


def test_jobs_started_after_a_shutdown_get_only_the_grace_period():
    deadlines = Deadlines()

    async def run():
        deadlines.begin_shutdown(0.1)
        with pytest.raises(DeadlinePassed) as passed:
            async for _ in deadlines.bound(Source(3600).items(), timeout=None):
                pass
        return passed.value.shutdown

    assert asyncio.run(run()) is True


def test_a_second_signal_never_extends_the_grace_period():
    deadlines = Deadlines()

    async def run():
        deadlines.begin_shutdown(0.1)
        first = deadlines.grace_ends
        deadlines.begin_shutdown(10)
        return first, deadlines.grace_ends

    first, after = asyncio.run(run())
    assert after == first
