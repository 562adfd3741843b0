"""RunPod's start-up fitness checks, run by real workers under the local endpoint as on RunPod: the
runpod SDK's variables set to fail each check that can fail on this machine (the network one through
the endpoint's loopback target, which it makes refuse; the CUDA version through an ``nvidia-smi`` that
reports an old driver), each failure answered on the jobs (503 on a load-balancing endpoint) before the
worker loads or downloads anything. That they pass, and that the SDK does not run them a second time,
is asserted on the log of a worker that serves (tests/endpoint/test_local_endpoint.py)."""

from __future__ import annotations

import os
import re

import pytest
from conftest import engine_env
from local_endpoint import LocalEndpoint, failed_start_answers
from test_startup_failures import answered

OLD_DRIVER = "NVIDIA-SMI 470.82.01    Driver Version: 470.82.01    CUDA Version: 11.4"


def fake_nvidia_smi(tmp_path) -> str:
    """A folder whose ``nvidia-smi`` reports a GPU with an old driver: PATH's first entry."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "nvidia-smi").write_text(f"#!/bin/sh\necho '{OLD_DRIVER}'\n")
    (folder / "nvidia-smi").chmod(0o755)
    return str(folder)


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
    "cuda version": ({"PATH": "FAKE"}, (),
                     r"fitness check 'cuda_version' failed: the driver supports CUDA 11\.4, "
                     r"CUDA 11\.8 required \(RUNPOD_MIN_CUDA_VERSION\)"),
}


def failing_env(models, tmp_path, overrides: dict[str, str]) -> dict[str, str]:
    """A worker that would serve the tiny model, but for the check ``overrides`` makes fail."""
    if overrides.get("PATH") == "FAKE":
        overrides = {**overrides, "PATH": f"{fake_nvidia_smi(tmp_path)}:{os.environ['PATH']}"}
    return engine_env(models["tiny-llama"], **overrides)


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
