"""How many jobs the worker holds, and which of them vLLM runs: as many as its engine serves at
once and its KV cache holds, no more, no fewer.

A fixed number is wrong either way. Too low, and the engine idles while jobs queue at RunPod. Too
high, and the worker takes jobs that vLLM can only queue or preempt: on an endpoint with several
workers those jobs would have started at once elsewhere, and RunPod's autoscaler sees an empty queue.

**What fits** (``KvBudget``). The KV cache's blocks are known at start, and each request's size as it
reaches the engine: its prompt's tokens, and its output's as planned from the recent requests that
finished (``OUTPUT_QUANTILE`` of the last ``OUTPUT_WINDOW``): what such requests took, or
``max_tokens`` times the share of theirs they took if more, at most ``max_tokens``; when the client
set no ``max_tokens``, what such requests took. Until ``MIN_OUTPUTS`` have finished: ``max_tokens``
(the most it can take: a fresh worker's first burst needs no preemption to find the limit), or
``DEFAULT_OUTPUT_TOKENS``. A prompt's part that nearly every recent request found in vLLM's prefix
cache (a shared system prompt) is planned once, not per request. A request enters vLLM once the
blocks planned for the requests in it leave room for its own (``engine/admission``). The room is the
cache and ``overcommit`` times it more (``KV_OVERCOMMIT``): with none, vLLM never admits more than
the cache holds when they have all grown; it would admit any request whose prompt fits, and preempt
as they grow. With some, the requests beyond the cache get their first tokens at once, and vLLM
preempts them as the cache fills, within the plan's bound. The jobs to hold are the requests that
fit (those in vLLM, and as many more of the recent requests' mean size as the free blocks hold)
plus a few that wait for room:
as many as finish during one job-take round trip (``take_latency``, ``JOB_TAKE_LATENCY``), at most
``QUEUE_SHARE`` of those that fit, so that a freed slot is refilled at once, and a job that could
start on another worker of the endpoint does not wait long in this one.

**The engine's load** bounds that number too. The target follows what vLLM's scheduler reports after
each engine step:

- **fewer** when the engine is out of room: requests have waited ``PATIENCE`` steps in a row while
  none was admitted, or vLLM reports a preemption (when the preempted request resumes; a request ran
  longer than planned), unless the budget overcommits (it planned them). The target falls to the
  requests the step ran, less those preempted to run them. Requests that wait while others are
  admitted are a burst's prefill spread over steps by the token budget: that holds the target. While
  the worker still holds more than the target, that surplus (already cut) is the cause, and the
  engine is not read again;
- **more** while the worker is full (it holds ``target`` jobs), nothing waits in vLLM and its KV
  cache has room. Until the engine first runs out of room, by half (``GROWTH``) after each step in
  which vLLM runs the jobs held before the last rise (a ramp: a burst is met within a few job
  fetches, 16, 24, 36, 54, 81, ..., and a worker that starts beside others takes its share of a
  burst, not all of it). After that, once per round (``target`` requests finished): by half when the
  budget knows the requests' sizes, else by as much as the round's peak KV-cache usage leaves room
  for below ``KV_HEADROOM`` (a request's KV grows until it finishes, so young requests' usage says
  little, and a round's peak says what ``target`` requests need);
- otherwise it holds. It starts at ``START`` and stays within ``floor`` (``MIN_CONCURRENCY``) and
  ``cap`` (``MAX_CONCURRENCY``, else vLLM's ``max_num_seqs``: more than one step batches would only
  queue).

Pure logic: the engine calls ``observe`` after each step (from a stat logger, on the engine's own
thread), the admission gate calls the budget's ``need``, ``fits``, ``admit`` and ``release`` on that
thread too, the runpod SDK's concurrency modifier reads ``target``, and ``on_raise`` wakes the job
loop when the target rises.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_OUTPUT_TOKENS", "GROWTH", "KV_HEADROOM", "PATIENCE", "START", "Concurrency", "KvBudget"]

GROWTH = 1.5  # the most the target rises at once
KV_HEADROOM = 0.9  # KV-cache usage (0-1) the target aims to stay under, when requests' sizes are not known
PATIENCE = 3  # engine steps in a row with requests waiting and none admitted: the engine is full
START = 16
# A request's output is planned from this quantile of the last OUTPUT_WINDOW finished requests, once
# MIN_OUTPUTS have finished (the warm-up's request says little about the jobs); before, at max_tokens,
# or at DEFAULT_OUTPUT_TOKENS when the client set none.
OUTPUT_QUANTILE, OUTPUT_WINDOW, MIN_OUTPUTS, DEFAULT_OUTPUT_TOKENS = 0.9, 200, 8, 512
# The share of a prompt found in vLLM's prefix cache (a system prompt the requests share) is planned
# at this low quantile of the recent requests': held once, not by every request.
CACHED_QUANTILE = 0.1
SIZE_WINDOW = 32  # the jobs not yet seen are planned at the mean size of this many recent requests
QUEUE_SHARE = 0.25  # jobs held waiting for room: at most this share of those that fit
RATE_SECONDS = 10.0  # requests finished per second, over this long


class KvBudget:
    """vLLM's KV cache in blocks, and the blocks planned for the requests in the engine."""

    def __init__(self, blocks: int, block_size: int, context: int | None = None, prefix_caching: bool = False,
                 overcommit: float = 0.0) -> None:
        """``blocks``: the cache's usable blocks (vLLM's ``num_gpu_blocks`` less its null block);
        ``context``: the model's context length (``max_model_len``); ``prefix_caching``: vLLM's, with
        which a request's sequences share its prompt's whole blocks; ``overcommit``: the share of the
        cache planned beyond it (``KV_OVERCOMMIT``)."""
        self.blocks, self.block_size, self.context = blocks, block_size, context
        self.prefix_caching, self.overcommit = prefix_caching, overcommit
        self.used = 0  # blocks planned for the requests admitted
        self.admitted = 0
        # When the client set max_tokens: the outputs, and each one's share of its max_tokens; when not,
        # the outputs.
        self._bounded_outputs: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        self._shares: deque[float] = deque(maxlen=OUTPUT_WINDOW)
        self._unbounded: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        self._cached: deque[float] = deque(maxlen=OUTPUT_WINDOW)  # prompt share found in the prefix cache
        self.prefix_blocks = 0  # the shared prefix of the last request planned: held once, beside all
        # Their sum is kept, not summed when read: ``target`` is read on the job loop's thread while the
        # engine's thread appends (iterating a deque that changes raises).
        self._sizes: deque[int] = deque(maxlen=SIZE_WINDOW)
        self._sizes_total = 0

    def planned_output(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """A request's output as planned (each figure the ``OUTPUT_QUANTILE`` of the recent requests).
        When the client bounded it: what such requests took, or ``max_tokens`` times the share of
        theirs they took if more, at most ``max_tokens``; until ``MIN_OUTPUTS`` have finished,
        ``max_tokens``: the most it can take, so that finding the limit costs no preemption. When it
        did not (vLLM's serving then sets what the context leaves): what such requests took, and
        until then ``DEFAULT_OUTPUT_TOKENS``."""
        if self._bounded(prompt_tokens, max_tokens):
            share, typical = _quantile(self._shares), _quantile(self._bounded_outputs)
            if share is None:
                return max_tokens
            return min(max_tokens, max(math.ceil(max_tokens * share), typical))
        typical = _quantile(self._unbounded)
        output = DEFAULT_OUTPUT_TOKENS if typical is None else typical
        return output if max_tokens is None else min(max_tokens, output)

    def _bounded(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        return max_tokens is not None and (self.context is None or prompt_tokens + max_tokens < self.context)

    def _split(self, prompt_tokens: int, max_tokens: int | None) -> tuple[int, int, int]:
        """A request's blocks as planned: (the shared prefix: the prompt's whole blocks that nearly
        every recent request found in vLLM's prefix cache, held once beside all; the rest of the
        prompt's whole blocks, which its sequences share with prefix caching; each sequence's own: the
        prompt's other tokens and up to the planned output, never past the context)."""
        output = self.planned_output(prompt_tokens, max_tokens)
        cached = _quantile(self._cached, CACHED_QUANTILE) or 0.0
        shared = int(prompt_tokens * cached) // self.block_size
        own = max(0, prompt_tokens // self.block_size - shared) if self.prefix_caching else 0
        tokens = prompt_tokens + output if self.context is None else min(prompt_tokens + output, self.context)
        return shared, own, max(1, math.ceil((tokens - (shared + own) * self.block_size) / self.block_size))

    def need(self, prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int:
        """The blocks a request will hold at most, as planned (``_split``): the prompt's whole blocks
        once with prefix caching, else with each of its ``n`` sequences, and each sequence's own. A
        request larger than the whole cache is not recorded: it says nothing of the jobs to hold (it
        enters alone, and vLLM runs its sequences as they fit)."""
        prefix, own, sequence = self._split(prompt_tokens, max_tokens)
        blocks = own + max(1, n) * sequence
        if blocks + prefix > self.blocks:
            return blocks + prefix
        self.prefix_blocks = prefix
        if len(self._sizes) == SIZE_WINDOW:
            self._sizes_total -= self._sizes[0]
        self._sizes.append(blocks)
        self._sizes_total += blocks
        return blocks

    def sequence_blocks(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The blocks one sequence of a request holds at most, as planned, the shared prefix included."""
        return sum(self._split(prompt_tokens, max_tokens))

    def never_fits(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        """Whether one sequence of the request is larger than the whole cache: vLLM could never run it."""
        return self.sequence_blocks(prompt_tokens, max_tokens) > self.blocks

    def fits(self, blocks: int) -> bool:
        """Whether a request of ``blocks`` enters now (alone, it always does: it fits the whole cache)."""
        return not self.admitted or self.used + blocks <= self._room

    @property
    def _room(self) -> int:
        """The blocks requests' own parts may take, as planned: the shared prefix holds the rest of
        the cache, and ``overcommit`` adds its share of what is left."""
        return int((self.blocks - self.prefix_blocks) * (1 + self.overcommit))

    def admit(self, blocks: int) -> None:
        self.used += blocks
        self.admitted += 1

    def release(self, blocks: int) -> None:
        self.used -= blocks
        self.admitted -= 1

    def finished(self, prompt_tokens: int, output_tokens: int, max_tokens: int | None,
                 cached_tokens: int = 0) -> None:
        """A request finished (not aborted) after ``output_tokens`` tokens; ``cached_tokens`` of its
        prompt were found in vLLM's prefix cache."""
        if prompt_tokens:
            self._cached.append(cached_tokens / prompt_tokens)
        if self._bounded(prompt_tokens, max_tokens):
            self._shares.append(output_tokens / max_tokens)
            self._bounded_outputs.append(output_tokens)
        else:
            self._unbounded.append(output_tokens)

    def requests_that_fit(self) -> int | None:
        """The requests in the engine, and as many more of the recent ones' mean size as the free
        blocks hold; None before any request was seen."""
        if not self._sizes:
            return None
        mean = self._sizes_total / len(self._sizes)
        return self.admitted + int(max(0, self._room - self.used) / mean)


def _quantile(values: deque, quantile: float = OUTPUT_QUANTILE) -> float | None:
    """That quantile of ``values``; None with fewer than ``MIN_OUTPUTS``."""
    if len(values) < MIN_OUTPUTS:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


class Concurrency:
    """The number of jobs to hold (``target``), from the engine's load, the jobs held and, once the
    KV cache is known (``set_kv_cache``), what it holds (``kv``)."""

    def __init__(self, floor: int, cap: int | None, held: Callable[[], int], start: int = START,
                 on_raise: Callable[[], None] | None = None, take_latency: float = 0.0,
                 kv_overcommit: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``held()``: the jobs the worker holds now; ``cap`` None: not known yet (vLLM resolves
        ``max_num_seqs`` as the engine starts), see ``set_cap``; ``on_raise()``: called after the
        target rose, on the engine's thread; ``take_latency``: seconds from asking RunPod for a job to
        holding it; ``kv_overcommit``: the KV budget's (``KvBudget``)."""
        self.floor, self._held, self.on_raise = floor, held, on_raise
        self.take_latency, self.kv_overcommit, self._clock = take_latency, kv_overcommit, clock
        self.cap = max(floor, cap) if cap is not None else None
        self.kv: KvBudget | None = None
        self._adaptive = self._bounded(start)
        self._reported = self._adaptive  # the target last logged
        self._ramping = True  # until the engine first runs out of room
        self._stalled = 0  # steps in a row with requests waiting and none starting
        self._before_rise = 0  # the target before the ramp's last rise
        self._finishes: deque[tuple[float, int]] = deque()  # (when, how many) over RATE_SECONDS
        self._finished_lately = 0  # their sum (read on the job loop's thread: see KvBudget._sizes)
        self._new_round()

    @property
    def fixed(self) -> bool:
        """Whether the bounds leave one number (``MIN_CONCURRENCY`` = ``MAX_CONCURRENCY``)."""
        return self.cap == self.floor

    @property
    def target(self) -> int:
        """The jobs to hold: the engine's load's number, at most the requests that fit and a few
        waiting for room (``queued``)."""
        fit = self.kv.requests_that_fit() if self.kv else None
        if fit is None:
            return self._adaptive
        return self._bounded(min(self._adaptive, fit + self.queued(fit)))

    def queued(self, fit: int) -> int:
        """Jobs to hold beyond the ``fit`` that vLLM runs: as many as finish in one job-take round
        trip, so that a freed slot is refilled at once; at most ``QUEUE_SHARE`` of ``fit``."""
        rate = self._finished_lately / RATE_SECONDS
        return min(math.ceil(rate * self.take_latency), math.ceil(QUEUE_SHARE * fit))

    def set_cap(self, cap: int) -> None:
        """The cap, once the engine has resolved it (``max_num_seqs``)."""
        self.cap = max(self.floor, cap)
        self._adaptive = self._bounded(self._adaptive)

    def set_kv_cache(self, blocks: int, block_size: int, context: int, prefix_caching: bool = False) -> None:
        """The KV cache's usable blocks and their size, once the engine has allocated it, the model's
        context length, and whether vLLM caches prefixes."""
        self.kv = KvBudget(blocks, block_size, context, prefix_caching, self.kv_overcommit)
        log.info("KV cache: %d blocks of %d tokens; requests enter vLLM as they fit whole%s", blocks, block_size,
                 f", and {self.kv_overcommit:.0%} more" if self.kv_overcommit else "")

    def observe(self, *, running: int, waiting: int, kv_usage: float, started: int, finished: int,
                preempted: int = 0, outputs: tuple[tuple[int, int, int | None, int], ...] = ()) -> None:
        """vLLM's scheduler after one engine step: requests running and waiting, KV-cache usage
        (0 to 1), requests that started (their first token), finished, and resumed after a
        preemption (vLLM reports a preemption then) in the step, and the requests that finished (not
        aborted) as (prompt tokens, output tokens, max_tokens, prompt tokens found cached)."""
        before = self.target
        self._count_finished(finished, outputs)
        held = self._held()
        # A resumed request is admitted too, as a started one is. An overcommitting budget planned
        # vLLM's preemptions and queue: neither says the plan was too large.
        planned = bool(self.kv and self.kv.overcommit)
        self._stalled = self._stalled + 1 if waiting and not (started or preempted or planned) else 0
        if (self._stalled >= PATIENCE or preempted and not planned) and held <= self.target:
            self._out_of_room(running + finished - preempted, preempted)
        elif held + finished >= self.target:  # full (else these steps say nothing about ``target`` jobs)
            self._peak = max(self._peak, kv_usage)
            self._finished += finished
            if not waiting and held >= self.target:
                self._grow(running, kv_usage)
        self._report(before, "the KV cache holds what the requests will need")

    def _count_finished(self, finished: int, outputs: tuple[tuple[int, int, int | None, int], ...]) -> None:
        now = self._clock()
        if finished:
            self._finishes.append((now, finished))
            self._finished_lately += finished
        while self._finishes and self._finishes[0][0] < now - RATE_SECONDS:
            self._finished_lately -= self._finishes.popleft()[1]
        if self.kv:
            for request in outputs:
                self.kv.finished(*request)

    def _out_of_room(self, ran: int, preempted: int) -> None:
        """The engine ran ``ran`` requests (without those it preempted to run them) and no more."""
        self._set(min(self.target, ran), "vLLM preempted a request" if preempted else "requests wait in vLLM")
        self._ramping = False
        self._new_round()

    def _grow(self, running: int, kv_usage: float) -> None:
        if self._ramping:
            # vLLM runs the jobs held before the last rise (those taken since may not have reached it)
            if kv_usage < KV_HEADROOM and running >= self._before_rise:
                self._before_rise = self._adaptive
                self._set(math.ceil(self._adaptive * GROWTH), "the engine has room")
        elif self._finished >= self.target:  # a round: as many requests finished as the worker holds
            peak = self._peak
            if self.kv:  # the budget keeps what enters vLLM to what fits
                room, why = GROWTH, "a round without preemption"
            else:
                room = min(GROWTH, KV_HEADROOM / peak) if peak else GROWTH
                why = f"its KV cache peaked at {peak:.0%} in a round"
            self._new_round()
            if room > 1:
                self._set(int(self.target * room), why)

    def _bounded(self, value: int) -> int:
        return max(self.floor, value if self.cap is None else min(self.cap, value))

    def _new_round(self) -> None:
        self._peak, self._finished = 0.0, 0

    def _set(self, value: int, why: str) -> None:
        before = self.target
        self._adaptive = self._bounded(value)
        if self.target != before:
            self._log(why)

    def _report(self, before: int, why: str) -> None:
        """After a step: logs a target that moved with what fits (by a request or two as sizes vary:
        only by a tenth at least), and wakes the job loop when the target rose."""
        now = self.target
        if abs(now - self._reported) >= max(2, self._reported // 10):
            self._log(why)
        if now > before and self.on_raise:
            self.on_raise()

    def _log(self, why: str) -> None:
        log.info("Concurrency %d -> %d: %s", self._reported, self.target, why)
        self._reported = self.target
