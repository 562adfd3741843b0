"""Shared fixtures: offline models and one engine per model for the whole session.

vLLM on the CPU needs a few process-wide settings, set here before vLLM is imported.
Engines are session-scoped (an engine start costs ~20 s); each owns its own event loop
(see src/event_loop.py), so tests drive them with plain ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

import pytest
from dotenv import dotenv_values

REPO = Path(__file__).resolve().parents[1]
MODELS_ROOT = REPO / ".cache" / "models"

# The same CPU settings as scripts/serve.sh (process-wide vLLM settings and engine flags).
CPU_ENV = {**dotenv_values(REPO / "scripts" / "cpu-dev.env"),
           "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(prefix="vllm-rpc-"),
           "DISABLE_LOG_STATS": "true"}
for _name, _value in CPU_ENV.items():
    os.environ.setdefault(_name, _value)

# In bfloat16 the dequantised SmolLM2 is on a knife edge for "What is the capital of France?"
# (first token "L" 0.160 vs "The" 0.141 on this CPU); float32 answers "Paris", as transformers does.
SMOLLM2_DTYPE = "float32"

sys.path.insert(0, str(REPO / "scripts"))


@pytest.fixture(scope="session")
def models() -> dict[str, Path]:
    from build_models import build_all

    return build_all(MODELS_ROOT)


def engine_env(model: Path, **extra: str) -> dict[str, str]:
    """A complete worker environment for ``model``; no file layers unless given."""
    return {"MODEL_NAME": str(model), **CPU_ENV,
            "VLLM_CONFIG_FILE": "/nonexistent/vllm_config.yaml",
            "LOCAL_MODEL_ARGS_FILE": "/nonexistent/local_model_args.json", **extra}


def _build_engine(env: dict[str, str]):
    from engine import vLLMEngine
    from settings import load_config

    return vLLMEngine(load_config(env))


@pytest.fixture(scope="session")
def tiny_engine(models):
    engine = _build_engine(engine_env(models["tiny-llama"]))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def smol_engine(models):
    engine = _build_engine(engine_env(models["smollm2-135m-instruct"], DTYPE=SMOLLM2_DTYPE))
    yield engine
    engine.shutdown()


def collect(agen) -> list:
    async def run():
        return [item async for item in agen]

    return asyncio.run(run())


@pytest.fixture
def run_job(monkeypatch):
    """run_job(engine, input) → every item the real ``handler`` yields for that job."""
    import handler

    def run(engine, job_input, job_id: str = "test-job") -> list:
        monkeypatch.setattr(handler, "vllm_engine", engine)
        return collect(handler.handler({"id": job_id, "input": job_input}))

    return run
