"""A local RunPod serverless endpoint: ``python -m endpoint [--load-balancer] [--workers N] [--port 8000]``.

Starts the endpoint server on 127.0.0.1, prints the URLs, starts N worker processes (``python
src/handler.py``, the real ``runpod.serverless.start`` loop, pointed at the server with RunPod's
``RUNPOD_WEBHOOK_*`` variables) and says so once every worker has asked for work. As RunPod does,
it replaces a worker that exits, whatever its status and whenever: the same worker id in a fresh
working directory, after a back-off (1 s, doubling up to 30 s; back to 1 s once a worker has stayed
up 60 s). Jobs queue meanwhile; a worker's failure never stops the endpoint. On Ctrl-C or SIGTERM
it stops the workers with SIGTERM (so the runpod SDK also stops its heartbeat process) and exits.
The workers inherit this environment: ``MODEL_NAME`` and every other worker setting. They run RunPod's
start-up fitness checks as on RunPod, their network check dialling a listener of the endpoint's on
127.0.0.1 (``NETWORK_CHECK_TARGET``; ``--refuse-network-check`` makes it refuse,
``--no-fitness-checks`` turns the checks off).
With ``--image IMAGE`` each worker is that image's own command in a container instead (see
``container.py``), which gets only RunPod's variables and those named with ``--env``.

With ``--load-balancer`` it is a load-balancing endpoint instead (``balancer.py``): no queue, each
worker serves HTTP on ports of its own (``ENDPOINT_TYPE=load_balancer``, ``PORT``, ``PORT_HEALTH``)
and the balancer on ``--port`` sends every request to a ready one. The same supervisor runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import uvloop
from aiohttp import web

from worker.env_text import env_value

from .app import EndpointConfig, create_app
from .balancer import BalancerConfig, Pool, create_balancer_app
from .container import ContainerLauncher
from .jobs import JobStore

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


# The runpod SDK's switches that turn its fitness checks off (--no-fitness-checks).
SKIP_CHECKS = {"RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true", "RUNPOD_SKIP_GPU_CHECK": "true"}


class NetworkCheckTarget:
    """What the workers' network fitness check dials, on loopback: RunPod's SDK dials a public DNS
    server, and nothing here may send traffic off this machine. A listener that accepts, or, with
    ``refuse``, a port bound without listening, which refuses every connection."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.socket = socket.create_server(("127.0.0.1", 0)) if not refuse else socket.socket()
        if refuse:
            self.socket.bind(("127.0.0.1", 0))
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        if not self.refuse:  # accept, then hang up: a connection is all the check asks for
            self.server = await asyncio.start_server(lambda _, writer: writer.close(), sock=self.socket)

    def env(self) -> dict[str, str]:
        return {"NETWORK_CHECK_TARGET": f"127.0.0.1:{self.socket.getsockname()[1]}"}

    def close(self) -> None:
        if self.server:
            self.server.close()
        self.socket.close()


def queue_env(base_url: str) -> dict[str, str]:
    """How a queue-based endpoint's worker gets its jobs: RunPod's job protocol at ``base_url``."""
    return {
        "RUNPOD_WEBHOOK_GET_JOB": f"{base_url}/job-take/$ID?gpu=local",
        "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base_url}/job-done/$RUNPOD_POD_ID/$ID?gpu=local",
        "RUNPOD_WEBHOOK_POST_STREAM": f"{base_url}/job-stream/$RUNPOD_POD_ID/$ID?gpu=local",
        "RUNPOD_WEBHOOK_PING": f"{base_url}/ping/$RUNPOD_POD_ID?gpu=local",
        "RUNPOD_PING_INTERVAL": "5000",
    }


def balancer_env(port: int, health_port: int) -> dict[str, str]:
    """How a load-balancing endpoint's worker gets its requests: on its own HTTP server."""
    return {"ENDPOINT_TYPE": "load_balancer", "PORT": str(port), "PORT_HEALTH": str(health_port)}


