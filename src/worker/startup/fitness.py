"""RunPod's start-up fitness checks, run by the worker itself before it downloads or loads anything.

On RunPod, ``runpod.serverless.start`` runs the SDK's fitness checks and exits 1 on the first that
fails, answering no job: RunPod restarts the worker, which fails again, while callers see only
``IN_QUEUE``. Run where the SDK runs them, after the engine has loaded, they also measure the worker
itself: the CPU flavour's KV cache takes RAM from "memory available", a downloaded model takes space
from ``/``, and on a GPU the SDK's ``gpu_test`` allocates memory that vLLM has already reserved.

So the worker runs the same checks, with the SDK's variables and thresholds, as the first step of its
start (``check``): they measure the host before the worker takes anything, and a failure is a
``StartupError``, answered on the jobs as any start-up failure (``startup/failed_start``). Then the
SDK's own run is switched off (``hand_over``), for the whole process: a worker that passed cannot be
killed by a second run after its engine took its share, and a worker answering a failed start is not
killed before it has answered. The checks:

- ``memory``: RAM available (``psutil``'s, as the SDK's) >= RUNPOD_MIN_MEMORY_GB;
- ``disk``: free space on ``/`` >= RUNPOD_MIN_DISK_PERCENT of its size;
- ``network``: a TCP connection to NETWORK_CHECK_TARGET (the SDK's 8.8.8.8:53) within
  RUNPOD_NETWORK_CHECK_TIMEOUT;
- where ``nvidia-smi`` finds a GPU: the driver's CUDA version >= RUNPOD_MIN_CUDA_VERSION; every GPU
  initialised and a 1024x1024 matmul within RUNPOD_GPU_BENCHMARK_TIMEOUT, in a child process, so that
  the worker holds no CUDA context that vLLM would count as used; the SDK's ``gpu_test`` binary
  (memory on each GPU) within RUNPOD_GPU_TEST_TIMEOUT, unless RUNPOD_SKIP_GPU_CHECK. A ``gpu_test``
  that fails or times out falls back, as the SDK's does, to ``nvidia-smi --list-gpus``: listing a GPU
  passes (with a warning in the log).

RUNPOD_SKIP_AUTO_SYSTEM_CHECKS skips all but ``gpu_test``, as in the SDK. The settings are read where
the SDK would run the checks (``fitness_settings``: on RunPod), into ``FitnessSettings`` through the
settings layer (``config/settings.read_settings``).

One decision differs from the SDK's, on purpose: a GPU that ``nvidia-smi`` lists but torch cannot
see (``torch.cuda`` finds none) fails the start, where the SDK skips its CUDA checks. vLLM, which
runs on torch, could not start on it either; failed here, the answer says why in seconds, where
the engine would fail later with CUDA's words.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from worker.config.early_settings import endpoint_kind
from worker.config.settings import env_alias, env_names, read_settings
from worker.env_text import env_value
from worker.wire.errors import StartupError

log = logging.getLogger(__name__)

__all__ = ["FitnessSettings", "check", "fitness_settings", "hand_over"]

GB = 1024**3  # the SDK's gigabytes
PROBE_SECONDS = 120.0  # for the child process that initialises the GPUs: importing torch is slow
# The SDK's switches, set for this process and its children once the worker owns the checks (the
# marker is the one later SDK releases read to skip checks a parent process ran).
SDK_SWITCHES = {"RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true", "RUNPOD_SKIP_GPU_CHECK": "true",
                "RUNPOD_FITNESS_CHECKS_DONE": "true"}


class FitnessSettings(BaseModel):
    """The checks' settings: the runpod SDK's variables and defaults, and the network check's target
    (the SDK dials a public DNS server; tests point it at loopback). The SDK reads its two switches
    as ``"true"`` alone; the worker reads them as every boolean of its own (``1``, ``yes``, ``on`` too),
    and its reading is the one that holds: ``hand_over`` sets both to ``"true"`` for the SDK."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    skip_system: bool = Field(False, validation_alias=env_alias("RUNPOD_SKIP_AUTO_SYSTEM_CHECKS"))
    skip_gpu_test: bool = Field(False, validation_alias=env_alias("RUNPOD_SKIP_GPU_CHECK"))
    min_memory_gb: float = Field(4.0, ge=0, allow_inf_nan=False,
                                 validation_alias=env_alias("RUNPOD_MIN_MEMORY_GB"))
    min_disk_percent: float = Field(10.0, ge=0, le=100, allow_inf_nan=False,
                                    validation_alias=env_alias("RUNPOD_MIN_DISK_PERCENT"))
    min_cuda_version: str = Field("11.8", pattern=r"^\d+\.\d+$",
                                  validation_alias=env_alias("RUNPOD_MIN_CUDA_VERSION"))
    network_check_timeout: float = Field(5.0, gt=0, allow_inf_nan=False,
                                         validation_alias=env_alias("RUNPOD_NETWORK_CHECK_TIMEOUT"))
    gpu_benchmark_timeout: float = Field(2.0, gt=0, allow_inf_nan=False,
                                         validation_alias=env_alias("RUNPOD_GPU_BENCHMARK_TIMEOUT"))
    gpu_test_timeout: float = Field(30.0, gt=0, allow_inf_nan=False,
                                    validation_alias=env_alias("RUNPOD_GPU_TEST_TIMEOUT"))
    gpu_test_path: str | None = Field(None, validation_alias=env_alias("RUNPOD_BINARY_GPU_TEST_PATH"))
    network_check_target: str = Field("8.8.8.8:53", pattern=r"^\S+:\d{1,5}$",
                                      validation_alias=env_alias("NETWORK_CHECK_TARGET"))

    @field_validator("network_check_target")
    @classmethod
    def _port_in_range(cls, target: str) -> str:
        if not 0 < int(target.rpartition(":")[2]) < 65536:
            raise ValueError("the port must be 1 to 65535")
        return target

    @property
    def network_address(self) -> tuple[str, int]:
        host, _, port = self.network_check_target.rpartition(":")
        return host.strip("[]"), int(port)


