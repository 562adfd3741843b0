"""Workers run from a container image, as RunPod runs a worker: ``python -m endpoint --image IMAGE``.

Each worker is the image's own command (its ENTRYPOINT and CMD), run by buildah in a working
container of its own (no daemon: chroot isolation) on the host's network, so that it reaches the
endpoint on 127.0.0.1. The container gets the image's environment, RunPod's variables and only the
variables named with ``--env``; ``--volume`` mounts a host folder, as RunPod mounts a network
volume at ``/runpod-volume``. The working container is removed when its worker has exited; the
worker's restart runs in a new one.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence

# What RunPod sets in a worker's container; every other variable of the endpoint's own environment
# stays on the host unless named with --env.
RUNPOD_PREFIX = "RUNPOD_"
ALWAYS_PASSED = ("PYTHONUNBUFFERED", "NETWORK_CHECK_TARGET")  # the latter: the endpoint's, on loopback


def _buildah(*args: str, check: bool = True) -> str:
    env = {"STORAGE_DRIVER": "overlay", "BUILDAH_ISOLATION": "chroot", **os.environ}
    return subprocess.run(["buildah", *args], check=check, text=True, capture_output=True,
                          env=env).stdout.strip()


def image_command(image: str) -> list[str]:
    """The image's ENTRYPOINT followed by its CMD."""
    config = json.loads(_buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
    return [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]


def container_env(env: Mapping[str, str], passed: Sequence[str]) -> dict[str, str]:
    """RunPod's variables and the ones ``passed`` names (``NAME`` takes this environment's value,
    ``NAME=VALUE`` its own)."""
    chosen = {k: v for k, v in env.items() if k.startswith(RUNPOD_PREFIX) or k in ALWAYS_PASSED}
    for item in passed:
        name, sep, value = item.partition("=")
        if sep:
            chosen[name] = value
        elif name in env:
            chosen[name] = env[name]
    return chosen


class ContainerLauncher:
    """Starts each worker in a working container of ``image``; removes it afterwards."""

    def __init__(self, image: str, passed: Sequence[str] = (), volumes: Sequence[str] = ()) -> None:
        self.image = image
        self.passed = tuple(passed)
        self.volumes = tuple(volumes)
        self.command = image_command(image)
        self.containers: dict[str, str] = {}  # worker → its current container
        self.launches: dict[str, int] = {}

    def __call__(self, worker: str, env: Mapping[str, str]) -> list[str]:
        # A name per launch: a container the previous launch failed to remove cannot block the next.
        self.launches[worker] = launch = self.launches.get(worker, 0) + 1
        name = f"{worker}-{os.getpid()}-{launch}"
        self.containers[worker] = _buildah("from", "--pull=never", "--name", name, self.image)
        options = [f"--volume={volume}" for volume in self.volumes]
        options += [f"--env={k}={v}" for k, v in container_env(env, self.passed).items()]
        return ["buildah", "run", "--isolation=chroot", "--network=host", *options,
                self.containers[worker], "--", *self.command]

    def remove(self, worker: str) -> None:
        if container := self.containers.pop(worker, None):
            _buildah("rm", container, check=False)  # in the storage it was made in
