"""vLLM's own OpenAI/Anthropic app, built as `vllm serve` builds it around the worker's engine: its
modules imported while the engine starts, no bearer token demanded (RunPod authenticates callers),
adapters found through the worker's registry, and model cards that show no folder of the server's."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import types

from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.engine.async_llm import AsyncLLM

from worker.vllm_adapter.lora import allow_adapters_by_name, serve_adapters

__all__ = ["APP_MODULES", "AuthenticationMiddleware", "build_openai_app", "import_app_modules"]

# vLLM's app and serving classes: needed once the engine is up, so imported only then (the worker
# imports them while the engine starts: import_app_modules).
APP_MODULES = ("vllm.entrypoints.launchers.app", "vllm.entrypoints.launchers.api_server.app_state")


def import_app_modules() -> list:
    """The APP_MODULES, imported (once: later calls find them in ``sys.modules``)."""
    return [importlib.import_module(name) for name in APP_MODULES]


async def build_openai_app(engine: AsyncLLM, namespace: argparse.Namespace, adapters=None,
                           model_root: str | None = None):
    """vLLM's own OpenAI/Anthropic ASGI app with its serving state, as `vllm serve` builds it;
    ``adapters`` (``engine/adapters.Adapters``): the registry its serving classes find adapters in;
    ``model_root``: the served model's root in ``/v1/models`` (``show_model_roots``).

    Like `vllm serve`'s app start-up, this freezes the start-up heap out of the garbage collector:
    otherwise each full collection while serving walks vLLM's and torch's ~600k start-up objects
    (a 0.35 s pause on the CPU machines).
    """
    app_module, state_module = import_app_modules()
    supported_tasks = await engine.get_supported_tasks()
    root = logging.getLogger()
    level = root.level
    try:
        app = app_module.build_app(namespace, supported_tasks, engine.model_config)
    finally:
        # Building it imports model_hosting_container_standards (vLLM's SageMaker routes), which sets
        # the root logger to $LOG_LEVEL or else ERROR: that would silence the worker's own logs.
        root.setLevel(level)
    # RunPod authenticates callers; a VLLM_API_KEY in the environment would make vLLM demand a
    # bearer token that jobs never carry. (vLLM has already built the stack: build it again.)
    app.user_middleware = [m for m in app.user_middleware if m.cls is not AuthenticationMiddleware]
    app.middleware_stack = app.build_middleware_stack()
    await state_module.init_app_state(engine, app.state, namespace, supported_tasks)
    # vLLM's handler of an engine's error asks uvicorn's server to exit if the engine died; no uvicorn
    # serves this app (the worker notices a dead engine itself), so the request gets its own error.
    app.state.server = types.SimpleNamespace(should_exit=False)
    if models := getattr(app.state, "openai_serving_models", None):
        if adapters is not None:
            serve_adapters(models, adapters.resolve, adapters.loaded, adapters.available)
            allow_adapters_by_name()
        show_model_roots(models, model_root)
    freeze_gc_heap()
    return app


def show_model_roots(models, root: str | None) -> None:
    """``/v1/models`` (vLLM's ``OpenAIServingModels``) shows no folder of the server's: vLLM's card
    ``root`` is the path it loaded the model or an adapter from. The served model's root becomes
    ``root`` (the repo id the user named, whose copy is served), other absolute ones the card's id."""
    show = models.show_available_models
    served_from = {path.model_path for path in models.base_model_paths}

    async def show_available_models():
        listed = await show()
        for card in listed.data:
            if root and card.root in served_from:
                card.root = root
            elif card.root and os.path.isabs(card.root):
                card.root = card.id
        return listed

    models.show_available_models = show_available_models

