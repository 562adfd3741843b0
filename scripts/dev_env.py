"""What the tests and the bench share to run the real vLLM on a development machine: the CPU
settings of ``cpu-dev.env`` (process-wide vLLM settings and engine flags, as ``scripts/serve.sh``
uses them), set in this process before anything imports vLLM, and free local ports."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from dotenv import dotenv_values

__all__ = ["CPU_ENV", "free_port"]

CPU_ENV = {**dotenv_values(Path(__file__).with_name("cpu-dev.env")),
           # vLLM's engine sockets, away from other runs' on the same machine
           "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="vllm-rpc-"),
           "DISABLE_LOG_STATS": "true"}
for _name, _value in CPU_ENV.items():
    os.environ.setdefault(_name, _value)  # values already in the environment win


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
