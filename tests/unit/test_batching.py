"""BatchSize growth and the shared stream batcher (pure logic, fake async source)."""

import asyncio

import pytest

from worker.jobs.batching import Batches, BatchSize, batched


def sizes(size: BatchSize, count: int) -> list[float]:
    out = []
    for _ in range(count):
        out.append(size.current_batch_size)
        size.update()
    return out


def test_default_growth():
    assert sizes(BatchSize(50, 1, 3), 7) == [1, 3, 9, 27, 50, 50, 50]


@pytest.mark.parametrize(("args", "expected"), [
    ((50, 1, 1), [50, 50]),     # no growth: fixed at max
    ((5, 5, 3), [5, 5]),        # max not above min: fixed
    ((10, 2, 2), [2, 4, 8, 10]),
    ((10, 1, 1.5), [1, 1.5, 2.25, 3.375]),
])
def test_growth_variants(args, expected):
    assert sizes(BatchSize(*args), len(expected)) == expected


async def _source(items):
    for item in items:
        yield item


def run_batched(items, size, weight=lambda _: 1):
    async def run():
        return [b async for b in batched(_source(items), size, weight)]
    return asyncio.run(run())


def test_batches_follow_the_schedule_and_flush_the_rest():
    batches = run_batched(range(20), BatchSize(50, 1, 3))
    assert [len(b) for b in batches] == [1, 3, 9, 7]
    assert [x for b in batches for x in b] == list(range(20))


def test_weighted_items_are_never_split():
    batches = run_batched([2, 2, 2, 2], BatchSize(10, 3, 2), weight=lambda x: x)
    assert batches == [[2, 2], [2, 2]]


def test_empty_source_yields_nothing():
    assert run_batched([], BatchSize(50, 1, 3)) == []


def cut_in_chunks(chunks, size, free=0):
    """What Batches cuts when items arrive in ``chunks``, with what each read could wait for."""
    batches, out, needed = Batches(size, free=free), [], []
    for chunk in chunks:
        needed.append(batches.needed())
        out += batches.add(chunk)
    return out + ([rest] if (rest := batches.rest()) else []), needed


def test_chunks_are_cut_where_single_items_would_be():
    items = list(range(20))
    chunked, _ = cut_in_chunks([items[:5], items[5:6], items[6:17], items[17:]], BatchSize(50, 1, 3))
    assert chunked == run_batched(items, BatchSize(50, 1, 3))


def test_the_preamble_rides_free_with_everything_that_arrived_with_the_first_unit():
    # 2 preamble events, then the first token's event arrives with two more.
    batches, needed = cut_in_chunks([["p1"], ["p2", "t1", "t2", "t3"], ["t4", "t5", "t6"], ["t7"]],
                                    BatchSize(50, 1, 3), free=2)
    assert batches == [["p1", "p2", "t1", "t2", "t3"], ["t4", "t5", "t6"], ["t7"]]
    assert needed == [3, 2, 3, 9]  # preamble + first batch; then 3, then 9 (after growth)


def test_a_stream_shorter_than_its_preamble_ends_in_one_batch():
    assert cut_in_chunks([["p1"]], BatchSize(50, 1, 3), free=2)[0] == [["p1"]]
