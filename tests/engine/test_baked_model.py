"""A baked image, end to end on the CPU: download_model.py bakes the tiny model from a local Hugging
Face cache, then the worker, offline and with MODEL_NAME naming the baked repo, serves that copy
under the repo id. Its own engine: one start (~20 s)."""

from __future__ import annotations

import huggingface_hub.constants
from conftest import engine_env
from hub_cache import add_cached_repo
from starts import timed

from worker.model.download_model import bake


def test_the_worker_serves_the_baked_model_offline(models, tmp_path, monkeypatch, run_job):
    from worker.engine.vllm_engine import vLLMEngine
    from worker.config.worker_config import load_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as the image runs
    files = {path.name: path for path in models["tiny-llama"].iterdir() if not path.name.startswith(".")}
    cache = tmp_path / "models"
    add_cached_repo(cache, "org/tiny", files)
    args_file = tmp_path / "local_model_args.json"
    baked = bake({"MODEL_NAME": "org/tiny", "BAKED_MODELS_DIR": str(cache),
                  "LOCAL_MODEL_ARGS_FILE": str(args_file)})

    with timed("engines"):
        engine = vLLMEngine(load_config(engine_env("org/tiny", LOCAL_MODEL_ARGS_FILE=str(args_file))))
    try:
        assert engine.engine_args.model == baked["MODEL_NAME"]
        assert engine.engine_args.served_model_name == ["org/tiny"]
        items = run_job(engine, {"prompt": "the cat reads", "sampling_params": {
            "max_tokens": 4, "ignore_eos": True, "temperature": 0}})
        assert items[-1]["usage"]["output"] == 4
    finally:
        engine.shutdown()
