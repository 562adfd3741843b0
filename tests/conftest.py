"""Shared fixtures: offline models and one engine per model for the whole session.

vLLM on the CPU needs a few process-wide settings, set here before vLLM is imported.
Engines are session-scoped (an engine start costs ~20 s); each owns its own event loop
(see src/worker/engine/background_loop.py), so tests drive them with plain ``asyncio.run``.

The suite runs in two processes (pytest-xdist), tests that share a fixture in the same one
(tests/parallel.py); it ends with a line of what it started and what that took (tests/starts.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS_ROOT = REPO / ".cache" / "models"

# In bfloat16 the dequantised SmolLM2 is on a knife edge for "What is the capital of France?"
# (first token "L" 0.160 vs "The" 0.141 on this CPU); float32 answers "Paris", as transformers does.
SMOLLM2_DTYPE = "float32"

sys.path.insert(0, str(REPO / "scripts"))
import parallel  # noqa: E402
from dev_env import CPU_ENV  # noqa: E402 - scripts/ is on the path from here on
import starts  # noqa: E402
from starts import timed  # noqa: E402


# --- the suite in two processes (tests/parallel.py), and what it started (tests/starts.py) ---------

def pytest_configure(config) -> None:
    parallel.configure(config)


def pytest_unconfigure() -> None:
    parallel.unconfigure()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    parallel.order(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return parallel.GroupScheduling(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with parallel.one_at_a_time(item):
        outcome = yield
    if parallel.group(item.nodeid) == parallel.ENGINES and (
            nextitem is None or parallel.group(nextitem.nodeid) != parallel.ENGINES):
        _stop_session_engines()  # tests/engine is done: their memory back, their stop not at the end
    return outcome


def pytest_sessionfinish(session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist process: its starts go to the controller
        session.config.workeroutput["starts"] = starts.to_send()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    starts.merge(node.workeroutput.get("starts", {}) if hasattr(node, "workeroutput") else {})


def pytest_runtest_logreport(report) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # where the run reports (xdist: its controller)
        starts.step(report.nodeid, report.duration)


def pytest_terminal_summary(terminalreporter) -> None:
    """The suite's last lines: what it started and what that took, and each folder's seconds."""
    terminalreporter.write_line(starts.by_folder())
    terminalreporter.write_line(starts.summary())


@pytest.fixture
def capture_info(caplog):
    """Libraries loaded by other tests may raise the root log level; capture INFO and up anyway."""
    caplog.set_level(logging.INFO)


@pytest.fixture
def hub_lookups_off(monkeypatch):
    """Settings resolved for made-up model ids: skip vLLM's offline id→cache-path rewrite."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="session")
def models() -> dict[str, Path]:
    from build_models import build_all

    return build_all(MODELS_ROOT)


def engine_env(model: Path, **extra: str) -> dict[str, str]:
    """A complete worker environment for ``model``; no file layers unless given."""
    return {"MODEL_NAME": str(model), **CPU_ENV,
            "VLLM_CONFIG_FILE": "/nonexistent/vllm_config.yaml",
            "LOCAL_MODEL_ARGS_FILE": "/nonexistent/local_model_args.json", **extra}


class LoadFeed:
    """The engines' scheduler feed (``vLLMEngine(on_load=...)``), handed to whatever observers a
    test adds (a ``concurrency.Concurrency``'s ``observe``): one engine serves every test."""

    def __init__(self) -> None:
        self.observers: list = []

    def __call__(self, **load) -> None:
        for observe in self.observers:
            observe(**load)


LOAD_FEED = LoadFeed()


def _build_engine(env: dict[str, str]):
    from worker.engine.vllm_engine import vLLMEngine
    from worker.config.worker_config import load_config

    with timed("engines"):
        return vLLMEngine(load_config(env), on_load=LOAD_FEED)


@pytest.fixture(scope="session")
def tiny_lora(models, tmp_path_factory) -> Path:
    from build_models import build_lora

    return build_lora(models["tiny-llama"], tmp_path_factory.mktemp("lora") / "tiny-lora", seed=0)