def fitness_settings(env: Mapping[str, str] | None = None) -> FitnessSettings | None:
    """The fitness checks' settings where the runpod SDK would run them, on RunPod: a queue
    endpoint's worker (RUNPOD_WEBHOOK_GET_JOB set), or a load-balancing one's; else None.
    Raises ConfigError for a bad value."""
    env = os.environ if env is None else env
    if env_value("RUNPOD_WEBHOOK_GET_JOB", env) is None and not endpoint_kind(env).load_balancer:
        return None
    return read_settings(env, env_names(FitnessSettings), FitnessSettings)


def hand_over() -> None:
    """Switch the SDK's own run of the checks off (see the module's docstring)."""
    os.environ.update(SDK_SWITCHES)


def _failed(check: str, found: str, needed: str, variable: str) -> StartupError:
    return StartupError(f"fitness check {check!r} failed: {found}, {needed} required ({variable})")


def memory(settings: FitnessSettings) -> str:
    import psutil  # vLLM's dependency

    available = psutil.virtual_memory().available / GB
    if available < settings.min_memory_gb:
        raise _failed("memory", f"{available:.2f} GB of RAM available", f"{settings.min_memory_gb:g} GB",
                      "RUNPOD_MIN_MEMORY_GB")
    return f"{available:.2f} GB of RAM available"


def disk(settings: FitnessSettings) -> str:
    usage = shutil.disk_usage("/")
    free = 100 * usage.free / usage.total if usage.total else 0.0
    if free < settings.min_disk_percent:
        raise _failed("disk", f"{usage.free / GB:.2f} GB free on / ({free:.1f} % of its size)",
                      f"{settings.min_disk_percent:g} %", "RUNPOD_MIN_DISK_PERCENT")
    return f"{usage.free / GB:.2f} GB free on / ({free:.1f} %)"


def network(settings: FitnessSettings) -> str:
    address, timeout = settings.network_address, settings.network_check_timeout
    target = settings.network_check_target
    started = time.perf_counter()
    try:
        socket.create_connection(address, timeout=timeout).close()
    except TimeoutError:
        raise _failed("network", f"no connection to {target} within {timeout:g} s", "a connection",
                      "NETWORK_CHECK_TARGET, RUNPOD_NETWORK_CHECK_TIMEOUT") from None
    except OSError as exc:
        raise _failed("network", f"cannot connect to {target} ({exc.strerror or exc})", "a connection",
                      "NETWORK_CHECK_TARGET") from None
    return f"connected to {target} in {1000 * (time.perf_counter() - started):.0f} ms"


def _nvidia_smi() -> str | None:
    """``nvidia-smi``'s output, or None where it finds no GPU (not installed, no driver)."""
    try:
        done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and "NVIDIA-SMI" in done.stdout else None


