"""The HTTP servers the benchmarks compare, as processes this run starts and stops.

- ``vllm serve`` (vLLM's own launcher) with flags equal to the worker's resolved configuration;
- the local RunPod endpoint (``python -m endpoint``) with one real worker, ``src/handler.py`` under
  the runpod SDK's loop. Its start-up is timed from the worker process's start (the kernel's record)
  to its ``Worker ready`` log line (which splits the phases) and to its first call for work. Items 7-9
  (``bench/job_start.py``) run it with another worker script and under ``bench/trace_endpoint.py``.
- the local endpoint as a load-balancing endpoint (``python -m endpoint --load-balancer``), and a
  load-balancing worker alone (``src/handler.py`` with ``ENDPOINT_TYPE=load_balancer``, serving HTTP on
  its ``PORT``), for item 22 (``bench/load_balancer.py``).

Each server runs in its own session, so stopping it ends every process it started (vLLM's engine
processes, the SDK's heartbeat) and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx

from bench.common import REPO
from dev_env import free_port

START_TIMEOUT = 600
POLL_SECONDS = 0.05
# The worker's start-up line: "... INFO handler: Worker ready: ...; start-up imports=1.23s config=..."
# A worker that could not start, in the endpoint's log: its own line, or the endpoint's on its exit.
FAILED_START_LINES = ("Worker could not start", " exited with status ")
READY_LINE = re.compile(r"^(\S+ \S+) INFO handler: Worker ready: .*start-up (.*)$", re.MULTILINE)


class Server:
    """A process started in a new session, its output in ``log_path``; ready once ``_ready()`` holds."""

    what = "server"
    failed_lines: tuple[str, ...] = ()  # a line in its log that says it cannot start

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.env, self.log_path = env, log_path
        argv, launch_env = self._on_port(argv, env)
        # The worker's own start methods for vLLM's processes, as deployed: cpu-dev.env's "fork" is
        # the suite's (vllm serve spawns on the CPU whatever it is given).
        launch_env = {name: value for name, value in {**os.environ, **launch_env}.items()
                      if name != "VLLM_WORKER_MULTIPROC_METHOD"}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=launch_env,
                                     stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _on_port(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The command and environment that serve on ``self.port``: a ``--port`` flag."""
        return [*argv, "--port", str(self.port)], env

    def _ready(self) -> bool:
        raise NotImplementedError

    def _failed(self) -> bool:
        """Whether it cannot start any more: it has exited, or its log says it cannot start."""
        return self.proc.poll() is not None or any(text in self.log() for text in self.failed_lines)

    def _answers(self, path: str) -> bool:
        """Whether ``GET path`` on its port answers 200."""
        response = self.get(f"http://127.0.0.1:{self.port}{path}")
        return response is not None and response.status_code == 200

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not self._ready():
            if self._failed() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.what} did not start; its log ends:\n{self.log()[-3000:]}")
            time.sleep(POLL_SECONDS)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, url: str) -> httpx.Response | None:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url, timeout=2)
        return None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM (a clean vLLM shutdown), then SIGKILL for whatever of the session is left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=90)
        deadline = time.monotonic() + 10
        while _session_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@contextlib.contextmanager
def started(starts: dict[str, Callable[[], Server]]) -> Iterator[dict[str, Server]]:
    """The servers ``starts`` make, by name, started one after the other (each start has both cores)
    in the order given, all stopped on leaving."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(start()) for name, start in starts.items()}


def _session_alive(sid: int) -> bool:
    """Any process (not a zombie) left in session ``sid``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) == sid:  # state, ..., session id
                return True
    return False


class VllmServe(Server):
    what = "vllm serve"

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        from worker.config.engine_args import resolve_args  # vLLM's parser: imported only when a bench needs it

        super().__init__([sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
                          *resolve_args(env).serve_argv(), "--host", "127.0.0.1"], env, log_path)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _ready(self) -> bool:
        if not self._answers("/health"):
            return False
        self.started = _process_start(self.proc.pid)
        self.start_up = time.time() - self.started  # process start → /health
        return True