@pytest.fixture(scope="session")
def tiny_env(models, tiny_lora) -> dict[str, str]:
    """The tiny model with one LoRA adapter, ``tiny-lora``."""
    return engine_env(models["tiny-llama"],
                      LORA_MODULES=json.dumps({"name": "tiny-lora", "path": str(tiny_lora)}))


@pytest.fixture(scope="session")
def minilm_env(models) -> dict[str, str]:
    # MAX_MODEL_LEN=0: "derive it from the model" (256 here, below the CPU default of 2048).
    return engine_env(models["all-minilm-l6-v2"], RUNNER="pooling", DTYPE="float32", MAX_MODEL_LEN="0")


@pytest.fixture(scope="session")
def smol_env(models) -> dict[str, str]:
    return engine_env(models["smollm2-135m-instruct"], DTYPE=SMOLLM2_DTYPE)


@pytest.fixture(scope="session")
def cross_encoder_env(models) -> dict[str, str]:
    """A 1-label sequence classifier: /score and /rerank (and /classify)."""
    return engine_env(models["tiny-cross-encoder"], DTYPE="float32")


@pytest.fixture(scope="session")
def classifier_env(models) -> dict[str, str]:
    """A 3-label sequence classifier (negative/neutral/positive): /classify."""
    return engine_env(models["tiny-classifier"], DTYPE="float32")


@pytest.fixture(scope="session")
def whisper_env(models) -> dict[str, str]:
    """Whisper: /v1/audio/transcriptions and /v1/audio/translations; send 16 kHz audio (other
    rates need PyAV, not installed, to resample: vLLM answers 400)."""
    # MAX_MODEL_LEN=0: derived from the model (max_target_positions, 128), below the CPU default.
    return engine_env(models["tiny-whisper"], DTYPE="float32", MAX_MODEL_LEN="0")


@pytest.fixture(scope="session")
def vlm_env(models) -> dict[str, str]:
    """Idefics3 (SmolVLM's architecture): chat with images as base64 data URLs; local files from the
    models' folder (a flag whose folder vLLM quotes in its errors; not the model's, whose path is
    the name it is served as)."""
    return engine_env(models["tiny-vlm"], ALLOWED_LOCAL_MEDIA_PATH=str(models["tiny-vlm"].parent))


_SESSION_ENGINES: list = []  # session-scoped engines still running


def _stop_session_engines() -> None:
    """Stops the session's engines once the tests that use them (tests/engine's, one group, run in one
    process: tests/parallel.py) are done, rather than when the process ends."""
    while _SESSION_ENGINES:
        _SESSION_ENGINES.pop().shutdown()


def _engine_fixture(env_fixture: str, scope: str = "session"):
    """An engine built from the named env fixture, shut down when its scope ends (a session's, when
    tests/engine's last test has run)."""

    @pytest.fixture(scope=scope)
    def engine(request):
        built = _build_engine(request.getfixturevalue(env_fixture))
        if scope == "session":
            _SESSION_ENGINES.append(built)
        yield built
        if scope == "session":
            if built not in _SESSION_ENGINES:
                return  # stopped already
            _SESSION_ENGINES.remove(built)
        built.shutdown()

    return engine


def _openai_fixture(engine_fixture: str, scope: str = "session"):
    """An OpenAIvLLMEngine over the named engine fixture."""

    @pytest.fixture(scope=scope)
    def openai(request):
        from worker.routes.serving import OpenAIvLLMEngine

        return OpenAIvLLMEngine(request.getfixturevalue(engine_fixture))

    return openai


