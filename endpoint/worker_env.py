"""What the local endpoint gives each worker process, as RunPod does: its environment (the queue's
job protocol, or a load-balancing worker's ports; how it runs RunPod's fitness checks) and the
listener on loopback its network fitness check dials."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

from worker.env_text import env_value

__all__ = ["SKIP_CHECKS", "NetworkCheckTarget", "balancer_env", "queue_env", "worker_env"]

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
