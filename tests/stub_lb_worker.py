"""A load-balancing worker without a model, for the balancer's tests: ``python -m endpoint
--load-balancer --handler tests/stub_lb_worker.py``.

It serves what the real worker serves with ``ENDPOINT_TYPE=load_balancer``, in miniature, on
``PORT`` (and ``GET /ping`` on ``PORT_HEALTH`` too): ``/ping`` answers 204 for its first
``STUB_START_SECONDS`` (default 0.3), then 200, and 503 once it got SIGTERM (it then stops);
``GET /env`` answers its RunPod variables (``RUNPOD_*``, ``ENDPOINT_TYPE``, ``PORT``,
``PORT_HEALTH``); ``POST /exit`` ends the process at once, without an answer (a worker that dies).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from aiohttp import web

VARIABLES = ("ENDPOINT_TYPE", "PORT", "PORT_HEALTH")


class Stub:
    def __init__(self) -> None:
        self.ready_at = time.monotonic() + float(os.environ.get("STUB_START_SECONDS", "0.3"))
        self.stopping = asyncio.Event()

    async def ping(self, request: web.Request) -> web.Response:
        if self.stopping.is_set():
            return web.Response(status=503)
        return web.Response(status=200 if time.monotonic() >= self.ready_at else 204)

    async def env(self, request: web.Request) -> web.Response:
        return web.json_response({k: v for k, v in os.environ.items()
                                  if k.startswith("RUNPOD_") or k in VARIABLES})

    async def exit(self, request: web.Request) -> web.Response:
        os._exit(3)


async def main() -> None:
    stub = Stub()
    app = web.Application()
    app.add_routes([web.get("/ping", stub.ping), web.get("/env", stub.env), web.post("/exit", stub.exit)])
    runner = web.AppRunner(app)
    await runner.setup()
    for port in {os.environ["PORT"], os.environ.get("PORT_HEALTH", os.environ["PORT"])}:
        await web.TCPSite(runner, "127.0.0.1", int(port)).start()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stub.stopping.set)
    await stub.stopping.wait()
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
