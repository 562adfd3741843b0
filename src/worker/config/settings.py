"""The settings layer: with ``config/engine_args``, where the worker reads its configuration from
the environment (each value through ``env_text.env_value``: blank means unset).

``load_config(env)`` reads everything once, at start-up, before the model loads:

- ``WorkerSettings``: the worker's own knobs (concurrency, stream batching, OpenAI output mode),
  typed and validated by pydantic;
- ``ResolvedArgs``: vLLM's engine and OpenAI front-end flags (see ``config/engine_args``, which
  reads worker-vllm's old names through ``config/legacy_env`` and the baked-args file through
  ``model/baked_args``).

Five readers run before vLLM is imported (this module imports it only in ``load_config``):
``model_request(env)``, the hub repos to check and download (``model/preflight``),
``failure_answer_seconds(env)``, how long a worker that could not start answers jobs,
``startup_timeout(env)``, how long the start may take (``startup/watchdog``),
``endpoint_kind(env)``, whether the worker takes jobs from RunPod's queue or serves HTTP on a
load-balancing endpoint (which must answer ``/ping`` from the start), and ``fitness_settings(env)``,
RunPod's fitness checks (``startup/fitness``).

Every problem is collected into one ``ConfigError`` naming the variable, its value and what was
expected. Unknown variables close to a real name get a "did you mean" warning.

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
  the CPU VLLM_USE_AOT_COMPILE and TORCHINDUCTOR_CACHE_DIR (``_cpu_compile_cache``) unless the user
  set them (``_users_own``).
- ``startup/fitness.hand_over``: sets the runpod SDK's RUNPOD_SKIP_AUTO_SYSTEM_CHECKS,
  RUNPOD_SKIP_GPU_CHECK and RUNPOD_FITNESS_CHECKS_DONE, once the worker has read them (``fitness_settings``) to run the checks itself;
- ``vllm_adapter/lora.allow_adapters_by_name``: sets VLLM_ALLOW_RUNTIME_LORA_UPDATING, with LoRA on, so
  that vLLM's serving classes ask the worker's adapter registry for a name they do not know.

vLLM, torch and huggingface_hub read their own variables (VLLM_*, TORCH*, HF_*) as they do for
``vllm serve``.
"""

from __future__ import annotations

import difflib
import logging
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import yaml
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
from worker.model import baked_args
from worker.model.hub_adapters import HubAdapters, hub_rules
from worker.model.lora_adapters import AdapterSources
from worker.model.preflight import ModelRequest, RepoRequest
from worker.wire.errors import ConfigError
from worker.wire.media_urls import MediaURLPolicy

if TYPE_CHECKING:
    from worker.config.engine_args import ResolvedArgs
    from worker.model.preflight import Fetched

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

__all__ = ["EXTRA_ARGS_ENV", "EndpointKind", "FitnessSettings", "WorkerConfig", "WorkerSettings", "config_file",
           "endpoint_kind", "failure_answer_seconds", "fitness_settings", "is_repo_id", "load_config",
           "load_settings", "model_request", "startup_timeout"]


FAILURE_ANSWER_ENV = "STARTUP_FAILURE_ANSWER_SECONDS"
DEFAULT_FAILURE_ANSWER_SECONDS = 120.0
STARTUP_TIMEOUT_ENV = "VLLM_STARTUP_TIMEOUT"
DEFAULT_STARTUP_TIMEOUT = 1200.0  # worker-vllm's
# Raw `vllm serve` flags, applied above every other layer (config/engine_args).
EXTRA_ARGS_ENV = "VLLM_EXTRA_ARGS"
NETWORK_CHECK_TARGET_ENV = "NETWORK_CHECK_TARGET"  # host:port the network fitness check dials
DEFAULT_MAX_N = 128  # OpenAI's own bound on a chat completion's n


def _env(*names: str):
    return AliasChoices(*names)


def _env_names(model: type[BaseModel]) -> frozenset[str]:
    """The variables a settings model reads (its fields' aliases)."""
    return frozenset(name for f in model.model_fields.values() for name in f.validation_alias.choices)


