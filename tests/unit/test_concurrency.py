"""The concurrency controller's rule, step by step, the KV budget's plan, and both over a toy
scheduler, with and without the admission gate (pure logic: the real engine's feed and gate are
tested in tests/engine/test_concurrency_on_the_engine.py, whole workers in
tests/endpoint/test_adaptive_concurrency.py)."""

from __future__ import annotations

import logging
import math

import pytest

from worker.scheduling.concurrency import (
    DEFAULT_OUTPUT_TOKENS,
    GROWTH,
    KV_HEADROOM,
    MIN_OUTPUTS,
    OUTPUT_WINDOW,
    PATIENCE,
    QUEUE_SHARE,
    RATE_SECONDS,
    SIZE_WINDOW,
    START,
    Concurrency,
    KvBudget,
)


class Held:
    """The jobs the worker holds, as the test sets them."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def __call__(self) -> int:
        return self.count


def step(jobs: Concurrency, running: int, waiting: int = 0, kv_usage: float = 0.1, started: int = 0,
         finished: int = 0, preempted: int = 0) -> int:
    jobs.observe(running=running, waiting=waiting, kv_usage=kv_usage, started=started, finished=finished,
                 preempted=preempted)
    return jobs.target


def out_of_room(jobs: Concurrency, running: int) -> None:
    """Requests wait ``PATIENCE`` steps while none starts: the ramp ends."""
    for _ in range(PATIENCE):
        step(jobs, running, waiting=5, kv_usage=0.95)


def test_a_full_worker_ramps_up_by_half_while_the_engine_has_room():
    held = Held()
    jobs = Concurrency(1, 256, held)
    targets = [jobs.target]
    for _ in range(6):
        held.count = jobs.target  # the job loop took a job for every slot
        targets.append(step(jobs, running=held.count))
    assert targets == [START, 24, 36, 54, 81, 122, 183]


def test_the_ramp_waits_until_vllm_runs_the_jobs_held_before_its_last_rise():
    held = Held(START)
    jobs = Concurrency(1, 256, held)
    assert step(jobs, running=0) == 24
    held.count = 24
    assert step(jobs, running=10) == 24  # of the 16 held before, 10 have reached the engine
    assert step(jobs, running=16) == 36


@pytest.mark.parametrize("load", [
    {"running": 5},  # 5 jobs held of 16: no evidence that more would be served
    {"running": 16, "waiting": 4, "started": 4},  # a prefill still waits for the token budget
    {"running": 16, "kv_usage": KV_HEADROOM},  # the KV cache is nearly full
])
def test_the_target_holds_unless_a_full_worker_has_room(load):
    jobs = Concurrency(1, 256, Held(min(load["running"], START)))
    assert step(jobs, **load) == START


def test_a_burst_whose_prefill_spans_steps_never_shrinks_the_target():
    jobs = Concurrency(1, 256, Held(128), start=128)
    for running in range(32, 128, 16):  # requests wait for many steps, but some start in each
        assert step(jobs, running, waiting=128 - running, started=16) == 128


def test_waiting_with_none_started_for_patience_steps_shrinks_to_what_the_engine_ran():
    jobs = Concurrency(1, 256, Held(40), start=40)
    for _ in range(PATIENCE - 1):
        assert step(jobs, running=30, waiting=10, kv_usage=0.99) == 40
    # The requests that finished in the step ran in it too (vLLM counts them out before it admits).
    assert step(jobs, running=24, waiting=10, kv_usage=0.99, finished=6) == 30


def test_a_preemption_reported_shrinks_to_what_ran_without_it_never_below_the_floor():
    # vLLM reports a preemption when the preempted request resumes: it is among those running.
    jobs = Concurrency(4, 256, Held(20), start=20)
    assert step(jobs, running=18, kv_usage=0.99, finished=2, preempted=1) == 19
    jobs._held.count = 19
    assert step(jobs, running=3, kv_usage=0.99, preempted=2) == 4
    assert step(jobs, running=30, kv_usage=0.99, preempted=1) == 4  # never raised by one


def test_while_the_worker_drains_a_surplus_the_engine_is_not_read_as_full_again():
    held = Held(54)
    jobs = Concurrency(1, 256, held, start=54)
    out_of_room(jobs, running=43)
    assert jobs.target == 43
    for running in (40, 30, 20, 10):  # the surplus it took before the cut preempts, waits, finishes
        assert step(jobs, running, waiting=54 - running, kv_usage=1.0, preempted=1) == 43
    held.count = 43
    out_of_room(jobs, running=21)
    assert jobs.target == 21


def test_after_the_ramp_growth_waits_a_round_and_leaves_the_kv_headroom_its_peak_shows():
    held = Held(20)
    jobs = Concurrency(1, 256, held, start=20)
    out_of_room(jobs, running=20)
    for kv, finished in ((0.3, 5), (0.5, 5), (0.6, 5), (0.45, 4)):  # 19 finish: not a round yet
        assert step(jobs, 20, kv_usage=kv, finished=finished) == 20
    assert step(jobs, 20, kv_usage=0.4, finished=1) == int(20 * KV_HEADROOM / 0.6)  # 30: room for half
    held.count = 30
    for _ in range(3):
        step(jobs, 30, kv_usage=0.85, finished=10)
    assert jobs.target == 31  # 0.9 / 0.85: one more
    held.count = 31
    for _ in range(4):
        step(jobs, 31, kv_usage=0.88, finished=10)
    assert jobs.target == 31  # room for less than one more


def test_growth_stops_at_the_cap_and_equal_bounds_fix_the_number():
    held = Held()
    jobs = Concurrency(1, 20, held)
    for _ in range(3):
        held.count = jobs.target
        step(jobs, held.count)
    assert jobs.target == 20
    fixed = Concurrency(30, 30, Held(30))
    step(fixed, 30)
    step(fixed, 3, kv_usage=0.99, preempted=5)
    out_of_room(fixed, 3)
    assert fixed.target == 30


def test_the_cap_resolved_after_start_bounds_the_target():
    jobs = Concurrency(1, None, Held())  # MAX_CONCURRENCY unset: vLLM's max_num_seqs, once known
    jobs.set_cap(256)
    assert (jobs.target, jobs.cap) == (START, 256)
    jobs = Concurrency(1, None, Held())
    jobs.set_cap(8)
    assert (jobs.target, jobs.cap) == (8, 8)


def test_each_change_is_logged_once_and_a_rise_wakes_the_job_loop(caplog):
    raised = []
    jobs = Concurrency(1, 256, Held(START), on_raise=lambda: raised.append(jobs.target))
    with caplog.at_level(logging.INFO, logger="worker.scheduling.concurrency"):
        step(jobs, START)  # grows: 16 -> 24
        for _ in range(10):  # held stays 16 of 24: no change, nothing logged
            step(jobs, START)
        jobs._held.count = 24
        out_of_room(jobs, 20)
    assert [r.getMessage() for r in caplog.records] == [
        "Concurrency 16 -> 24: the engine has room", "Concurrency 24 -> 20: requests wait in vLLM"]
    assert raised == [24]


# --- over a toy scheduler ---------------------------------------------------------------------------


class ToyEngine:
    """vLLM's scheduling in miniature: KV blocks allocated per ``BLOCK`` tokens; a waiting request is
    admitted (and prefilled, producing its first token) when its prompt's blocks are free; a running
    request that needs a block when none is free preempts the newest one, which waits to be computed
    again (and is reported preempted when it resumes, as vLLM reports it); every running request
    makes one token per step."""

    BLOCK = 128

    def __init__(self, blocks: int) -> None:
        self.blocks, self.running, self.waiting, self.used = blocks, [], [], {}
        self.preemptions = 0

    def _free(self) -> int:
        return self.blocks - sum(self.used.values())

    def step(self) -> dict:
        preempted = resumed = started = 0
        for request in list(self.running):
            while request in self.running and math.ceil((request["done"] + 1) / self.BLOCK) > self.used[
                    id(request)]:
                if self._free():
                    self.used[id(request)] += 1
                    continue
                victim = self.running.pop()
                del self.used[id(victim)]
                victim["done"], victim["preempted"] = victim["prompt"], True
                self.waiting.insert(0, victim)
                preempted += 1
        while not preempted and self.waiting and math.ceil(
                self.waiting[0]["prompt"] / self.BLOCK) <= self._free():
            request = self.waiting.pop(0)
            self.running.append(request)
            self.used[id(request)] = math.ceil(request["prompt"] / self.BLOCK)
            started += not request.setdefault("started", False)
            resumed += request.pop("preempted", False)
            request["started"] = True
        self.ended = []
        for request in list(self.running):
            request["done"] += 1
            if request["done"] >= request["prompt"] + request["out"]:
                self.running.remove(request)
                del self.used[id(request)]
                self.ended.append(request)
        self.preemptions += preempted
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_usage": sum(self.used.values()) / self.blocks, "started": started,
                "finished": len(self.ended), "preempted": resumed,
                "outputs": tuple((r["prompt"], r["out"], r["out"], 0) for r in self.ended)}


def run_toy(blocks: int, clients: int, prompt: int, out: int, steps: int, gated: bool = False,
            sizes: list[tuple[int, int]] | None = None) -> tuple[ToyEngine, list[int]]:
    """``clients`` in a closed loop (each sends its next request when one ends) through a worker whose
    job loop fills its slots up to the target before each step; the target after each step. ``gated``:
    the worker knows the KV cache (less vLLM's null block) and a request enters the engine once the
    budget holds it (``engine/admission``, synchronously); ``sizes``: (prompt, out) of request i, in turn.
    """
    engine, held, queued, targets = ToyEngine(blocks), Held(), clients, []
    jobs, gate, sent = Concurrency(1, 256, held, take_latency=0.5, clock=lambda: len(targets)), [], 0
    if gated:
        jobs.set_kv_cache(blocks - 1, ToyEngine.BLOCK, 8192)
    for _ in range(steps):
        for _ in range(max(0, min(queued, jobs.target - held.count))):
            size = sizes[sent % len(sizes)] if sizes else (prompt, out)
            request = {"prompt": size[0], "out": size[1], "done": size[0]}
            (gate if gated else engine.waiting).append(request)
            held.count, queued, sent = held.count + 1, queued - 1, sent + 1
        while gate and jobs.kv.fits(blocks := jobs.kv.need(gate[0]["prompt"], gate[0]["out"])):
            jobs.kv.admit(blocks)
            engine.waiting.append({**gate.pop(0), "blocks": blocks})
        load = engine.step()
        for request in engine.ended if gated else ():
            jobs.kv.release(request["blocks"])
        held.count, queued = held.count - load["finished"], queued + load["finished"]
        jobs.observe(**load)
        targets.append(jobs.target)
    return engine, targets


@pytest.mark.parametrize(("blocks", "out", "fits"), [(43, 128, 21), (200, 400, 50), (90, 300, 30)])
def test_on_a_small_kv_cache_the_target_settles_where_every_request_fits_and_preemptions_stop(
        blocks, out, fits):
    # 64 clients; a request of 70 prompt tokens holds one block when it starts and ends on its
    # ceil((70 + out) / 128)-th: ``fits`` of them fit whole, ``blocks`` fit young.
    preempted_by_then = run_toy(blocks=blocks, clients=64, prompt=70, out=out, steps=3000)[0].preemptions
    engine, targets = run_toy(blocks=blocks, clients=64, prompt=70, out=out, steps=6000)
    assert fits * KV_HEADROOM - 2 <= targets[-1] <= fits and len(set(targets[-1500:])) == 1
    assert engine.preemptions == preempted_by_then > 0  # none after the first 3000 steps


def test_with_room_for_every_client_the_target_follows_the_clients_and_nothing_waits():
    engine, targets = run_toy(blocks=2000, clients=128, prompt=70, out=128, steps=1000)
    assert engine.preemptions == 0 and targets[-1] >= 128 and targets[-1] == targets[10]


# --- what fits: the KV budget ----------------------------------------------------------------------


def test_a_request_is_planned_at_its_prompt_and_max_tokens_until_outputs_are_known():
    kv = KvBudget(blocks=85, block_size=128, context=8192)
    assert kv.need(79, 128) == 2  # 207 tokens
    assert kv.need(79, 49) == 1  # 128 tokens: one block
    assert kv.need(79, 128, n=3) == 6  # each sequence grows its own blocks
    assert kv.need(100, 4000) == 33  # the most it can take: no preemption to find the limit
    # No max_tokens, or one that reaches the end of the context (what vLLM's serving sets when the
    # client gave none): DEFAULT_OUTPUT_TOKENS.
    assert kv.need(100, None) == kv.need(100, 8092) == math.ceil((100 + DEFAULT_OUTPUT_TOKENS) / 128)


def test_with_prefix_caching_a_requests_sequences_share_its_prompts_whole_blocks():
    """vLLM's issue #54 case: n=32 on a 1,500-token prompt, 40 tokens each, in a cache of 688 blocks
    of 16: its prompt's 93 whole blocks once, and 4 blocks per sequence (12 prompt tokens and 40)."""
    shared = KvBudget(blocks=688, block_size=16, context=2048, prefix_caching=True)
    assert shared.need(1500, 40, n=32) == 93 + 32 * 4 and shared.sequence_blocks(1500, 40) == 97
    alone = KvBudget(blocks=688, block_size=16, context=2048)  # prefix caching off: each its own copy
    assert alone.need(1500, 40, n=32) == 32 * 97 and not alone.never_fits(1500, 40)
    assert shared.need(79, 128, n=1) == alone.need(79, 128, n=1) == 13  # one sequence: the same


def test_outputs_are_planned_from_what_the_recent_requests_took():
    kv = KvBudget(blocks=85, block_size=128, context=8192)
    for _ in range(MIN_OUTPUTS - 1):
        kv.finished(100, 300, 4000)  # chat answers: far below the max_tokens their clients set
        kv.finished(100, 200, 8092)  # no max_tokens: vLLM's serving set what the context leaves
    assert kv.planned_output(100, 4000) == 4000 and kv.planned_output(100, None) == DEFAULT_OUTPUT_TOKENS
    kv.finished(100, 300, 4000)
    kv.finished(100, 200, 8092)
    assert kv.planned_output(100, 4000) == kv.planned_output(100, 2000) == 300
    assert kv.planned_output(100, 50) == 50  # at most its own max_tokens
    assert kv.planned_output(100, None) == kv.planned_output(100, 8092) == 200
    for _ in range(OUTPUT_WINDOW):  # answers that run to their max_tokens, whatever it is
        kv.finished(100, 1000, 1000)
        kv.finished(100, 10, 10)
    assert kv.planned_output(100, 2000) == 2000 and kv.planned_output(100, 40) == 40


def test_the_plan_is_a_high_quantile_of_the_recent_requests():
    kv = KvBudget(blocks=85, block_size=128)
    for tokens in [100] * 80 + [900] * 20:  # a fifth of the answers are long
        kv.finished(10, tokens, None)
    assert kv.planned_output(10, None) == 900
    for tokens in [100] * 190 + [900] * 10:  # 1 in 20 of the last 200
        kv.finished(10, tokens, None)
    assert kv.planned_output(10, None) == 100


def test_a_prompt_prefix_the_recent_requests_found_cached_is_planned_once():
    kv = KvBudget(blocks=85, block_size=128)
    assert kv.need(2100, 300) == 19  # 2,400 tokens: no request has finished yet
    for _ in range(MIN_OUTPUTS):  # a shared system prompt: vLLM found 2,048 of 2,100 tokens cached
        kv.finished(2100, 300, 300, 2048)
    assert kv.need(2100, 300) == 3  # its own 52 + 300 tokens, beside 16 shared blocks held once
    assert kv.prefix_blocks == 16
    for _ in range(SIZE_WINDOW):  # the jobs not seen yet are sized by the recent ones
        kv.need(2100, 300)
    assert kv.requests_that_fit() == (85 - 16) // 3 == 23  # 4 before
    kv.admit(3)
    assert kv.fits(85 - 16 - 3) and not kv.fits(85 - 16 - 3 + 1)
    for _ in range(MIN_OUTPUTS):  # once 1 in 10 of the recent requests found nothing cached: none shared
        kv.finished(2100, 300, 300, 0)
    assert kv.need(2100, 300) == 19 and kv.prefix_blocks == 0


def test_requests_enter_while_the_planned_blocks_fit_and_one_alone_always_enters():
    kv = KvBudget(blocks=10, block_size=128)
    big = kv.need(1000, 280)  # 10 blocks: the whole cache
    assert not kv.never_fits(1000, 280) and kv.fits(big)  # alone, it enters
    kv.admit(big)
    assert not kv.fits(1)
    kv.release(big)
    for _ in range(4):
        assert kv.fits(2)
        kv.admit(kv.need(79, 128))  # 2 blocks each
    assert (kv.used, kv.admitted) == (8, 4)
    assert kv.fits(2) and not kv.fits(3)


def test_a_request_one_sequence_of_which_is_larger_than_the_cache_never_fits():
    kv = KvBudget(blocks=10, block_size=128, context=2048)
    assert kv.requests_that_fit() is None  # no request seen yet: nothing to size jobs by
    # max_tokens past the context: planned at DEFAULT_OUTPUT_TOKENS (512), 12 blocks in all, above 10
    assert kv.never_fits(1000, 2000) and kv.sequence_blocks(1000, 2000) == kv.need(1000, 2000) == 12
    # 11 sequences of one block each: larger than the cache together, but each fits: vLLM runs them
    # as they fit, and so the gate lets it in alone.
    assert not kv.never_fits(10, 100) and kv.need(10, 100, n=11) == 11 and kv.fits(11)
    assert kv.requests_that_fit() is None  # neither says anything about the jobs to hold
    # A sequence never passes the context: a long prompt with no max_tokens is planned to its end.
    assert kv.need(1900, None) == 16 and KvBudget(16, 128, context=2048).need(1900, None) == 16


def test_what_fits_counts_the_requests_in_vllm_and_mixed_sizes_by_their_mean():
    kv = KvBudget(blocks=60, block_size=128)
    sizes = [kv.need(100, 100), kv.need(100, 500), kv.need(100, 1000)]  # 2, 5 and 9 blocks
    assert sizes == [2, 5, 9]
    assert kv.requests_that_fit() == 11  # 60 blocks of requests of 16 / 3 blocks on average
    for blocks in sizes:
        kv.admit(blocks)
    assert kv.requests_that_fit() == 3 + 8  # 44 free blocks: 8 more of the mean size
    kv.admit(44)  # a big one fills the cache
    assert kv.requests_that_fit() == 4


def test_with_the_kv_cache_known_the_target_is_what_fits_and_those_finishing_in_one_job_take():
    now = [0.0]
    held = Held(16)
    jobs = Concurrency(1, 256, held, take_latency=0.5, clock=lambda: now[0])
    jobs.set_kv_cache(86, 128, 8192)
    for _ in range(16):
        jobs.kv.admit(jobs.kv.need(79, 128))  # 2 blocks each: 43 fit
    assert jobs.target == START  # the ramp still bounds a fresh worker: others share the burst
    for _ in range(5):
        held.count = jobs.target
        step(jobs, running=min(held.count, 43))
    assert jobs.target == 43  # nothing finished yet: no queue
    # 40 requests finished within RATE_SECONDS: 4 a second, 2 in one job take of 0.5 s.
    for _ in range(4):
        now[0] += 1
        step(jobs, running=43, finished=10)
    assert jobs.target == 43 + 2
    jobs.take_latency = 60  # bounded: a job that could start on another worker does not wait here
    assert jobs.target == 43 + math.ceil(QUEUE_SHARE * 43)
    now[0] += RATE_SECONDS + 1
    step(jobs, running=43)
    assert jobs.target == 43


@pytest.mark.parametrize("sizes", [
    [(79, 128)],  # the bench's requests: 2 blocks each
    [(70, 240), (600, 40), (20, 1000), (300, 300)],  # mixed: 3, 6, 9 and 5 blocks
])
def test_gated_by_the_budget_the_first_burst_fits_without_a_preemption(sizes):
    engine, targets = run_toy(blocks=86, clients=64, prompt=0, out=0, steps=3000, gated=True, sizes=sizes)
    assert engine.preemptions == 0
    ungated, _ = run_toy(blocks=86, clients=64, prompt=0, out=0, steps=3000, sizes=sizes)
    assert ungated.preemptions > 0  # the same load, ungated, finds the limit by preempting


def test_with_the_kv_cache_known_a_round_without_preemption_raises_by_half_after_a_cut():
    # The gate packs the cache to its plan, so a round's KV peak is near 100 %: the peak rule would
    # never rise again. With the budget, what enters vLLM is what fits: a clean round is enough.
    held = Held(40)
    jobs = Concurrency(1, 256, held, start=40)
    jobs.set_kv_cache(1000, 128, 8192)
    jobs.kv.need(79, 128)  # requests of 2 blocks: 500 fit
    step(jobs, running=30, kv_usage=0.99, preempted=1)  # a request ran longer than planned
    assert jobs.target == 29
    held.count = 29
    for _ in range(2):
        step(jobs, running=29, kv_usage=0.98, finished=15)  # a round: 29 requests finished, none preempted
    assert jobs.target == int(29 * GROWTH)


# --- KV_OVERCOMMIT: requests planned beyond the cache, which vLLM preempts as it fills -------------


def test_an_overcommitted_budget_lets_in_that_share_more_and_still_refuses_only_what_the_cache_never_holds():
    for overcommit, fit in ((0.0, 43), (0.5, 64)):  # requests of 2 blocks: 43 fit whole
        kv = KvBudget(blocks=86, block_size=128, overcommit=overcommit)
        assert admit_all(kv, 64, 128) == fit and kv.requests_that_fit() == fit
        assert not kv.never_fits(100, 86 * 128 - 100) and kv.never_fits(100, 86 * 128 - 99)  # the cache itself


def admit_all(kv: KvBudget, prompt: int, max_tokens: int) -> int:
    """Requests of that size admitted, one after another, while they fit."""
    admitted = 0
    while kv.fits(need := kv.need(prompt, max_tokens)):
        kv.admit(need)
        admitted += 1
    return admitted


def test_with_an_overcommitted_budget_a_preemption_or_a_queue_in_vllm_is_planned_and_cuts_nothing():
    for overcommit, fit, after in ((0.5, 64, 64), (0.0, 43, 43 - 8)):
        held = Held(fit)
        jobs = Concurrency(1, 256, held, start=64, kv_overcommit=overcommit)
        jobs.set_kv_cache(86, 128, 8192)
        for _ in range(SIZE_WINDOW):
            jobs.kv.need(64, 128)
        for _ in range(PATIENCE):  # vLLM runs what its cache holds and queues the rest
            step(jobs, running=43, waiting=21, preempted=8)
        assert jobs.target == after  # without overcommit: cut to what ran, less those preempted
