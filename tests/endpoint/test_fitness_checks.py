"""RunPod's start-up fitness checks, run by real workers under the local endpoint as on RunPod: the
runpod SDK's variables set to fail each check that can fail on this machine (the network one through
the endpoint's loopback target, which it makes refuse; the CUDA version through an ``nvidia-smi`` that
reports an old driver, or a GPU that this CPU build of torch cannot see; the SDK's ``gpu_test`` through
a failing stand-in, with an ``nvidia-smi --list-gpus`` that fails: the SDK's fallback), each failure
answered on the jobs (503 on a load-balancing endpoint) before the worker loads or downloads anything. That they pass, and that the SDK does not run them a second time,
is asserted on the log of a worker that serves (tests/endpoint/test_local_endpoint.py)."""

from __future__ import annotations

import os
import re

import pytest
from conftest import engine_env
from local_endpoint import LocalEndpoint, failed_start_answers
from test_startup_failures import answered

DRIVERS = {"OLD": "NVIDIA-SMI 470.82.01    Driver Version: 470.82.01    CUDA Version: 11.4",
           "NEW": "NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4"}


def script(folder, name: str, body: str):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)
    return folder / name


def fake_gpu_host(tmp_path, overrides: dict[str, str]) -> dict[str, str]:
    """``PATH``: OLD or NEW, an ``nvidia-smi`` that reports a GPU with that driver first on PATH (and
    whose ``--list-gpus``, the SDK's fallback from ``gpu_test``, fails); ``RUNPOD_BINARY_GPU_TEST_PATH``:
    FAIL, a ``gpu_test`` whose allocation fails."""
    changed = dict(overrides)
    if driver := overrides.get("PATH"):
        script(tmp_path / "bin", "nvidia-smi", 'if [ "$1" = --list-gpus ]; then echo "No devices were found" >&2; '
                                               f"exit 6; fi\necho '{DRIVERS[driver]}'")
        changed["PATH"] = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    if overrides.get("RUNPOD_BINARY_GPU_TEST_PATH"):
        failing = "echo 'Found 1 GPUs:'; echo 'GPU 0: cudaMalloc failed: out of memory'"
        changed["RUNPOD_BINARY_GPU_TEST_PATH"] = str(script(tmp_path / "sdk", "gpu_test", failing))
    return changed


FAILURES = {
    "memory": ({"RUNPOD_MIN_MEMORY_GB": "100000"}, (),
               r"fitness check 'memory' failed: [\d.]+ GB of RAM available, 100000 GB required "
               r"\(RUNPOD_MIN_MEMORY_GB\)"),
    "disk": ({"RUNPOD_MIN_DISK_PERCENT": "100"}, (),
             r"fitness check 'disk' failed: [\d.]+ GB free on / \([\d.]+ % of its size\), 100 % required "
             r"\(RUNPOD_MIN_DISK_PERCENT\)"),
    "network": ({}, ("--refuse-network-check",),
                r"fitness check 'network' failed: cannot connect to 127\.0\.0\.1:\d+ \(Connection refused\), "
                r"a connection required \(NETWORK_CHECK_TARGET\)"),
    "cuda version": ({"PATH": "OLD"}, (),
                     r"fitness check 'cuda_version' failed: the driver supports CUDA 11\.4, "
                     r"CUDA 11\.8 required \(RUNPOD_MIN_CUDA_VERSION\)"),
    "gpu compute": ({"PATH": "NEW"}, (),
                    r"fitness check 'gpu_compute' failed: nvidia-smi shows a GPU, torch\.cuda none: vLLM "
                    r"cannot use it either"),
    "gpu test": ({"PATH": "NEW", "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
                  "RUNPOD_BINARY_GPU_TEST_PATH": "FAIL"},
                 (), r"fitness check 'gpu_test' failed: GPU memory allocation: GPU 0: cudaMalloc failed: "
                     r"out of memory; and the SDK's fallback: nvidia-smi --list-gpus exited with 6: No devices "
                     r"were found"),
}


def failing_env(models, tmp_path, overrides: dict[str, str]) -> dict[str, str]:
    """A worker that would serve the tiny model, but for the check ``overrides`` makes fail."""
    return engine_env(models["tiny-llama"], **fake_gpu_host(tmp_path, overrides))


@pytest.mark.parametrize("check", FAILURES)
def test_a_failed_check_is_answered_on_every_job_before_anything_loads(models, tmp_path, check):
    overrides, args, message = FAILURES[check]
    env = failing_env(models, tmp_path, overrides)
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log", args=args)
    try:
        text = answered(endpoint, "fitness check")
        assert re.search(message, text), text
        log = endpoint.log()
        assert "Worker could not start: fitness check" in log and "Engine config" not in log
        assert "Worker is unhealthy, exiting" not in log  # the SDK's own run did not kill it
        assert endpoint.http.get("/health").json()["workers"]["ready"] == 1  # still answering
    finally:
        endpoint.stop()


def test_on_a_load_balancing_endpoint_a_failed_check_is_a_503(models, tmp_path):
    env = engine_env(models["tiny-llama"], RUNPOD_MIN_MEMORY_GB="100000")
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log", ready_timeout=None, args=("--load-balancer",))
    try:
        for text in failed_start_answers(endpoint):
            assert "fitness check 'memory' failed" in text and "(RUNPOD_MIN_MEMORY_GB)" in text
        assert "Engine config" not in endpoint.log()
    finally:
        endpoint.stop()