def worker_env(base_url: str, worker_id: str, api_key: str | None,
               ports: tuple[int, int] | None = None,
               checks: Mapping[str, str] = SKIP_CHECKS) -> dict[str, str]:
    """The variables with which RunPod starts a worker: those of its endpoint's queue at ``base_url``
    or, for a load-balancing worker, the ``ports`` (``PORT``, ``PORT_HEALTH``) it serves on, and
    ``checks``: how it runs RunPod's fitness checks (``NetworkCheckTarget.env``, or SKIP_CHECKS).
    The job protocol's variables come from here only: a load-balancing worker has none."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_WEBHOOK_")}
    return {
        **inherited,
        "RUNPOD_POD_ID": worker_id,
        **(queue_env(base_url) if ports is None else balancer_env(*ports)),
        "RUNPOD_AI_API_KEY": api_key or "local",
        **checks,
        "PYTHONUNBUFFERED": "1",  # worker logs appear as they happen
        # The SDK logs every job's input and output at DEBUG, its default.
        "RUNPOD_DEBUG_LEVEL": env_value("RUNPOD_DEBUG_LEVEL", os.environ) or "INFO",
    }


def snippet(openai_base: str, api_key: str | None) -> str:
    # The key itself is never printed: logs must not carry secrets.
    key = 'os.environ["ENDPOINT_API_KEY"]' if api_key else '"local"'
    return (('import os\n' if api_key else '') + 'from openai import OpenAI\n'
            f'client = OpenAI(base_url="{openai_base}", api_key={key})\n'
            f'model = client.models.list().data[0].id\n'
            f'answer = client.chat.completions.create(model=model, messages=[\n'
            f'    {{"role": "user", "content": "What is the capital of France?"}}])\n'
            f'print(answer.choices[0].message.content)')


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


async def announce_ready(supervisor: Supervisor, started: float) -> None:
    await supervisor.wait_ready()
    print(f"endpoint: {len(supervisor.workers)} worker(s) ready in {time.monotonic() - started:.1f} s",
          flush=True)


def queue_endpoint(args: argparse.Namespace, container: ContainerLauncher | None,
                   checks: Mapping[str, str]) -> tuple[web.Application, Supervisor, str]:
    """The queue-based endpoint's app, its workers and what it prints first."""
    store = JobStore(execution_timeout=args.execution_timeout or None)
    config = EndpointConfig(endpoint_id=args.endpoint_id, api_key=args.api_key,
                            job_take_delay=args.job_take_delay)
    base = f"http://{args.host}:{args.port}/v2/{args.endpoint_id}"
    supervisor = Supervisor(args.workers, base, args.api_key, store, (sys.executable, str(args.handler)),
                            container, checks=checks)
    banner = (f"endpoint: starting {args.workers} worker(s)\n"
              f"  RunPod API: {base}/run, /runsync, /stream/<id>, /status/<id>, /cancel/<id>, /health\n"
              f"  OpenAI API: {base}/openai/v1\n\n{snippet(base + '/openai/v1', args.api_key)}\n")
    return create_app(config, store), supervisor, banner


def balancer_endpoint(args: argparse.Namespace, container: ContainerLauncher | None,
                      checks: Mapping[str, str]) -> tuple[web.Application, Supervisor, str]:
    """The load-balancing endpoint's app, its workers and what it prints first."""
    pool = Pool.on_free_ports(worker_ids(args.workers), args.separate_health_port)
    config = BalancerConfig(api_key=args.api_key, worker_wait_seconds=args.worker_wait,
                            request_timeout_seconds=args.request_timeout)
    base = f"http://{args.host}:{args.port}"
    supervisor = Supervisor(args.workers, base, args.api_key, pool, (sys.executable, str(args.handler)),
                            container, pool.ports(), checks)
    banner = (f"endpoint: starting {args.workers} worker(s) (load balancer)\n"
              f"  HTTP: {base}/<path> (any route of the worker: /v1/chat/completions, /v1/messages, "
              f"/runsync, /ping)\n\n{snippet(base + '/v1', args.api_key)}\n")
    return create_balancer_app(pool, config), supervisor, banner