def _version(text: str) -> tuple[int, int]:
    major, minor = re.search(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def cuda_version(settings: FitnessSettings, smi: str) -> str:
    found = re.search(r"CUDA Version:\s*(\d+\.\d+)", smi)
    if found is None:  # as the SDK: a version it cannot read is not a failure
        return "CUDA version not shown by nvidia-smi: not checked"
    if _version(found[1]) < _version(settings.min_cuda_version):
        raise _failed("cuda_version", f"the driver supports CUDA {found[1]}",
                      f"CUDA {settings.min_cuda_version}", "RUNPOD_MIN_CUDA_VERSION")
    return f"CUDA {found[1]}"


# Run in a child process (``gpu_compute``): every GPU initialised, then the SDK's timed matmul.
_PROBE = """
import json, time, torch
result = {"gpus": torch.cuda.device_count(), "ms": 0.0}
for i in range(result["gpus"]):
    torch.zeros(1024, device=f"cuda:{i}")
    torch.cuda.synchronize(i)
if result["gpus"]:
    start = time.perf_counter()
    a, b = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    torch.matmul(a, b)
    torch.cuda.synchronize()
    result["ms"] = 1000 * (time.perf_counter() - start)
print(json.dumps(result))
"""


def gpu_compute(settings: FitnessSettings) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise StartupError(f"fitness check 'gpu_compute' failed: CUDA did not initialise within "
                           f"{PROBE_SECONDS:g} s") from None
    if done.returncode != 0 or not done.stdout.strip():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise StartupError(f"fitness check 'gpu_compute' failed: CUDA cannot initialise the GPUs: {last}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["gpus"] == 0:
        raise StartupError("fitness check 'gpu_compute' failed: nvidia-smi shows a GPU, torch.cuda none: vLLM "
                           "cannot use it either (is CUDA_VISIBLE_DEVICES set, or the container given no "
                           "access to the GPU?)")
    limit = settings.gpu_benchmark_timeout * 1000
    if result["ms"] > limit:
        raise _failed("gpu_compute", f"a 1024x1024 matmul took {result['ms']:.0f} ms",
                      f"at most {limit:.0f} ms", "RUNPOD_GPU_BENCHMARK_TIMEOUT")
    return f"{result['gpus']} GPU(s), matmul {result['ms']:.0f} ms"


def _gpu_test_binary(settings: FitnessSettings) -> Path | None:
    """The SDK's ``gpu_test`` (RUNPOD_BINARY_GPU_TEST_PATH, as the SDK), found without importing it."""
    if settings.gpu_test_path and Path(settings.gpu_test_path).is_file():
        return Path(settings.gpu_test_path)
    spec = importlib.util.find_spec("runpod")
    for folder in spec.submodule_search_locations if spec else ():
        if (binary := Path(folder, "serverless", "binaries", "gpu_test")).is_file():
            return binary
    return None


def gpu_test_verdict(output: str) -> str | None:
    """What is wrong in ``gpu_test``'s output, by the SDK's reading (None: every GPU passed)."""
    found = re.search(r"Found (\d+) GPUs", output)
    passed = output.lower().count("memory allocation test passed")
    errors = [line.strip() for line in output.splitlines()
              if any(word in line.lower() for word in ("failed", "error", "cannot", "unable"))]
    if errors:
        return "; ".join(errors[:10])
    if not passed or passed != (int(found[1]) if found else -1):
        return f"{passed} GPU(s) passed of {found[1] if found else 'an unknown number'}"
    return None


def listed_gpus() -> int:
    """The GPUs ``nvidia-smi --list-gpus`` lists (its non-empty lines, as the SDK counts them);
    raises OSError where it cannot list them."""
    try:
        done = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10,
                              check=False)
    except subprocess.TimeoutExpired:
        raise OSError("nvidia-smi --list-gpus did not answer within 10 s") from None
    if done.returncode != 0:
        raise OSError(f"nvidia-smi --list-gpus exited with {done.returncode}: "
                      f"{(done.stderr or done.stdout).strip()[:200]}")
    return len([line for line in done.stdout.splitlines() if line.strip()])


def _gpu_test_problem(binary: Path, settings: FitnessSettings) -> str | None:
    try:
        done = subprocess.run([str(binary)], capture_output=True, text=True,
                              timeout=settings.gpu_test_timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"gpu_test did not finish within {settings.gpu_test_timeout:g} s (RUNPOD_GPU_TEST_TIMEOUT)"
    problem = gpu_test_verdict(done.stdout)
    return f"GPU memory allocation: {problem}" if problem else None


def gpu_test(settings: FitnessSettings) -> str:
    binary = _gpu_test_binary(settings)
    if binary is None:  # the SDK falls back to listing the GPUs: nvidia-smi found them already
        return "gpu_test binary not found: not run"
    if (problem := _gpu_test_problem(binary, settings)) is None:
        return "every GPU's memory allocation test passed"
    try:  # the SDK's fallback
        gpus = listed_gpus()
    except OSError as exc:
        raise StartupError(f"fitness check 'gpu_test' failed: {problem}; and the SDK's fallback: {exc}") from None
    if not gpus:
        raise StartupError(f"fitness check 'gpu_test' failed: {problem}; and nvidia-smi --list-gpus lists none")
    log.warning("Fitness check gpu_test: %s; nvidia-smi --list-gpus lists %d GPU(s), which passes, as in "
                "the runpod SDK (memory allocation not tested)", problem, gpus)
    return f"{problem}; {gpus} GPU(s) listed by nvidia-smi (the SDK's fallback)"


def _checks(settings: FitnessSettings) -> list[tuple[str, Callable[[], str]]]:
    smi = _nvidia_smi()
    system = [] if settings.skip_system else [
        ("memory", lambda: memory(settings)), ("disk", lambda: disk(settings)),
        ("network", lambda: network(settings))]
    if smi is None:
        return system
    gpu = [] if settings.skip_system else [
        ("cuda_version", lambda: cuda_version(settings, smi)), ("gpu_compute", lambda: gpu_compute(settings))]
    return system + gpu + ([] if settings.skip_gpu_test else [("gpu_test", lambda: gpu_test(settings))])


def check(settings: FitnessSettings) -> None:
    """Run the checks in turn; the first that fails raises its StartupError."""
    started = time.perf_counter()
    results = [f"{name}: {run()}" for name, run in _checks(settings)]
    if results:
        log.info("Fitness checks passed in %.2f s: %s", time.perf_counter() - started, "; ".join(results))