tiny_engine = _engine_fixture("tiny_env")
smol_engine = _engine_fixture("smol_env")
minilm_engine = _engine_fixture("minilm_env")
tiny_openai = _openai_fixture("tiny_engine")
smol_openai = _openai_fixture("smol_engine")
minilm_openai = _openai_fixture("minilm_engine")
# Models of one test module each: their engines stop with it (memory stays within 24 GiB).
cross_encoder_engine = _engine_fixture("cross_encoder_env", "module")
classifier_engine = _engine_fixture("classifier_env", "module")
whisper_engine = _engine_fixture("whisper_env", "module")
vlm_engine = _engine_fixture("vlm_env", "module")
cross_encoder_openai = _openai_fixture("cross_encoder_engine", "module")
classifier_openai = _openai_fixture("classifier_engine", "module")
whisper_openai = _openai_fixture("whisper_engine", "module")
vlm_openai = _openai_fixture("vlm_engine", "module")


# What the opt-in app turns on: vLLM's flags for routes it serves only when asked, and the env
# var of its responses store (read when the serving classes are built).
OPT_IN_FLAGS = {"enable_scale_out": True, "enable_tokenizer_info_endpoint": True}
OPT_IN_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def opt_in_env() -> dict[str, str]:
    """The opt-in flags and env vars as a worker's environment."""
    return {**{flag.upper(): str(value).lower() for flag, value in OPT_IN_FLAGS.items()}, **OPT_IN_ENV}


def opt_in_app(engine):
    """An OpenAIvLLMEngine over ``engine`` with the opt-in routes on (see OPT_IN_FLAGS/OPT_IN_ENV)."""
    import copy

    from worker.routes.serving import OpenAIvLLMEngine

    namespace = copy.copy(engine.config.args.namespace)
    for flag, value in OPT_IN_FLAGS.items():
        setattr(namespace, flag, value)
    saved = {name: os.environ.get(name) for name in OPT_IN_ENV}
    os.environ.update(OPT_IN_ENV)
    try:
        return OpenAIvLLMEngine(engine, namespace)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_opt_in_openai(tiny_engine):
    """The tiny engine's app with the opt-in routes: scale-out (render, token-in), tokenizer_info
    and the responses store (GET and cancel by id)."""
    return opt_in_app(tiny_engine)


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b))


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``: workers, vLLM's engine processes, the SDK's heartbeat."""
    ps = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for child, parent in (map(int, line.split()) for line in ps.splitlines()):
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie has exited too
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - started


def collect(agen) -> list:
    async def run():
        return [item async for item in agen]

    return asyncio.run(run())


@pytest.fixture
def run_job(monkeypatch):
    """run_job(engine, input) → every item the real ``handler`` yields for that job.

    ``engine`` is a vLLMEngine for raw jobs or an OpenAIvLLMEngine for OpenAI-route jobs.
    """
    import handler

    def run(engine, job_input, job_id: str = "test-job") -> list:
        attribute = "openai_engine" if hasattr(engine, "app") else "vllm_engine"
        monkeypatch.setattr(handler, attribute, engine)
        return collect(handler.handler({"id": job_id, "input": job_input}))

    return run


@pytest.fixture
def run_openai(run_job):
    """run_openai(engine, route, body, **job_keys) → the handler's items for that OpenAI job."""

    def run(engine, route, body=None, **job_keys) -> list:
        return run_job(engine, {"openai_route": route, "openai_input": body, **job_keys})

    return run


# --- the local Hugging Face hub (tests/image/local_hub.py), in this process ---------------------

@pytest.fixture
def hub():
    from tests.image.local_hub import LocalHub

    with LocalHub() as hub:
        yield hub


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """huggingface_hub in this process as if started with HF_ENDPOINT at ``hub`` and HF_HUB_OFFLINE=0
    (tests/conftest.py sets it), its agent-registry cache in tmp_path: it asks no other server."""
    import huggingface_hub.constants

    for name, value in {"HF_HUB_OFFLINE": False, "ENDPOINT": hub.url,
                        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
                        "AGENT_HARNESSES_PATH": str(tmp_path / "agent_harnesses.json")}.items():
        monkeypatch.setattr(huggingface_hub.constants, name, value)
