"""The settings read before vLLM is imported, each on its own, so that they hold whatever the rest of
the configuration says (plain: no vLLM):

- ``failure_answer_seconds(env)``: how long a worker that could not start answers jobs
  (``startup/failed_start``);
- ``startup_timeout(env)``: how long the start may take (``startup/watchdog``, which starts with the
  process);
- ``endpoint_kind(env)``: whether the worker takes jobs from RunPod's queue or serves HTTP on a
  load-balancing endpoint (which must answer ``/ping`` from the start);
- ``config_file(env)`` and ``EXTRA_ARGS_ENV``: where the YAML config file and the raw `vllm serve`
  flags are, which both the model request (``config/model_request``) and vLLM's parser
  (``config/engine_args``) read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from worker.config.settings import FAILURE_ANSWER_ENV, STARTUP_TIMEOUT_ENV, WorkerSettings, read_settings
from worker.env_text import env_value

__all__ = ["EXTRA_ARGS_ENV", "EndpointKind", "config_file", "endpoint_kind", "failure_answer_seconds",
           "startup_timeout"]

# Raw `vllm serve` flags, applied above every other layer (config/engine_args).
EXTRA_ARGS_ENV = "VLLM_EXTRA_ARGS"


def _early(name: str, env: Mapping[str, str] | None) -> WorkerSettings:
    """The settings with variable ``name`` alone read, before (and whatever) the rest of the
    configuration fails; its own bad value is reported with the rest and the default used."""
    value = env_value(name, os.environ if env is None else env)
    try:
        return WorkerSettings.model_validate({} if value is None else {name: value})
    except ValidationError:
        return WorkerSettings()


def failure_answer_seconds(env: Mapping[str, str] | None = None) -> float:
    """STARTUP_FAILURE_ANSWER_SECONDS, read early (``_early``)."""
    return _early(FAILURE_ANSWER_ENV, env).startup_failure_answer_seconds


def startup_timeout(env: Mapping[str, str] | None = None) -> float:
    """VLLM_STARTUP_TIMEOUT, read early (``_early``): the watchdog starts with the process."""
    return _early(STARTUP_TIMEOUT_ENV, env).vllm_startup_timeout


@dataclass(frozen=True)
class EndpointKind:
    """How requests reach the worker: RunPod's job queue, or HTTP straight from RunPod's balancer."""
    load_balancer: bool
    port: int = 80
    health_port: int = 80
    reason: str = ""  # why this kind, for the start-up log


def endpoint_kind(env: Mapping[str, str] | None = None) -> EndpointKind:
    """ENDPOINT_TYPE, else a guess: RunPod names no endpoint's kind, but sets PORT_HEALTH (80 unless
    the user sets it) on a load-balancing endpoint's workers, and the job-take URL
    (RUNPOD_WEBHOOK_GET_JOB) on a queue-based one's. Raises ConfigError for a bad value."""
    env = os.environ if env is None else env
    settings = read_settings(env, ("ENDPOINT_TYPE", "PORT", "PORT_HEALTH"))
    if settings.endpoint_type is not None:
        load_balancer, reason = settings.endpoint_type == "load_balancer", f"ENDPOINT_TYPE={settings.endpoint_type}"
    elif settings.port_health is not None and env_value("RUNPOD_WEBHOOK_GET_JOB", env) is None:
        load_balancer, reason = True, "PORT_HEALTH is set and RUNPOD_WEBHOOK_GET_JOB is not (set ENDPOINT_TYPE to be sure)"
    else:
        load_balancer, reason = False, "ENDPOINT_TYPE is not set (the default)"
    return EndpointKind(load_balancer, settings.port, settings.port_health or settings.port, reason)


def config_file(env: Mapping[str, str]) -> Path:
    """The YAML config file's path: VLLM_CONFIG_FILE, else ``/vllm_config.yaml``."""
    return Path(env_value("VLLM_CONFIG_FILE", env) or "/vllm_config.yaml")
