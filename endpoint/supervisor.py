"""The workers of the local endpoint: ``Supervisor`` runs N worker processes and, as RunPod does,
replaces one that exits, whatever its status and whenever: the same worker id in a fresh working
directory and process group, after a back-off (1 s, doubling up to 30 s; back to 1 s once a worker
has stayed up 60 s). Its ``store`` (the job store, or the balancer's pool) is told of each start and
exit and says when a worker has called in. ``stop`` ends them with SIGTERM (so the runpod SDK also
stops its heartbeat process), then kills what is left and removes their folders and containers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .container import ContainerLauncher
from .jobs import JobStore
from .pool import Pool
from .worker_env import SKIP_CHECKS, worker_env

__all__ = ["HANDLER", "Backoff", "Supervisor", "worker_ids"]

HANDLER = Path(__file__).resolve().parents[1] / "src" / "handler.py"
STOP_GRACE_SECONDS = 30
POLL_SECONDS = 0.2  # how often the supervisor looks for workers that exited or called in
# A worker that exits starts again after 1 s, 2 s, 4 s, ... (each exit in a row doubles the wait) up
# to 30 s; one that has stayed up 60 s starts the series again.
BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
BACKOFF_RESET_SECONDS = 60.0


def worker_ids(count: int) -> list[str]:
    return [f"local-worker-{i}" for i in range(count)]


class Backoff:
    """The waits before one worker's restarts."""

    def __init__(self) -> None:
        self.exits = 0  # in a row, each before the worker had stayed up long enough

    def after_exit(self, up: float) -> float:
        """Seconds to wait after an exit ``up`` seconds after the start."""
        self.exits = 1 if up >= BACKOFF_RESET_SECONDS else self.exits + 1
        return min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** min(self.exits - 1, 30))


def _reap(proc: subprocess.Popen, workdir: str) -> None:
    """Kill whatever is left in an exited worker's process group, then remove its working directory
    (again while a dying process still writes into it: once it is gone, nothing can write there)."""
    with contextlib.suppress(ProcessLookupError):  # nothing left
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while True:
        shutil.rmtree(workdir, ignore_errors=True)
        if not os.path.exists(workdir) or time.monotonic() > deadline:
            break
        time.sleep(0.05)


@dataclass
class Life:
    """One process of a worker, in a working directory and a process group of its own."""
    proc: subprocess.Popen
    workdir: str
    reaped: bool = False


class Supervisor:
    """Runs the workers and replaces each one that exits.

    ``store`` is told when a worker's process starts (``revive``) and exits (``forget``), and says
    whether it has called in: the job store, whose workers take jobs from ``base_url``, or, for
    load-balancing workers (``ports``: each one's ``PORT`` and ``PORT_HEALTH``), the balancer's
    pool, for which a worker calls in when its ``/ping`` first answers 200.
    """

    def __init__(self, count: int, base_url: str, api_key: str | None, store: JobStore | Pool,
                 command: Sequence[str] = (sys.executable, str(HANDLER)),
                 container: ContainerLauncher | None = None,
                 ports: Mapping[str, tuple[int, int]] | None = None,
                 checks: Mapping[str, str] = SKIP_CHECKS) -> None:
        self.base_url, self.api_key, self.store, self.ports = base_url, api_key, store, ports
        self.checks = dict(checks)
        self.command, self.container = tuple(command), container
        self.workers = worker_ids(count)
        self.lives: dict[str, Life] = {}  # worker → its latest process
        # Processes start in threads (buildah takes a while); stop() takes the lock so that none
        # starts after it has looked, and reaps each process once.
        self._lock = threading.Lock()
        self._stopping = False

    async def run(self) -> None:
        """Start every worker, then restart each one whenever it exits, until cancelled (which
        cancels a pending restart; ``stop`` then ends the processes)."""
        async with asyncio.TaskGroup() as group:
            for worker in self.workers:
                group.create_task(self._keep(worker))

    async def _keep(self, worker: str) -> None:
        backoff, restarts = Backoff(), 0
        while (ended := await self._life(worker)) is not None:
            status, how, up = ended
            restarts, delay = restarts + 1, backoff.after_exit(up)
            restart_at = time.monotonic() + delay
            print(f"endpoint: {worker} {how} after {up:.1f} s; restarting in {delay:g} s "
                  f"(restart {restarts})", flush=True)
            await self.store.forget(worker, status, delay)  # first: its jobs fail now, not after the clean-up
            await asyncio.to_thread(self._reap, worker)
            await asyncio.sleep(max(0.0, restart_at - time.monotonic()))

    async def _life(self, worker: str) -> tuple[int | None, str, float] | None:
        """Run one process of ``worker`` until it exits: its status, how it ended and for how long
        it ran (None: the endpoint is stopping)."""
        self.store.revive(worker)
        started = time.monotonic()
        try:
            life = await asyncio.to_thread(self._launch, worker)
        except (OSError, subprocess.SubprocessError) as exc:  # e.g. buildah could not make its container
            return None, f"could not start ({exc})", time.monotonic() - started
        if life is None:
            return None
        while life.proc.poll() is None:
            await asyncio.sleep(POLL_SECONDS)
        return life.proc.returncode, f"exited with status {life.proc.returncode}", time.monotonic() - started

    def _launch(self, worker: str) -> Life | None:
        """Start a process for ``worker`` (None: the endpoint is stopping)."""
        env = worker_env(self.base_url, worker, self.api_key, self.ports[worker] if self.ports else None,
                         self.checks)
        with self._lock:
            if self._stopping:
                return None
            # Each process gets its own working directory, as each RunPod worker has its own
            # container: the runpod SDK keeps its in-progress job list in a file in the working
            # directory. Each in its own process group, which the endpoint empties once the worker
            # has exited: a worker that dies abruptly may leave the SDK's heartbeat process behind.
            workdir = tempfile.mkdtemp(prefix=f"{worker}-")
            try:
                argv = self.container(worker, env) if self.container else list(self.command)
                proc = subprocess.Popen(argv, env=env, cwd=workdir, start_new_session=True)
            except BaseException:
                shutil.rmtree(workdir, ignore_errors=True)
                if self.container:
                    self.container.remove(worker)
                raise
            self.lives[worker] = life = Life(proc, workdir)
        return life

    async def wait_ready(self) -> None:
        """Until every worker has called in once (restarts on the way included)."""
        waiting = set(self.workers)
        while waiting := {w for w in waiting if not self.store.called_in(w)}:
            await asyncio.sleep(POLL_SECONDS)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            lives = dict(self.lives)
        for life in lives.values():
            if life.proc.poll() is None:
                life.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for worker, life in lives.items():
            with contextlib.suppress(subprocess.TimeoutExpired):  # then killed with its group
                life.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            self._reap(worker)

    def _reap(self, worker: str) -> None:
        """Clean up after the worker's latest process, once (a restart under way and stop() may both
        get here): its process group, working directory and container."""
        with self._lock:
            life = self.lives.get(worker)
            if life is None or life.reaped:
                return
            life.reaped = True
        _reap(life.proc, life.workdir)
        if self.container:
            self.container.remove(worker)

