"""What the tests and the bench share to run the real vLLM on a development machine: the CPU
settings of ``cpu-dev.env`` (process-wide vLLM settings and engine flags, as ``scripts/serve.sh``
uses them), set in this process before anything imports vLLM, a loopback target for the workers'
network fitness check, and free local ports."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import threading
from pathlib import Path

from dotenv import dotenv_values

__all__ = ["CPU_ENV", "free_port"]



def _network_check_target() -> str:
    """A loopback listener for the network fitness check of the workers that tests and the bench
    start themselves (the local endpoint has its own): the SDK's own target is a public address."""
    server = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            server.accept()[0].close()

    threading.Thread(target=accept, name="network-check-target", daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


_DEFAULTS = {**dotenv_values(Path(__file__).with_name("cpu-dev.env")),
             # vLLM's engine sockets, away from other runs' on the same machine
             "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="vllm-rpc-"),
             "DISABLE_LOG_STATS": "true"}
# Values already in the environment win, here and in the processes given CPU_ENV.
CPU_ENV = {name: os.environ.get(name) or value for name, value in _DEFAULTS.items()}
CPU_ENV["NETWORK_CHECK_TARGET"] = os.environ.get("NETWORK_CHECK_TARGET") or _network_check_target()
os.environ.update(CPU_ENV)


_PORTS_FROM = 20000  # above the well-known and common service ports
# The test processes of one run (pytest-xdist's gw0, gw1, ...) each pick from their own share of
# the ports: one cannot give a port another has just picked and not bound yet.
_SHARE = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_SHARES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_GIVEN: set[int] = set()
_GIVEN_LOCK = threading.Lock()
_RANDOM = random.SystemRandom()


def free_port() -> int:
    """A port of 127.0.0.1 free now, below the kernel's ephemeral range (a port from that range can
    be taken by any outgoing connection's socket before the server that was given it binds it), and
    never one this process gave before: two endpoints started at once from two threads each bind
    theirs only once their processes have started."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    with _GIVEN_LOCK:
        untried = [port for port in range(_PORTS_FROM + _SHARE, low, _SHARES) if port not in _GIVEN]
        # A generator of its own: libraries seed the global one (vLLM's model worker, with its model's seed).
        for port in _RANDOM.sample(untried, min(64, len(untried))):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    raise OSError(f"no free port of 127.0.0.1 between {_PORTS_FROM} and {low} not given before")
