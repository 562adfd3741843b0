"""The start-up watchdog: ``VLLM_STARTUP_TIMEOUT`` (default 1200 s, worker-vllm's; 0: none) bounds the
time from the worker's start to ready, so that a start that hangs (a stalled download, a stuck
compile, a wedged GPU) is answered on the callers' jobs instead of holding them.

The start runs in a thread of its own (``Watchdog.run``) while the main thread keeps the clock. Past
the bound, vLLM's processes are killed and ``run`` raises a ``StartupError`` naming the setting, the
phase the start was in and the seconds spent, answered on the jobs as any start-up failure is.

Time in which the model's download makes progress is not counted: from one sign of progress (more
bytes in the cache than before) to the next, the clock stands still, so that a large first download
fits whatever its size, while a stalled one is counted from its last progress. The phases:

- ``preflight``: the worker's imports, RunPod's fitness checks (``startup/fitness``) and the model's
  checks on the hub (``model/preflight``);
- ``download``: the model's files, into the Hugging Face cache;
- ``load``: the configuration, vLLM's engine processes and the weights, until vLLM logs that the
  weights are loaded (its engine processes note it: ``vllm_adapter/engine_notes.engine_phase``);
- ``compile``: the rest of vLLM's engine start: torch.compile, memory profiling, the KV cache, CUDA
  graphs;
- ``warm-up``: the routes' app and the first request through the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from worker.startup.process_exit import kill_children
from worker.wire.errors import StartupError

log = logging.getLogger(__name__)

__all__ = ["PHASES", "Abandoned", "Watchdog"]

T = TypeVar("T")

TICK_SECONDS = 1.0  # the clock and the download's progress are read this often
# What each phase does, and what to look at when a start hangs in it.
PHASES = {
    "preflight": "checking the host (RUNPOD_GPU_TEST_TIMEOUT) and the model on the hub, which may be out of "
                 "reach (HF_ENDPOINT)",
    "download": "with no progress of the model's download: the hub (HF_ENDPOINT) may be out of reach, and a "
                "model baked into the image needs no download",
    "load": "reading the configuration and loading the weights: a slow disk or network volume, or a model "
            "too large for the GPUs",
    "compile": "compiling the model and capturing CUDA graphs after its weights loaded: ENFORCE_EAGER=true "
               "skips both, and a network volume keeps the compile cache for the next start",
    "warm-up": "the first request through the engine: the GPU may not be responding",
}


class Abandoned(Exception):
    """The watchdog gave up on this start: the thread running it must stop."""


class Watchdog:
    """The clock of one start: ``enter`` each phase (from the start's thread), ``run`` the start."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 started: float | None = None) -> None:
        """``timeout``: seconds (0: none); ``started``: the ``clock`` time the start began (now)."""
        self.timeout, self.clock = timeout, clock
        self.started = clock() if started is None else started
        self.free = 0.0  # seconds between signs of the download's progress: not counted
        self.phase, self.phase_started = "preflight", self.started
        # The engine's own phase while it loads: (phase, seconds since it began), or None.
        self.engine_phase: Callable[[], tuple[str, float] | None] = lambda: None
        self._progress: Callable[[], int] | None = None
        self._bytes, self._mark = 0, self.started
        self._shown = "preflight"  # the phase last logged
        self._abandoned = False
        self._lock = threading.Lock()

    def enter(self, phase: str, progress: Callable[[], int] | None = None) -> None:
        """The start is now in ``phase``; ``progress``: bytes downloaded so far, while downloading.
        Raises ``Abandoned`` once the watchdog has given up on the start."""
        with self._lock:
            if self._abandoned:
                raise Abandoned
            now = self.clock()
            self.phase, self.phase_started, self._progress = phase, now, progress
            self._bytes, self._mark = (progress() if progress else 0), now
        self._log_phase(now)

    def counted(self) -> float:
        """Seconds counted against the bound so far (the download's progress excluded)."""
        with self._lock:
            now = self.clock()
            if self._progress is not None and (have := self._progress()) > self._bytes:
                self.free += now - self._mark
                self._bytes, self._mark = have, now
            return now - self.started - self.free

    def current(self) -> tuple[str, float]:
        """The phase the start is in, and when it began (the engine's own once it loads; a download's
        last progress)."""
        with self._lock:
            phase, began = self.phase, self._mark if self._progress else self.phase_started
        if phase == "load" and (noted := self.engine_phase()) is not None:
            phase, began = noted[0], self.clock() - noted[1]
        return phase, began

    def _log_phase(self, now: float) -> None:
        phase, _ = self.current()
        if phase != self._shown:
            self._shown = phase
            log.info("Start-up phase: %s, %.1f s after the start", phase, now - self.started)

    def run(self, start: Callable[[], T]) -> T:
        """``start()`` in a thread of its own, its result or exception; past the bound, a StartupError
        (vLLM's processes killed, the thread left to stop at its next ``enter``)."""
        outcome: dict[str, object] = {}
        finished = threading.Event()

        def target() -> None:
            try:
                outcome["result"] = start()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread as it is
                outcome["error"] = exc
            finally:
                finished.set()

        threading.Thread(target=target, name="start-up", daemon=True).start()
        while not finished.wait(TICK_SECONDS):
            self._log_phase(self.clock())
            if self.timeout and self.counted() >= self.timeout:
                raise self._expired()
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["result"]  # type: ignore[return-value]

    def _expired(self) -> StartupError:
        with self._lock:
            self._abandoned = True
        kill_children()  # vLLM's engine processes: a hung start holds the GPU
        phase, began = self.current()
        now = self.clock()
        total = now - self.started
        uncounted = f" ({self.free:.0f} s of download progress not counted)" if self.free >= 1 else ""
        failure = StartupError(
            f"the worker did not become ready within VLLM_STARTUP_TIMEOUT={self.timeout:g} s: {total:.0f} s "
            f"after its start{uncounted}, the last {now - began:.0f} s in phase '{phase}', "
            f"{PHASES.get(phase, phase)}; raise VLLM_STARTUP_TIMEOUT if the start needs longer")
        log.error("Start-up timed out: %s", failure)
        return failure