@dataclass(frozen=True)
class StartUp:
    """Seconds from the worker process's start: its phases, then the runpod SDK's own start."""

    total: float  # process start → first call for work
    python: float  # interpreter and handler.py's module-level imports, before main()
    phases: dict[str, float]  # the worker's own split: imports, checks, model, config, cache, engine, serving
    sdk: float  # "Worker ready" → first call for work (runpod.serverless.start)


class Endpoint(Server):
    what = "the local endpoint"
    # A worker that could not start: the endpoint restarts it (or it answers jobs with the failure,
    # and calls for work as if ready).
    failed_lines = FAILED_START_LINES

    def __init__(self, env: dict[str, str], log_path: Path, handler: Path | None = None,
                 traced: bool = False, workers: int = 1, job_take_delay: float = 0.0) -> None:
        """``handler``: another worker script than src/handler.py (whose start-up is then not measured);
        ``traced``: run the endpoint under ``bench/trace_endpoint.py``, which stamps its job path;
        ``job_take_delay``: seconds the endpoint waits before it hands a worker the jobs it took."""
        self.handler, self.workers = handler, workers
        launcher = [str(REPO / "bench" / "trace_endpoint.py")] if traced else ["-m", "endpoint"]
        super().__init__([sys.executable, *launcher, "--workers", str(workers),
                          "--job-take-delay", str(job_take_delay),
                          *(["--handler", str(handler)] if handler else [])], env, log_path)
        self.base_url = f"http://127.0.0.1:{self.port}/v2/local/openai/v1"

    def _ready(self) -> bool:
        """Ready when every worker has called for work; src/handler.py's start-up is measured then."""
        response = self.get(f"http://127.0.0.1:{self.port}/v2/local/health")
        if response is None or response.json()["workers"]["ready"] < self.workers:
            return False
        if self.handler is None:
            self.start_up = self._start_up(taking_jobs=time.time())
        return True

    def _start_up(self, taking_jobs: float) -> StartUp:
        match = READY_LINE.search(self.log())
        if match is None:
            raise RuntimeError("no 'Worker ready' line with start-up phases in the worker's log")
        ready = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        phases = {name: float(seconds) for name, seconds in re.findall(r"(\w+)=([\d.]+)s", match[2])}
        self.started = started = _process_start(_worker_pid(self.proc.pid))
        return StartUp(total=taking_jobs - started, python=ready - started - sum(phases.values()),
                       phases=phases, sdk=taking_jobs - ready)


class Balancer(Server):
    """The local endpoint as a load-balancing endpoint: ``workers`` HTTP workers behind its balancer,
    which relays any path (``/v1/chat/completions`` as ``vllm serve`` has it)."""

    what = "the local load balancer"
    failed_lines = FAILED_START_LINES

    def __init__(self, env: dict[str, str], log_path: Path, workers: int = 1) -> None:
        super().__init__([sys.executable, "-m", "endpoint", "--load-balancer", "--workers", str(workers)],
                         env, log_path)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _ready(self) -> bool:
        """Ready once its /ping answers 200: a worker's /ping answered 200 (it pings each every 0.5 s)."""
        return self._answers("/ping")


class BalancerWorker(Server):
    """A load-balancing worker alone (``src/handler.py``, ``ENDPOINT_TYPE=load_balancer``): vLLM's
    routes on its ``PORT``, without the balancer in front."""

    what = "a load-balancing worker"
    failed_lines = FAILED_START_LINES[:1]

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        super().__init__([sys.executable, str(REPO / "src" / "handler.py")], env, log_path)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _on_port(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        return argv, {**env, "ENDPOINT_TYPE": "load_balancer", "PORT": str(self.port)}

    def _ready(self) -> bool:
        """Ready once its /ping answers 200 (204 while it starts)."""
        return self._answers("/ping")


def _worker_pid(endpoint_pid: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, rest = stat.read_text().split(" ", 1)
            if int(rest.rsplit(")", 1)[1].split()[1]) == endpoint_pid and "handler.py" in \
                    (stat.parent / "cmdline").read_text():
                return int(pid)
    raise RuntimeError("the endpoint's worker process is gone")


def _process_start(pid: int) -> float:
    """Wall-clock start of ``pid`` (10 ms resolution): the kernel records it in clock ticks since boot.

    /proc/stat's boot time is whole seconds, so the boot instant is taken from CLOCK_BOOTTIME instead.
    """
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
