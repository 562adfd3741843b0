"""The settings layer: with ``config/engine_args``, where the worker reads its configuration from
the environment (each value through ``env_text.env_value``: blank means unset).

This module holds the worker's own knobs, ``WorkerSettings`` (concurrency, stream batching, OpenAI
output mode, time limits), typed and validated by pydantic, and ``read_settings``, how any settings
model is read from the environment: every bad value is collected into one ``ConfigError`` naming
the variable, its value and what was expected. Booleans are read in pydantic's spellings, as every
other variable of the worker's (``env_text.parse_bool``). The rest of the layer, each in its module:

- ``config/early_settings``: what is read before vLLM is imported (the failed start's answer window,
  the start-up time bound, the endpoint's kind, the config file's path);
- ``config/model_request``: the hub repos preflight checks and fetches, before vLLM is imported;
- ``config/engine_args``: vLLM's engine and front-end flags, through vLLM's parser;
- ``config/worker_config``: ``load_config``, all of it read and validated at once, at start-up;
- ``startup/fitness``: RunPod's fitness checks' settings (``FitnessSettings``), beside the checks.

Outside this layer the environment is touched on purpose in these places only:

- ``handler``: reads LOG_LEVEL (logging must work before the configuration can fail), and loads
  one ``.env`` into the environment, for local development (``handler.load_env_file``): the one
  beside ``src/`` (the checkout's root, ``/.env`` in the image), never the working directory's,
  never overriding a variable already set;
- ``model/download_model``: reads the Dockerfile's build args (at build time, without vLLM);
- ``startup/steps``: sets WORKER_ENGINE_FAILURE_FILE (``ENGINE_FAILURE_FILE_ENV``) and
  WORKER_ENGINE_PHASE_FILE (``ENGINE_PHASE_FILE_ENV``), the files where vLLM's processes note why they
  failed and that the weights are loaded, which ``vllm_adapter/engine_notes`` reads (``_note_failure``
  and ``_note_phase`` in each engine process, ``engine_failure`` and ``engine_phase`` in the worker's);
- ``vllm_adapter/engine_env.engine_process_env``: the one place the worker sets what vLLM's engine processes
  inherit: VLLM_NO_USAGE_STATS=1 (no usage statistics sent) unless the operator set it false, and on
  the CPU VLLM_WORKER_MULTIPROC_METHOD=fork (``_start_method``), VLLM_USE_AOT_COMPILE and
  TORCHINDUCTOR_CACHE_DIR (``_cpu_compile_cache``) unless the user set them (``_users_own``).
- ``startup/fitness.hand_over``: sets the runpod SDK's RUNPOD_SKIP_AUTO_SYSTEM_CHECKS,
  RUNPOD_SKIP_GPU_CHECK and RUNPOD_FITNESS_CHECKS_DONE, once the worker has read them
  (``fitness_settings``) to run the checks itself;
- ``vllm_adapter/lora.allow_adapters_by_name``: sets VLLM_ALLOW_RUNTIME_LORA_UPDATING, with LoRA on, so
  that vLLM's serving classes ask the worker's adapter registry for a name they do not know.

vLLM, torch and huggingface_hub read their own variables (VLLM_*, TORCH*, HF_*) as they do for
``vllm serve``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Literal, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    ValidationError,
    field_validator,
    model_validator,
)

from worker.env_text import env_value
from worker.wire.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

__all__ = ["DEFAULT_FAILURE_ANSWER_SECONDS", "DEFAULT_STARTUP_TIMEOUT", "FAILURE_ANSWER_ENV",
           "STARTUP_TIMEOUT_ENV", "WorkerSettings", "env_alias", "env_names", "load_settings", "read_settings"]

FAILURE_ANSWER_ENV = "STARTUP_FAILURE_ANSWER_SECONDS"
DEFAULT_FAILURE_ANSWER_SECONDS = 120.0
STARTUP_TIMEOUT_ENV = "VLLM_STARTUP_TIMEOUT"
DEFAULT_STARTUP_TIMEOUT = 1200.0  # worker-vllm's
DEFAULT_MAX_N = 128  # OpenAI's own bound on a chat completion's n


def env_alias(*names: str) -> AliasChoices:
    """A field's variables, the first set winning."""
    return AliasChoices(*names)


