"""A local RunPod serverless endpoint: ``python -m endpoint [--load-balancer] [--workers N] [--port 8000]``.

Starts the endpoint server on 127.0.0.1, prints the URLs, starts N worker processes (``python
src/handler.py``, the real ``runpod.serverless.start`` loop, pointed at the server with RunPod's
``RUNPOD_WEBHOOK_*`` variables) and says so once every worker has asked for work. As RunPod does,
it replaces a worker that exits, whatever its status and whenever (``supervisor.py``). Jobs queue
meanwhile; a worker's failure never stops the endpoint. On Ctrl-C or SIGTERM it stops the workers
and exits. The workers inherit this environment: ``MODEL_NAME`` and every other worker setting
(``worker_env.py``). They run RunPod's start-up fitness checks as on RunPod, their network check
dialling a listener of the endpoint's on 127.0.0.1 (``NETWORK_CHECK_TARGET``;
``--refuse-network-check`` makes it refuse, ``--no-fitness-checks`` turns the checks off).
With ``--image IMAGE`` each worker is that image's own command in a container instead (see
``container.py``), which gets only RunPod's variables and those named with ``--env``.

With ``--load-balancer`` it is a load-balancing endpoint instead (``balancer.py``): no queue, each
worker serves HTTP on ports of its own (``ENDPOINT_TYPE=load_balancer``, ``PORT``, ``PORT_HEALTH``)
and the balancer on ``--port`` sends every request to a ready one. The same supervisor runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import uvloop
from aiohttp import web

from worker.env_text import env_value

from .app import EndpointConfig, create_app
from .balancer import BalancerConfig, create_balancer_app
from .container import ContainerLauncher
from .jobs import JobStore
from .pool import Pool
from .supervisor import HANDLER, Supervisor, worker_ids
from .worker_env import SKIP_CHECKS, NetworkCheckTarget, balancer_env


def snippet(openai_base: str, api_key: str | None) -> str:
    # The key itself is never printed: logs must not carry secrets.
    key = 'os.environ["ENDPOINT_API_KEY"]' if api_key else '"local"'
    return (('import os\n' if api_key else '') + 'from openai import OpenAI\n'
            f'client = OpenAI(base_url="{openai_base}", api_key={key})\n'
            f'model = client.models.list().data[0].id\n'
            f'answer = client.chat.completions.create(model=model, messages=[\n'
            f'    {{"role": "user", "content": "What is the capital of France?"}}])\n'
            f'print(answer.choices[0].message.content)')


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


def _seconds(parser: argparse.ArgumentParser, flag: str, default: float, help: str) -> None:
    """A time limit or a wait, in seconds (``%(default)g`` in ``help``: its default)."""
    parser.add_argument(flag, type=float, default=default, metavar="SECONDS", help=help)


def _switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    parser.add_argument(flag, action="store_true", help=help)


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    """Where the endpoint listens, and what each worker runs: a script here or an image's command."""
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


def _add_queue_options(parser: argparse.ArgumentParser) -> None:
    """What ``queue_endpoint`` reads."""
    _seconds(parser, "--execution-timeout", 600.0, "stop a job in progress longer than this, as RunPod's "
             "endpoint setting (default: %(default)g, RunPod's default; 0: no limit)")
    _seconds(parser, "--job-take-delay", 0.0, "answer each job-take request that carries jobs this long "
             "after taking them, as RunPod's queue is a network round trip away (default: %(default)g)")


def _add_balancer_options(parser: argparse.ArgumentParser) -> None:
    """What ``balancer_endpoint`` reads."""
    _switch(parser, "--load-balancer", "a load-balancing endpoint: no queue, each request goes to a ready "
            "worker's own HTTP server (ENDPOINT_TYPE=load_balancer)")
    _switch(parser, "--separate-health-port", "with --load-balancer: each worker answers /ping on a port of "
            "its own (PORT_HEALTH; default: on PORT)")
    _seconds(parser, "--worker-wait", 120.0, "with --load-balancer: answer 400 when no worker is ready this "
             "long after the request came (default: %(default)g, RunPod's)")
    _seconds(parser, "--request-timeout", 330.0, "with --load-balancer: a request longer than this gets a "
             "524, or its answer is cut off (default: %(default)g, RunPod's)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m endpoint", description=__doc__.splitlines()[0])
    _add_worker_options(parser)
    _add_queue_options(parser)
    _add_balancer_options(parser)
    _switch(parser, "--no-fitness-checks", "workers skip RunPod's start-up fitness checks (default: they run "
            "them, their network check dialling a listener of the endpoint's on 127.0.0.1)")
    _switch(parser, "--refuse-network-check", "the endpoint's network-check listener refuses connections: "
            "the workers' network fitness check fails, as on a host without network")
    parser.add_argument("--api-key", default=env_value("ENDPOINT_API_KEY", os.environ),
                        help="require this bearer key from clients (default: $ENDPOINT_API_KEY)")
    # uvloop, as vllm serve and RunPod's own proxies: the balancer relays every streamed chunk, and
    # asyncio's pure-Python loop spent that CPU where the workers' engines need it (bench item 22).
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