class WorkerSettings(BaseModel):
    """Worker knobs, from env vars named by each field's aliases (first alias wins)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Jobs held at once: adaptive (scheduling/concurrency) between these; no maximum: vLLM's max_num_seqs.
    max_concurrency: int | None = Field(None, ge=1, validation_alias=_env("MAX_CONCURRENCY"))
    min_concurrency: int = Field(1, ge=1, validation_alias=_env("MIN_CONCURRENCY"))
    # Seconds from asking RunPod for a job to holding it: the worker holds as many more jobs as finish
    # in that time, waiting for room, so that a freed slot is refilled at once (scheduling/concurrency).
    job_take_latency: float = Field(0.1, ge=0, le=60, allow_inf_nan=False,
                                    validation_alias=_env("JOB_TAKE_LATENCY"))
    # The most completions (``n``) one request may ask for: a larger one is refused (engine/admission).
    max_n: int = Field(DEFAULT_MAX_N, ge=1, validation_alias=_env("MAX_N"))
    max_batch_size: int = Field(50, ge=1, validation_alias=_env("DEFAULT_BATCH_SIZE"))
    min_batch_size: int = Field(
        1, ge=1, validation_alias=_env("MIN_BATCH_SIZE", "DEFAULT_MIN_BATCH_SIZE"))
    batch_size_growth_factor: float = Field(
        3.0, ge=1, allow_inf_nan=False,
        validation_alias=_env("BATCH_SIZE_GROWTH_FACTOR", "DEFAULT_BATCH_SIZE_GROWTH_FACTOR"))
    raw_openai_output: bool = Field(True, validation_alias=_env("RAW_OPENAI_OUTPUT"))
    # Raw prompt/messages jobs: "tokens" (the seed's {"choices": [{"tokens": ...}]}) or "openai"
    # (worker-vllm >= 2.24's: through /v1/completions or /v1/chat/completions, routes/raw_format).
    raw_job_format: Literal["tokens", "openai"] = Field("tokens", validation_alias=_env("RAW_JOB_FORMAT"))
    openai_served_model_name_override: str | None = Field(
        None, validation_alias=_env("OPENAI_SERVED_MODEL_NAME_OVERRIDE"))
    job_timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                      validation_alias=_env("JOB_TIMEOUT"))
    # worker-vllm's bound on one request (0: none); the smallest limit set wins (``timeout_for``).
    request_timeout: float = Field(3600.0, ge=0, allow_inf_nan=False,
                                   validation_alias=_env("REQUEST_TIMEOUT"))
    # From the worker's start to ready (0: no limit), download progress not counted (startup/watchdog).
    vllm_startup_timeout: float = Field(DEFAULT_STARTUP_TIMEOUT, ge=0, allow_inf_nan=False,
                                        validation_alias=_env(STARTUP_TIMEOUT_ENV))
    # Seconds for the hub's answer about the model (model/preflight), as worker-vllm's preflight waits.
    model_preflight_timeout: float = Field(15.0, gt=0, allow_inf_nan=False,
                                           validation_alias=_env("MODEL_PREFLIGHT_TIMEOUT"))
    # After SIGTERM, jobs in flight may run this long before they are aborted and reported.
    shutdown_grace_period: float = Field(25.0, ge=0, allow_inf_nan=False,
                                         validation_alias=_env("SHUTDOWN_GRACE_PERIOD"))
    # "worker": job_loop.JobLoop, which starts a taken job at once; "sdk": the runpod SDK's own.
    job_loop: Literal["worker", "sdk"] = Field("worker", validation_alias=_env("JOB_LOOP"))
    # Keep vLLM's compile cache on the network volume, when one is mounted (engine/compile_cache).
    compile_cache_on_volume: bool = Field(True, validation_alias=_env("COMPILE_CACHE_ON_VOLUME"))
    # LoRA adapters by name (model/lora_adapters): folders searched first (default: $BASE_PATH/loras),
    # hub repos a request may name (patterns, each @revision optionally; none: the hub is not asked)
    # and how much one worker may fetch from it (model/hub_adapters), the base-model check.
    lora_dirs: str | None = Field(None, validation_alias=_env("LORA_DIRS"))
    lora_hub_repos: str | None = Field(None, validation_alias=_env("LORA_HUB_REPOS"))
    lora_hub_max_adapters: int = Field(32, ge=1, validation_alias=_env("LORA_HUB_MAX_ADAPTERS"))
    lora_hub_max_bytes: ByteSize = Field("10GiB", ge=1, validate_default=True,
                                         validation_alias=_env("LORA_HUB_MAX_BYTES"))
    lora_check_base_model: bool = Field(True, validation_alias=_env("LORA_CHECK_BASE_MODEL"))
    # Non-public networks (CIDRs, comma-separated) media URLs may reach: none unless set (wire/media_urls).
    allowed_private_media_networks: tuple[IPvAnyNetwork, ...] | None = Field(
        None, validation_alias=_env("ALLOWED_PRIVATE_MEDIA_NETWORKS"))
    # After a failed start, answer every job with the cause this long, then exit (0: exit at once).
    startup_failure_answer_seconds: float = Field(
        DEFAULT_FAILURE_ANSWER_SECONDS, ge=0, allow_inf_nan=False,
        validation_alias=_env(FAILURE_ANSWER_ENV))

    # The kind of endpoint (see ``endpoint_kind``); on a load-balancing one, the ports RunPod gives.
    endpoint_type: Literal["queue", "load_balancer"] | None = Field(
        None, validation_alias=_env("ENDPOINT_TYPE"))
    port: int = Field(80, ge=1, le=65535, validation_alias=_env("PORT"))
    port_health: int | None = Field(None, ge=1, le=65535, validation_alias=_env("PORT_HEALTH"))

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

    @classmethod
    def env_names(cls) -> frozenset[str]:
        return _env_names(cls)

    def timeout_for(self, job_timeout: float | None = None) -> tuple[float | None, str]:
        """The limit on one job or request: the smallest set among its own ``timeout``, JOB_TIMEOUT
        and REQUEST_TIMEOUT, and its name (None: no limit)."""
        given = ((job_timeout, "timeout"), (self.job_timeout, "JOB_TIMEOUT"),
                 (self.request_timeout, "REQUEST_TIMEOUT"))
        limits = [(seconds, name) for seconds, name in given if seconds]
        return min(limits, key=lambda limit: limit[0], default=(None, ""))


class FitnessSettings(BaseModel):
    """RunPod's start-up fitness checks (``startup/fitness``): the runpod SDK's variables and defaults,
    and the network check's target (the SDK dials a public DNS server; tests point it at loopback)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    skip_system: bool = Field(False, validation_alias=_env("RUNPOD_SKIP_AUTO_SYSTEM_CHECKS"))
    skip_gpu_test: bool = Field(False, validation_alias=_env("RUNPOD_SKIP_GPU_CHECK"))
    min_memory_gb: float = Field(4.0, ge=0, allow_inf_nan=False, validation_alias=_env("RUNPOD_MIN_MEMORY_GB"))
    min_disk_percent: float = Field(10.0, ge=0, le=100, allow_inf_nan=False,
                                    validation_alias=_env("RUNPOD_MIN_DISK_PERCENT"))
    min_cuda_version: str = Field("11.8", pattern=r"^\d+\.\d+$", validation_alias=_env("RUNPOD_MIN_CUDA_VERSION"))
    network_check_timeout: float = Field(5.0, gt=0, allow_inf_nan=False,
                                         validation_alias=_env("RUNPOD_NETWORK_CHECK_TIMEOUT"))
    gpu_benchmark_timeout: float = Field(2.0, gt=0, allow_inf_nan=False,
                                         validation_alias=_env("RUNPOD_GPU_BENCHMARK_TIMEOUT"))
    gpu_test_timeout: float = Field(30.0, gt=0, allow_inf_nan=False,
                                    validation_alias=_env("RUNPOD_GPU_TEST_TIMEOUT"))
    gpu_test_path: str | None = Field(None, validation_alias=_env("RUNPOD_BINARY_GPU_TEST_PATH"))
    network_check_target: str = Field("8.8.8.8:53", pattern=r"^\S+:\d{1,5}$",
                                      validation_alias=_env(NETWORK_CHECK_TARGET_ENV))

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
    return _validated(env, _env_names(FitnessSettings), FitnessSettings)


