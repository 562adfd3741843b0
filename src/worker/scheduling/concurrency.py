"""How many jobs the worker holds: as many as its engine serves at once, no more, no fewer.

A fixed number is wrong either way. Too low, and the engine idles while jobs queue at RunPod. Too
high, and the worker takes jobs that vLLM can only queue (its KV cache is full): on an endpoint
with several workers those jobs would have started at once elsewhere, and RunPod's autoscaler sees
an empty queue. So the target follows what vLLM's scheduler reports after each engine step:

- **fewer** when the engine is out of room: requests have waited ``PATIENCE`` steps in a row while
  none was admitted, or vLLM reports a preemption (when the preempted request resumes). The target
  falls to the requests the step ran, less those preempted to run them. Requests that wait while
  others are admitted are a burst's prefill spread over steps by the token budget: that holds the
  target. While the worker still holds more than the target, that surplus (already cut) is the
  cause, and the engine is not read again;
- **more** while the worker is full (it holds ``target`` jobs), nothing waits in vLLM and its KV
  cache has room. Until the engine first runs out of room, by half (``GROWTH``) after each step in
  which vLLM runs the jobs held before the last rise (a ramp: a burst is met within a few job
  fetches: 16, 24, 36, 54, 81, ...). After that, once per round (``target`` requests finished), by
  as much as the round's peak KV-cache usage leaves room for below ``KV_HEADROOM``: a request's KV
  grows until it finishes, so young requests' usage says little, and a round's peak says what
  ``target`` requests need. The target settles where the cache holds what the engine runs, without
  preempting in a loop, and still rises when requests get shorter;
- otherwise it holds. It starts at ``START`` (a burst starts at once on one worker, and another
  worker of the endpoint still gets its share) and stays within ``floor`` (``MIN_CONCURRENCY``)
  and ``cap`` (``MAX_CONCURRENCY``, else vLLM's ``max_num_seqs``: more than one step batches would
  only queue).

Pure logic: the engine calls ``observe`` after each step (from a stat logger, on the engine's own
thread), the runpod SDK's concurrency modifier reads ``target``, and ``on_raise`` wakes the job
loop when the target rises.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["GROWTH", "KV_HEADROOM", "PATIENCE", "START", "Concurrency"]

GROWTH = 1.5  # the most the target rises at once
KV_HEADROOM = 0.9  # KV-cache usage (0-1) the target aims to stay under
PATIENCE = 3  # engine steps in a row with requests waiting and none admitted: the engine is full
START = 16


class Concurrency:
    """The number of jobs to hold (``target``), from the engine's load and the jobs held."""

    def __init__(self, floor: int, cap: int | None, held: Callable[[], int], start: int = START,
                 on_raise: Callable[[], None] | None = None) -> None:
        """``held()``: the jobs the worker holds now; ``cap`` None: not known yet (vLLM resolves
        ``max_num_seqs`` as the engine starts), see ``set_cap``; ``on_raise()``: called after the
        target rose, on the engine's thread."""
        self.floor, self._held, self.on_raise = floor, held, on_raise
        self.cap = max(floor, cap) if cap is not None else None
        self.target = self._bounded(start)
        self._ramping = True  # until the engine first runs out of room
        self._stalled = 0  # steps in a row with requests waiting and none starting
        self._before_rise = 0  # the target before the ramp's last rise
        self._new_round()

    @property
    def fixed(self) -> bool:
        """Whether the bounds leave one number (``MIN_CONCURRENCY`` = ``MAX_CONCURRENCY``)."""
        return self.cap == self.floor

    def set_cap(self, cap: int) -> None:
        """The cap, once the engine has resolved it (``max_num_seqs``)."""
        self.cap = max(self.floor, cap)
        self.target = self._bounded(self.target)

    def observe(self, *, running: int, waiting: int, kv_usage: float, started: int, finished: int,
                preempted: int = 0) -> None:
        """vLLM's scheduler after one engine step: requests running and waiting, KV-cache usage
        (0 to 1), requests that started (their first token), finished, and resumed after a
        preemption (vLLM reports a preemption then) in the step."""
        held = self._held()
        # A resumed request is admitted too, as a started one is.
        self._stalled = self._stalled + 1 if waiting and not (started or preempted) else 0
        if (self._stalled >= PATIENCE or preempted) and held <= self.target:
            self._out_of_room(running + finished - preempted, preempted)
        elif held + finished >= self.target:  # full (else these steps say nothing about ``target`` jobs)
            self._peak = max(self._peak, kv_usage)
            self._finished += finished
            if not waiting and held >= self.target:
                self._grow(running, kv_usage)

    def _out_of_room(self, ran: int, preempted: int) -> None:
        """The engine ran ``ran`` requests (without those it preempted to run them) and no more."""
        self._set(min(self.target, ran), "vLLM preempted a request" if preempted else "requests wait in vLLM")
        self._ramping = False
        self._new_round()

    def _grow(self, running: int, kv_usage: float) -> None:
        if self._ramping:
            # vLLM runs the jobs held before the last rise (those taken since may not have reached it)
            if kv_usage < KV_HEADROOM and running >= self._before_rise:
                self._before_rise = self.target
                self._set(math.ceil(self.target * GROWTH), "the engine has room")
        elif self._finished >= self.target:  # a round: as many requests finished as the worker holds
            room = min(GROWTH, KV_HEADROOM / self._peak) if self._peak else GROWTH
            peak = self._peak
            self._new_round()
            if room > 1:
                self._set(int(self.target * room), f"its KV cache peaked at {peak:.0%} in a round")

    def _bounded(self, value: int) -> int:
        return max(self.floor, value if self.cap is None else min(self.cap, value))

    def _new_round(self) -> None:
        self._peak, self._finished = 0.0, 0

    def _set(self, value: int, why: str) -> None:
        value = self._bounded(value)
        if value == self.target:
            return
        log.info("Concurrency %d -> %d: %s", self.target, value, why)
        raised, self.target = value > self.target, value
        if raised and self.on_raise:
            self.on_raise()