def env_names(model: type[BaseModel]) -> frozenset[str]:
    """The variables a settings model reads (its fields' aliases)."""
    return frozenset(name for f in model.model_fields.values() for name in f.validation_alias.choices)


class WorkerSettings(BaseModel):
    """Worker knobs, from env vars named by each field's aliases (first alias wins)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Jobs held at once: adaptive (scheduling/concurrency) between these; no maximum: vLLM's max_num_seqs.
    max_concurrency: int | None = Field(None, ge=1, validation_alias=env_alias("MAX_CONCURRENCY"))
    min_concurrency: int = Field(1, ge=1, validation_alias=env_alias("MIN_CONCURRENCY"))
    # Seconds from asking RunPod for a job to holding it: the worker holds as many more jobs as finish
    # in that time, waiting for room, so that a freed slot is refilled at once (scheduling/concurrency).
    job_take_latency: float = Field(0.1, ge=0, le=60, allow_inf_nan=False,
                                    validation_alias=env_alias("JOB_TAKE_LATENCY"))
    # The share of the KV cache the admission gate plans beyond it: requests that start at once and
    # that vLLM preempts as the cache fills (scheduling/concurrency.KvBudget); 0: none, no preemption.
    kv_overcommit: float = Field(0.0, ge=0, le=4, allow_inf_nan=False, validation_alias=env_alias("KV_OVERCOMMIT"))
    # The most completions (``n``) one request may ask for: a larger one is refused (engine/admission).
    max_n: int = Field(DEFAULT_MAX_N, ge=1, validation_alias=env_alias("MAX_N"))
    max_batch_size: int = Field(50, ge=1, validation_alias=env_alias("DEFAULT_BATCH_SIZE"))
    min_batch_size: int = Field(
        1, ge=1, validation_alias=env_alias("MIN_BATCH_SIZE", "DEFAULT_MIN_BATCH_SIZE"))
    batch_size_growth_factor: float = Field(
        3.0, ge=1, allow_inf_nan=False,
        validation_alias=env_alias("BATCH_SIZE_GROWTH_FACTOR", "DEFAULT_BATCH_SIZE_GROWTH_FACTOR"))
    raw_openai_output: bool = Field(True, validation_alias=env_alias("RAW_OPENAI_OUTPUT"))
    # Raw prompt/messages jobs: "tokens" (the seed's {"choices": [{"tokens": ...}]}) or "openai"
    # (worker-vllm >= 2.24's: through /v1/completions or /v1/chat/completions, routes/raw_format).
    raw_job_format: Literal["tokens", "openai"] = Field("tokens",
                                                        validation_alias=env_alias("RAW_JOB_FORMAT"))
    openai_served_model_name_override: str | None = Field(
        None, validation_alias=env_alias("OPENAI_SERVED_MODEL_NAME_OVERRIDE"))
    job_timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      validation_alias=env_alias("JOB_TIMEOUT"))
    # worker-vllm's bound on one request (0: none); the smallest limit set wins (``timeout_for``).
    request_timeout: float = Field(3600.0, ge=0, allow_inf_nan=False,
                                   validation_alias=env_alias("REQUEST_TIMEOUT"))
    # From the worker's start to ready (0: no limit), download progress not counted (startup/watchdog).
    vllm_startup_timeout: float = Field(DEFAULT_STARTUP_TIMEOUT, ge=0, allow_inf_nan=False,
                                        validation_alias=env_alias(STARTUP_TIMEOUT_ENV))
    # Seconds for the hub's answer about the model (model/preflight), as worker-vllm's preflight waits.
    model_preflight_timeout: float = Field(15.0, gt=0, allow_inf_nan=False,
                                           validation_alias=env_alias("MODEL_PREFLIGHT_TIMEOUT"))
    # After SIGTERM, jobs in flight may run this long before they are aborted and reported.
    shutdown_grace_period: float = Field(25.0, ge=0, allow_inf_nan=False,
                                         validation_alias=env_alias("SHUTDOWN_GRACE_PERIOD"))
    # "worker": job_loop.JobLoop, which starts a taken job at once; "sdk": the runpod SDK's own.
    job_loop: Literal["worker", "sdk"] = Field("worker", validation_alias=env_alias("JOB_LOOP"))
    # Keep vLLM's compile cache on the network volume, when one is mounted (engine/compile_cache).
    compile_cache_on_volume: bool = Field(True, validation_alias=env_alias("COMPILE_CACHE_ON_VOLUME"))
    # LoRA adapters by name (model/lora_adapters): folders searched first (default: $BASE_PATH/loras),
    # hub repos a request may name (patterns, each @revision optionally; none: the hub is not asked)
    # and how much one worker may fetch from it (model/hub_adapters), the base-model check.
    lora_dirs: str | None = Field(None, validation_alias=env_alias("LORA_DIRS"))
    lora_hub_repos: str | None = Field(None, validation_alias=env_alias("LORA_HUB_REPOS"))
    lora_hub_max_adapters: int = Field(32, ge=1, validation_alias=env_alias("LORA_HUB_MAX_ADAPTERS"))
    lora_hub_max_bytes: ByteSize = Field("10GiB", ge=1, validate_default=True,
                                         validation_alias=env_alias("LORA_HUB_MAX_BYTES"))
    lora_check_base_model: bool = Field(True, validation_alias=env_alias("LORA_CHECK_BASE_MODEL"))
    # Non-public networks (CIDRs, comma-separated) media URLs may reach: none unless set (wire/media_urls).
    allowed_private_media_networks: tuple[IPvAnyNetwork, ...] | None = Field(
        None, validation_alias=env_alias("ALLOWED_PRIVATE_MEDIA_NETWORKS"))
    # After a failed start, answer every job with the cause this long, then exit (0: exit at once).
    startup_failure_answer_seconds: float = Field(
        DEFAULT_FAILURE_ANSWER_SECONDS, ge=0, allow_inf_nan=False,
        validation_alias=env_alias(FAILURE_ANSWER_ENV))

    # The kind of endpoint (see ``endpoint_kind``); on a load-balancing one, the ports RunPod gives.
    endpoint_type: Literal["queue", "load_balancer"] | None = Field(
        None, validation_alias=env_alias("ENDPOINT_TYPE"))
    port: int = Field(80, ge=1, le=65535, validation_alias=env_alias("PORT"))
    port_health: int | None = Field(None, ge=1, le=65535, validation_alias=env_alias("PORT_HEALTH"))

    @field_validator("endpoint_type", mode="before")
    @classmethod
    def _endpoint_spelling(cls, value: object) -> object:
        """``load_balancer``, ``load-balancer``, ``loadbalancer`` or ``lb``; any case."""
        if isinstance(value, str):
            squeezed = value.strip().lower().replace("-", "").replace("_", "")
            return {"lb": "load_balancer", "loadbalancer": "load_balancer", "loadbalancing": "load_balancer",
                    "queue": "queue", "queuebased": "queue"}.get(squeezed, value)
        return value

    @field_validator("allowed_private_media_networks", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _floor_below_cap(self) -> WorkerSettings:
        if self.max_concurrency is not None and self.min_concurrency > self.max_concurrency:
            raise ValueError(f"MIN_CONCURRENCY={self.min_concurrency} is above "
                             f"MAX_CONCURRENCY={self.max_concurrency}")
        return self

    def timeout_for(self, job_timeout: float | None = None) -> tuple[float | None, str]:
        """The limit on one job or request: the smallest set among its own ``timeout``, JOB_TIMEOUT
        and REQUEST_TIMEOUT, and its name (None: no limit)."""
        given = ((job_timeout, "timeout"), (self.job_timeout, "JOB_TIMEOUT"),
                 (self.request_timeout, "REQUEST_TIMEOUT"))
        limits = [(seconds, name) for seconds, name in given if seconds]
        return min(limits, key=lambda limit: limit[0], default=(None, ""))


def load_settings(env: Mapping[str, str] | None = None) -> WorkerSettings:
    """WorkerSettings from ``env`` (default ``os.environ``); empty values mean "not set"."""
    env = os.environ if env is None else env
    return read_settings(env, env_names(WorkerSettings))


def read_settings(env: Mapping[str, str], names: Iterable[str], model: type[M] = WorkerSettings) -> M:
    """``model`` (WorkerSettings) from the variables ``names`` (the others at their defaults); a bad
    value raises ConfigError naming each."""
    given = {name: value for name in names if (value := env_value(name, env)) is not None}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        lines = [f"env {err['loc'][0]}={given.get(str(err['loc'][0]))!r}: {err['msg']}"
                 if err["loc"] else err["msg"].removeprefix("Value error, ") for err in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