def load_settings(env: Mapping[str, str] | None = None) -> WorkerSettings:
    """WorkerSettings from ``env`` (default ``os.environ``); empty values mean "not set"."""
    return _validated(os.environ if env is None else env, WorkerSettings.env_names())


def _validated(env: Mapping[str, str], names: Iterable[str], model: type[M] = WorkerSettings) -> M:
    """``model`` (WorkerSettings) from the variables ``names`` (the others at their defaults)."""
    given = {name: value for name in names if (value := env_value(name, env)) is not None}
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        lines = [f"env {err['loc'][0]}={given.get(str(err['loc'][0]))!r}: {err['msg']}"
                 if err["loc"] else err["msg"].removeprefix("Value error, ") for err in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


@dataclass(frozen=True)
class WorkerConfig:
    settings: WorkerSettings
    args: ResolvedArgs
    # vLLM's compile cache on the network volume (compile_cache.VolumeCache); None: not kept there.
    volume_cache: Path | None = None
    # The names the served model answers to: its path or repo id, the repo its copy came from, the
    # served names (OPENAI_SERVED_MODEL_NAME_OVERRIDE's too).
    served_names: frozenset[str] = frozenset()
    # Where LoRA adapters named by requests are found; None with LoRA off.
    adapters: AdapterSources | None = None
    # Which media URLs vLLM may fetch (vllm_adapter/media.guard_media_urls holds it to them).
    media_urls: MediaURLPolicy = MediaURLPolicy()


# Where RunPod mounts the network volume (the image's BASE_PATH build arg, also set in its env).
DEFAULT_BASE_PATH = "/runpod-volume"
VOLUME_CACHE_DIR = "vllm-cache"  # under BASE_PATH


def volume_cache_dir(settings: WorkerSettings, env: Mapping[str, str]) -> Path | None:
    """The compile cache's folder on the network volume, when one is mounted at BASE_PATH and
    neither VLLM_CACHE_ROOT (the user's own cache root) nor COMPILE_CACHE_ON_VOLUME=false says no."""
    volume = Path(env_value("BASE_PATH", env) or DEFAULT_BASE_PATH)
    if not settings.compile_cache_on_volume:
        reason = "COMPILE_CACHE_ON_VOLUME=false"
    elif env_value("VLLM_CACHE_ROOT", env) is not None:
        reason = "VLLM_CACHE_ROOT is set"
    elif not (volume.is_dir() and os.access(volume, os.W_OK)):
        reason = f"no writable network volume at {volume} (BASE_PATH)"
    else:
        log.info("Compile cache: kept on the network volume, in %s", volume / VOLUME_CACHE_DIR)
        return volume / VOLUME_CACHE_DIR
    log.info("Compile cache: local only (%s)", reason)
    return None


LORA_DIR = "loras"  # under BASE_PATH


def _served_names(settings: WorkerSettings, args: ResolvedArgs) -> frozenset[str]:
    namespace = args.namespace
    names = {namespace.model, args.served_repo, settings.openai_served_model_name_override,
             *(namespace.served_model_name or ())}
    return frozenset(name for name in names if name)


def _adapter_sources(settings: WorkerSettings, args: ResolvedArgs, served_names: frozenset[str],
                     env: Mapping[str, str]) -> AdapterSources | None:
    """Where adapters named by requests are found (LORA_DIRS, then the image's), when LoRA is on."""
    if not args.engine_args.enable_lora:
        return None
    volume = Path(env_value("BASE_PATH", env) or DEFAULT_BASE_PATH) / LORA_DIR
    folders = [(Path(folder), "LORA_DIRS") for folder in (settings.lora_dirs or "").split(":") if folder] \
        or [(volume, "volume")]
    if baked := baked_args.read(baked_args.args_file(env), []).get(baked_args.BAKED_LORA_DIR_KEY):
        folders.append((Path(baked), "image"))
    rules = hub_rules(settings.lora_hub_repos)
    hub = HubAdapters(rules, settings.lora_hub_max_adapters, settings.lora_hub_max_bytes) if rules else None
    sources = AdapterSources(tuple(folders), hub, args.engine_args.max_lora_rank, served_names,
                             settings.lora_check_base_model)
    log.info("LoRA adapters by name: from %s%s", ", ".join(str(folder) for folder, _ in folders),
             f", and the hub's {settings.lora_hub_repos.strip()}" if rules else "")
    return sources


def _media_urls(settings: WorkerSettings, args: ResolvedArgs) -> MediaURLPolicy:
    """ALLOWED_PRIVATE_MEDIA_NETWORKS and vLLM's ALLOWED_MEDIA_DOMAINS, as the policy; logged."""
    policy = MediaURLPolicy(settings.allowed_private_media_networks or (),
                            tuple(args.engine_args.allowed_media_domains or ()))
    allowed = ", ".join(map(str, policy.private_networks))
    log.info("Media URLs: from %s; non-public addresses refused%s (ALLOWED_PRIVATE_MEDIA_NETWORKS)",
             ", ".join(policy.domains) or "any host", f" but in {allowed}" if allowed else "")
    return policy


# Prefixes of variables that belong to other programs (no typo check against ours).
_FOREIGN_PREFIXES = ("RUNPOD_", "VLLM_", "HF_", "HUGGINGFACE_", "NVIDIA_", "CUDA_", "PYTHON",
                     "TORCH", "OMP_", "LC_", "UV_", "PIP_", "NCCL_", "TRANSFORMERS_")


def _warn_near_misses(env: Mapping[str, str], known: frozenset[str], vllms: frozenset[str]) -> None:
    """A name close to a setting's is a typo. ``vllms``: vLLM's own variables; a ``VLLM_`` name that
    is neither theirs nor ours is checked against both (the worker's VLLM_EXTRA_ARGS among them)."""
    for name in env:
        if name in known or name in vllms or "_" not in name:
            continue
        if name.startswith("VLLM_"):
            candidates = known | vllms
        elif name.startswith(_FOREIGN_PREFIXES):
            continue
        else:
            candidates = known
        if match := difflib.get_close_matches(name, candidates, n=1, cutoff=0.85):
            log.warning("Unknown setting %s is ignored; did you mean %s?", name, match[0])


def load_config(env: Mapping[str, str] | None = None,
                downloaded: tuple[Fetched, Fetched | None] | None = None) -> WorkerConfig:
    """Read and validate all configuration; raises ConfigError listing every problem.
    ``downloaded``: the model (and tokenizer) ``preflight`` fetched, served from their snapshots."""
    from worker.config.engine_args import known_env_names, resolve_args  # imports vLLM
    from worker.vllm_adapter.engine_config import vllm_env_names

    env = os.environ if env is None else env
    _warn_near_misses(env, known_env_names() | WorkerSettings.env_names() | _env_names(FitnessSettings),
                      vllm_env_names())
    problems: list[str] = []
    settings = args = None
    try:
        settings = load_settings(env)
    except ConfigError as exc:
        problems.append(str(exc))
    try:
        args = resolve_args(env, downloaded=downloaded)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    if env_value("VLLM_API_KEY", env) is not None:
        log.warning("VLLM_API_KEY is ignored: RunPod authenticates callers, and jobs reach vLLM's "
                    "routes in-process, without a bearer token")
    log.info("Engine config: %s", args.summary())
    log.info("Worker settings: %s", settings.model_dump())
    served_names = _served_names(settings, args)
    return WorkerConfig(settings, args, volume_cache_dir(settings, env), served_names,
                        _adapter_sources(settings, args, served_names, env), _media_urls(settings, args))


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
    settings = _validated(env, ("ENDPOINT_TYPE", "PORT", "PORT_HEALTH"))
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


def _config_file_keys(env: Mapping[str, str]) -> dict[str, str]:
    """The config file's string values by dest (``tokenizer-revision`` → ``tokenizer_revision``);
    a file that does not parse is {} here (``load_config`` reports it)."""
    try:
        config = yaml.safe_load(config_file(env).read_text())
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {str(k).replace("-", "_"): str(v) for k, v in config.items() if v not in (None, "")}


def _extra_arg(env: Mapping[str, str], key: str) -> str | None:
    """The value VLLM_EXTRA_ARGS gives the flag of ``key`` (``--key value`` or ``--key=value``, the last
    one winning), read without vLLM's parser, for the repos preflight fetches; a line that does not
    split is reported by ``load_config``."""
    try:
        tokens = shlex.split(env_value(EXTRA_ARGS_ENV, env) or "")
    except ValueError:
        return None
    flag, found = "--" + key.replace("_", "-"), None
    for at, token in enumerate(tokens):
        name, equals, value = token.partition("=")
        if name.replace("_", "-") == flag:
            found = value if equals else next(iter(tokens[at + 1:at + 2]), None)
    return None if found is not None and found.startswith("--") else found  # a flag without a value


def _first(env: Mapping[str, str], file: dict[str, str], names: tuple[str, ...],
           key: str) -> tuple[str | None, str]:
    """The first value set among VLLM_EXTRA_ARGS's flag, env ``names``, then the config file's
    ``key``, and its name (the first env name when none is set: where a user would set it)."""
    if (value := _extra_arg(env, key)) is not None:
        return value, f"{EXTRA_ARGS_ENV} --{key.replace('_', '-')}"
    for name in names:
        if (value := env_value(name, env)) is not None:
            return value, name
    if key not in file:
        return None, names[0]
    return file[key], f"{key} in {config_file(env)} (VLLM_CONFIG_FILE)"


def is_repo_id(name: str) -> bool:
    """A hub repo id, not a local folder or a remote URI (s3://...)."""
    return not (name.startswith(("/", ".", "~")) or "://" in name or Path(name).is_dir())


def model_request(env: Mapping[str, str] | None = None) -> ModelRequest | None:
    """The hub repos the configuration serves, for ``preflight`` to check and fetch before vLLM is
    imported: read from the same layers as ``load_config`` (VLLM_EXTRA_ARGS, env alias, env, config
    file; the baked file's copy when it names the same repo). None when there is none to fetch: a
    local folder, the baked copy, or no model configured (``load_config`` then says so)."""
    env = os.environ if env is None else env
    file = _config_file_keys(env)
    baked = baked_args.read(baked_args.args_file(env), [])
    model, model_var = _first(env, file, ("MODEL_NAME", "MODEL"), "model")
    if model is None or not is_repo_id(model) or model == baked.get(baked_args.BAKED_SOURCE_KEYS["model"]):
        return None
    revision, revision_var = _first(env, file, ("MODEL_REVISION", "REVISION"), "revision")
    timeout = _validated(env, ("MODEL_PREFLIGHT_TIMEOUT",)).model_preflight_timeout
    request = RepoRequest(model, revision, model_var, revision_var, timeout)
    token, token_var = _first(env, file, ("HF_TOKEN",), "hf_token")
    token = token if token_var != "HF_TOKEN" and token not in ("true", "True") else None  # True: the login's
    tokenizer, tokenizer_var = _first(env, file, ("TOKENIZER_NAME", "TOKENIZER"), "tokenizer")
    tokenizer_revision, tokenizer_revision_var = _first(env, file, ("TOKENIZER_REVISION",),
                                                        "tokenizer_revision")
    if tokenizer is None or tokenizer == model:
        if tokenizer_revision in (None, revision):
            return ModelRequest(request, token=token)
        tokenizer, tokenizer_var = model, model_var
    if not is_repo_id(tokenizer) or tokenizer == baked.get(baked_args.BAKED_SOURCE_KEYS["tokenizer"]):
        return ModelRequest(request, token=token)
    # Another repo's tokenizer: its own default branch unless TOKENIZER_REVISION names one.
    return ModelRequest(request, RepoRequest(tokenizer, tokenizer_revision, tokenizer_var,
                                             tokenizer_revision_var, timeout), token=token)
