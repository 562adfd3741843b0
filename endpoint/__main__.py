"""A local RunPod serverless endpoint: ``python -m endpoint [--workers N] [--port 8000] [--handler PATH]``.

Starts the endpoint server on 127.0.0.1 and N worker processes (``python src/handler.py``, the
real ``runpod.serverless.start`` loop, pointed at the server with RunPod's ``RUNPOD_WEBHOOK_*``
variables), waits until every worker asks for work, prints the URLs, and on Ctrl-C or SIGTERM
stops the workers with SIGTERM (so the runpod SDK also stops its heartbeat process) and exits.
The workers inherit this environment: ``MODEL_NAME`` and every other worker setting.
With ``--image IMAGE`` each worker is that image's own command in a container instead (see
``container.py``), which gets only RunPod's variables and those named with ``--env``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from .app import EndpointConfig, create_app
from .container import ContainerLauncher
from .jobs import JobStore

HANDLER = Path(__file__).resolve().parents[1] / "src" / "handler.py"
READY_TIMEOUT_SECONDS = 600
STOP_GRACE_SECONDS = 30


def worker_env(base_url: str, worker_id: str, api_key: str | None) -> dict[str, str]:
    """The variables with which RunPod points a worker at its endpoint."""
    job = f"{base_url}/job-take/$ID?gpu=local"
    return {
        **os.environ,
        "RUNPOD_POD_ID": worker_id,
        "RUNPOD_WEBHOOK_GET_JOB": job,
        "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base_url}/job-done/$RUNPOD_POD_ID/$ID?gpu=local",
        "RUNPOD_WEBHOOK_POST_STREAM": f"{base_url}/job-stream/$RUNPOD_POD_ID/$ID?gpu=local",
        "RUNPOD_WEBHOOK_PING": f"{base_url}/ping/$RUNPOD_POD_ID?gpu=local",
        "RUNPOD_AI_API_KEY": api_key or "local",
        "RUNPOD_PING_INTERVAL": "5000",
        "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
        "RUNPOD_SKIP_GPU_CHECK": "true",
        "PYTHONUNBUFFERED": "1",  # worker logs appear as they happen
        # The SDK logs every job's input and output at DEBUG, its default.
        "RUNPOD_DEBUG_LEVEL": os.environ.get("RUNPOD_DEBUG_LEVEL", "INFO"),
    }


def snippet(base: str, api_key: str | None) -> str:
    # The key itself is never printed: logs must not carry secrets.
    key = 'os.environ["ENDPOINT_API_KEY"]' if api_key else '"local"'
    return (('import os\n' if api_key else '') + 'from openai import OpenAI\n'
            f'client = OpenAI(base_url="{base}/openai/v1", api_key={key})\n'
            f'model = client.models.list().data[0].id\n'
            f'answer = client.chat.completions.create(model=model, messages=[\n'
            f'    {{"role": "user", "content": "What is the capital of France?"}}])\n'
            f'print(answer.choices[0].message.content)')


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


class Supervisor:
    """Runs the workers and notices when one of them exits."""

    def __init__(self, count: int, base_url: str, api_key: str | None, store: JobStore,
                 command: Sequence[str] = (sys.executable, str(HANDLER)),
                 container: ContainerLauncher | None = None) -> None:
        self.store = store
        self.container = container
        # Each worker gets its own working directory, as each RunPod worker has its own container:
        # the runpod SDK keeps its in-progress job list in a file in the working directory.
        # Each in its own process group, which the endpoint empties once the worker has exited:
        # a worker that dies abruptly may leave the SDK's heartbeat process behind.
        self.workdirs = {f"local-worker-{i}": tempfile.mkdtemp(prefix=f"local-worker-{i}-")
                         for i in range(count)}
        self.procs = {}
        for worker, workdir in self.workdirs.items():
            env = worker_env(base_url, worker, api_key)
            argv = container(worker, env) if container else list(command)
            self.procs[worker] = subprocess.Popen(argv, env=env, cwd=workdir, start_new_session=True)

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not all(w in self.store.workers for w in self.procs):
            if failed := [w for w, p in self.procs.items() if p.poll() is not None]:
                raise RuntimeError(f"worker(s) exited during start-up: {', '.join(failed)}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers not ready in time")
            await asyncio.sleep(0.5)

    async def watch(self) -> None:
        while True:
            for worker, proc in self.procs.items():
                if proc.poll() is not None and not self.store.is_gone(worker):
                    print(f"endpoint: {worker} exited with status {proc.returncode}", flush=True)
                    await self.store.forget(worker)  # first: its jobs fail now, not after the clean-up
                    await asyncio.to_thread(self._reap, worker)
            await asyncio.sleep(1)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for worker, proc in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):  # then killed with its group
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            self._reap(worker)

    def _reap(self, worker: str) -> None:
        _reap(self.procs[worker], self.workdirs[worker])
        if self.container:
            self.container.remove(worker)


async def serve(args: argparse.Namespace) -> None:
    store = JobStore(execution_timeout=args.execution_timeout or None)
    config = EndpointConfig(endpoint_id=args.endpoint_id, api_key=args.api_key)
    runner = web.AppRunner(create_app(config, store), handler_cancellation=True)  # client gone: stop its job
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    base = f"http://{args.host}:{args.port}/v2/{args.endpoint_id}"
    container = ContainerLauncher(args.image, args.env, args.volume) if args.image else None
    supervisor = Supervisor(args.workers, base, args.api_key, store, (sys.executable, str(args.handler)),
                            container)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        ready = asyncio.create_task(supervisor.wait_ready())
        await asyncio.wait({ready, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            ready.result()
            print(f"endpoint: {args.workers} worker(s) ready in {time.monotonic() - started:.1f} s\n"
                  f"  RunPod API: {base}/run, /runsync, /stream/<id>, /status/<id>, /cancel/<id>, /health\n"
                  f"  OpenAI API: {base}/openai/v1\n\n{snippet(base, args.api_key)}\n", flush=True)
            watcher = asyncio.create_task(supervisor.watch())
            await stop.wait()
            watcher.cancel()
    finally:
        print("endpoint: stopping workers", flush=True)
        await asyncio.to_thread(supervisor.stop)
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m endpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="worker processes on one queue")
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
    parser.add_argument("--api-key", default=os.environ.get("ENDPOINT_API_KEY"),
                        help="require this bearer key from clients (default: $ENDPOINT_API_KEY)")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