async def serve(args: argparse.Namespace) -> None:
    # A container gets RunPod's variables, those named with --env and, for a load-balancing worker,
    # the names of balancer_env.
    passed = [*args.env, *balancer_env(0, 0).keys()] if args.load_balancer else args.env
    container = ContainerLauncher(args.image, passed, args.volume) if args.image else None
    endpoint = balancer_endpoint if args.load_balancer else queue_endpoint
    target = None if args.no_fitness_checks else NetworkCheckTarget(refuse=args.refuse_network_check)
    if target:
        await target.start()
    app, supervisor, banner = endpoint(args, container, target.env() if target else SKIP_CHECKS)
    runner = web.AppRunner(app, handler_cancellation=True)  # client gone: stop its job or request
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(banner, flush=True)
    stopped = asyncio.create_task(stop.wait())
    workers = asyncio.create_task(supervisor.run())
    ready = asyncio.create_task(announce_ready(supervisor, time.monotonic()))
    try:
        await asyncio.wait({stopped, workers}, return_when=asyncio.FIRST_COMPLETED)
        if workers.done():
            workers.result()  # run() ends only by raising: a fault of the endpoint, not of a worker
    finally:
        for task in (stopped, workers, ready):
            task.cancel()
        await asyncio.wait({stopped, workers, ready})  # no restart left pending or half done
        print("endpoint: stopping workers", flush=True)
        await asyncio.to_thread(supervisor.stop)
        await runner.cleanup()
        if target:
            target.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m endpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes (on one queue, or behind the balancer)")
    parser.add_argument("--endpoint-id", default="local")
    parser.add_argument("--handler", default=HANDLER, type=lambda path: Path(path).resolve(),
                        help="the worker script each worker process runs (default: the vLLM worker)")
    parser.add_argument("--image", help="run each worker as this container image's own command "
                        "(buildah, chroot isolation) instead of --handler in this environment")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="with --image: a variable the containers get (NAME alone: its value here)")
    parser.add_argument("--volume", action="append", default=[], metavar="HOST:CONTAINER",
                        help="with --image: a folder mounted into each container (RunPod's volume)")
    parser.add_argument("--execution-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="stop a job in progress longer than this, as RunPod's endpoint setting "
                             "(default: 600, RunPod's default; 0: no limit)")
    parser.add_argument("--job-take-delay", type=float, default=0.0, metavar="SECONDS",
                        help="answer each job-take request that carries jobs this long after taking them, "
                             "as RunPod's queue is a network round trip away (default: 0)")
    parser.add_argument("--load-balancer", action="store_true",
                        help="a load-balancing endpoint: no queue, each request goes to a ready worker's "
                             "own HTTP server (ENDPOINT_TYPE=load_balancer)")
    parser.add_argument("--separate-health-port", action="store_true",
                        help="with --load-balancer: each worker answers /ping on a port of its own "
                             "(PORT_HEALTH; default: on PORT)")
    parser.add_argument("--worker-wait", type=float, default=120.0, metavar="SECONDS",
                        help="with --load-balancer: answer 400 when no worker is ready this long after "
                             "the request came (default: 120, RunPod's)")
    parser.add_argument("--request-timeout", type=float, default=330.0, metavar="SECONDS",
                        help="with --load-balancer: a request longer than this gets a 524, or its answer "
                             "is cut off (default: 330, RunPod's)")
    parser.add_argument("--no-fitness-checks", action="store_true",
                        help="workers skip RunPod's start-up fitness checks (default: they run them, their "
                             "network check dialling a listener of the endpoint's on 127.0.0.1)")
    parser.add_argument("--refuse-network-check", action="store_true",
                        help="the endpoint's network-check listener refuses connections: the workers' "
                             "network fitness check fails, as on a host without network")
    parser.add_argument("--api-key", default=env_value("ENDPOINT_API_KEY", os.environ),
                        help="require this bearer key from clients (default: $ENDPOINT_API_KEY)")
    # uvloop, as vllm serve and RunPod's own proxies: the balancer relays every streamed chunk, and
    # asyncio's pure-Python loop spent that CPU where the workers' engines need it (bench item 22).
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
