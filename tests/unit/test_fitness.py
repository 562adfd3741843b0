"""RunPod's fitness checks as the worker runs them (``startup/fitness``): their settings, and each check
against this machine with thresholds set to pass and to fail. Through real worker processes under the
local endpoint: tests/endpoint/test_startup_failures.py."""

from __future__ import annotations

import os
import socket

import pytest

from worker.startup.fitness import FitnessSettings, fitness_settings
from worker.startup import fitness
from worker.wire.errors import ConfigError, StartupError

ON_RUNPOD = {"RUNPOD_WEBHOOK_GET_JOB": "http://127.0.0.1:9/job-take/$ID"}


def settings(**env: str) -> FitnessSettings:
    return fitness_settings({**ON_RUNPOD, **env})


def test_they_run_where_the_sdk_runs_them_and_on_a_load_balancing_endpoint():
    assert fitness_settings({}) is None  # a local run (--rp_serve_api, test_input.json)
    assert fitness_settings(ON_RUNPOD) == FitnessSettings()
    assert fitness_settings({"ENDPOINT_TYPE": "load_balancer"}) == FitnessSettings()


def test_the_sdks_variables_and_defaults():
    assert (FitnessSettings().min_memory_gb, FitnessSettings().min_disk_percent) == (4.0, 10.0)
    assert FitnessSettings().network_address == ("8.8.8.8", 53)
    tuned = settings(RUNPOD_MIN_MEMORY_GB="1.5", RUNPOD_MIN_DISK_PERCENT="2", RUNPOD_MIN_CUDA_VERSION="12.4",
                     RUNPOD_NETWORK_CHECK_TIMEOUT="1", NETWORK_CHECK_TARGET="[::1]:5353",
                     RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true", RUNPOD_SKIP_GPU_CHECK="TRUE")
    assert (tuned.min_memory_gb, tuned.min_disk_percent, tuned.min_cuda_version) == (1.5, 2.0, "12.4")
    assert tuned.network_address == ("::1", 5353) and tuned.skip_system and tuned.skip_gpu_test


def test_a_bad_value_names_its_variable():
    with pytest.raises(ConfigError) as raised:
        settings(RUNPOD_MIN_MEMORY_GB="four", NETWORK_CHECK_TARGET="8.8.8.8")
    assert "RUNPOD_MIN_MEMORY_GB='four'" in str(raised.value)
    assert "NETWORK_CHECK_TARGET='8.8.8.8'" in str(raised.value)
    for port in ("0", "99999"):
        with pytest.raises(ConfigError, match=rf"NETWORK_CHECK_TARGET='host:{port}'.*port must be 1 to 65535"):
            settings(NETWORK_CHECK_TARGET=f"host:{port}")


def test_memory_and_disk_pass_and_fail_on_this_machine():
    assert "GB of RAM available" in fitness.memory(settings(RUNPOD_MIN_MEMORY_GB="0.1"))
    assert "free on /" in fitness.disk(settings(RUNPOD_MIN_DISK_PERCENT="0.1"))
    with pytest.raises(StartupError, match=r"'memory' failed: [\d.]+ GB of RAM available, 100000 GB required "
                                           r"\(RUNPOD_MIN_MEMORY_GB\)"):
        fitness.memory(settings(RUNPOD_MIN_MEMORY_GB="100000"))
    with pytest.raises(StartupError, match=r"'disk' failed: .* % of its size\), 100 % required "
                                           r"\(RUNPOD_MIN_DISK_PERCENT\)"):
        fitness.disk(settings(RUNPOD_MIN_DISK_PERCENT="100"))


def test_the_network_check_dials_its_target_on_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        target = f"127.0.0.1:{server.getsockname()[1]}"
        assert fitness.network(settings(NETWORK_CHECK_TARGET=target)).startswith(f"connected to {target}")
    with socket.socket() as bound:  # bound, not listening: refused
        bound.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(StartupError, match=rf"'network' failed: cannot connect to {target} \(.*refused\)"
                                               r".*\(NETWORK_CHECK_TARGET\)"):
            fitness.network(settings(NETWORK_CHECK_TARGET=target))


def test_the_cuda_version_is_the_drivers():
    smi = "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |"
    assert fitness.cuda_version(settings(RUNPOD_MIN_CUDA_VERSION="11.8"), smi) == "CUDA 12.4"
    assert fitness.cuda_version(settings(RUNPOD_MIN_CUDA_VERSION="12.10"), smi.replace("12.4", "12.12"))
    with pytest.raises(StartupError, match=r"the driver supports CUDA 12.4, CUDA 12.8 required "
                                           r"\(RUNPOD_MIN_CUDA_VERSION\)"):
        fitness.cuda_version(settings(RUNPOD_MIN_CUDA_VERSION="12.8"), smi)
    assert "not checked" in fitness.cuda_version(FitnessSettings(), "NVIDIA-SMI has failed")


@pytest.mark.parametrize(("output", "verdict"), [
    ("Found 2 GPUs:\nGPU 0 memory allocation test passed.\nGPU 1 memory allocation test passed.\n", None),
    ("Found 2 GPUs:\nGPU 0 memory allocation test passed.\n", "1 GPU(s) passed of 2"),
    ("Found 1 GPUs:\nGPU 0: cudaMalloc failed: out of memory\n", "GPU 0: cudaMalloc failed: out of memory"),
    ("", "0 GPU(s) passed of an unknown number"),
])
def test_gpu_test_output_is_read_as_the_sdk_reads_it(output, verdict):
    assert fitness.gpu_test_verdict(output) == verdict


def test_the_sdks_own_run_is_switched_off_for_the_process(monkeypatch):
    for name in fitness.SDK_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    fitness.hand_over()
    assert {name: os.environ[name] for name in fitness.SDK_SWITCHES} == dict.fromkeys(fitness.SDK_SWITCHES, "true")


def test_skipping_the_system_checks_leaves_only_the_gpu_test(monkeypatch):
    monkeypatch.setattr(fitness, "_nvidia_smi", lambda: None)  # this machine has no GPU
    assert [name for name, _ in fitness._checks(settings())] == ["memory", "disk", "network"]
    assert fitness._checks(settings(RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true")) == []
    monkeypatch.setattr(fitness, "_nvidia_smi", lambda: "NVIDIA-SMI CUDA Version: 12.4")
    assert [name for name, _ in fitness._checks(settings())] == [
        "memory", "disk", "network", "cuda_version", "gpu_compute", "gpu_test"]
    assert [name for name, _ in fitness._checks(settings(RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true"))] == ["gpu_test"]
    assert fitness._checks(settings(RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true", RUNPOD_SKIP_GPU_CHECK="true")) == []


def test_the_start_reads_the_checks_settings_before_it_switches_the_sdks_run_off(monkeypatch):
    """The SDK's switches are also the user's: read before ``hand_over`` sets them."""
    from worker.startup.steps import fitness_checks

    for name in fitness.SDK_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RUNPOD_WEBHOOK_GET_JOB", ON_RUNPOD["RUNPOD_WEBHOOK_GET_JOB"])
    monkeypatch.setenv("RUNPOD_MIN_MEMORY_GB", "100000")
    first_step = fitness_checks()
    assert os.environ["RUNPOD_SKIP_AUTO_SYSTEM_CHECKS"] == "true"
    with pytest.raises(StartupError, match="'memory' failed"):
        first_step()
    monkeypatch.setenv("RUNPOD_MIN_MEMORY_GB", "lots")  # a bad value: raised by the first step too
    first_step = fitness_checks()
    with pytest.raises(ConfigError, match="RUNPOD_MIN_MEMORY_GB='lots'"):
        first_step()


def script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def nvidia_smi_listing(tmp_path, monkeypatch, listing: str | None) -> None:
    """An ``nvidia-smi`` first on PATH whose ``--list-gpus`` prints ``listing`` (None: fails, as with
    no GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    body = "echo 'No devices were found' >&2; exit 6" if listing is None else f"printf '{listing}'"
    script(bin_dir, "nvidia-smi", body)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


GPU_LINE = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\\n"
FAILING_TEST = "echo 'Found 1 GPUs:'; echo 'GPU 0: cudaMalloc failed: out of memory'"


def test_the_gpu_test_binary_is_run_bounded_and_read(tmp_path, monkeypatch, caplog):
    """The SDK's binary needs a GPU: a script in its place (RUNPOD_BINARY_GPU_TEST_PATH, as the SDK).
    Failing or hanging, it falls back to ``nvidia-smi --list-gpus``, as the SDK's check does."""
    passing = script(tmp_path, "pass", "echo 'Found 1 GPUs:'; echo 'GPU 0 memory allocation test passed.'")
    assert "passed" in fitness.gpu_test(settings(RUNPOD_BINARY_GPU_TEST_PATH=passing))
    failing, hanging = script(tmp_path, "fail", FAILING_TEST), script(tmp_path, "hang", "exec sleep 30")
    nvidia_smi_listing(tmp_path, monkeypatch, GPU_LINE * 2)
    result = fitness.gpu_test(settings(RUNPOD_BINARY_GPU_TEST_PATH=failing))
    assert result == ("GPU memory allocation: GPU 0: cudaMalloc failed: out of memory; 2 GPU(s) listed by "
                      "nvidia-smi (the SDK's fallback)")
    assert "which passes, as in the runpod SDK" in caplog.text
    result = fitness.gpu_test(settings(RUNPOD_BINARY_GPU_TEST_PATH=hanging, RUNPOD_GPU_TEST_TIMEOUT="0.5"))
    assert result.startswith("gpu_test did not finish within 0.5 s (RUNPOD_GPU_TEST_TIMEOUT); 2 GPU(s)")
    for listing, why in ((None, r"the SDK's fallback: nvidia-smi --list-gpus exited with 6: No devices were found"),
                         ("", "nvidia-smi --list-gpus lists none")):
        nvidia_smi_listing(tmp_path, monkeypatch, listing)
        with pytest.raises(StartupError, match=r"'gpu_test' failed: GPU memory allocation: GPU 0: cudaMalloc "
                                               rf"failed: out of memory; and {why}"):
            fitness.gpu_test(settings(RUNPOD_BINARY_GPU_TEST_PATH=failing))
