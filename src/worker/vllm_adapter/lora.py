"""LoRA adapters by name, through vLLM (``engine/adapters`` holds the worker's registry): vLLM's
serving classes find adapters in that registry and list them in ``/v1/models``; an adapter is loaded
into the engine, again before a request when vLLM evicted it, so that a failure fails that request
alone; and vLLM's own LoRA resolvers are asked for a name."""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from http import HTTPStatus

from vllm import SamplingParams
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard, ModelPermission
from vllm.exceptions import GracefulHTTPError
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolverRegistry
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from worker.vllm_adapter.engine_env import reread_envs
from worker.vllm_adapter.errors import vllm_error_response
from worker.wire.errors import RequestError

__all__ = ["allow_adapters_by_name", "keep_adapters_loaded", "load_adapter", "LoRARequest", "LoRAResolverRegistry",
           "max_cpu_loras", "plugin_adapter", "ResolveAdapter", "serve_adapters"]

# What a registry of adapters offers vLLM's serving classes (engine/adapters.Adapters).
ResolveAdapter = Callable[[str], Awaitable[LoRARequest]]  # raises RequestError with its status


def allow_adapters_by_name() -> None:
    """Lets vLLM's serving classes ask for an adapter they do not know (``resolve_lora``), as
    `vllm serve` does with VLLM_ALLOW_RUNTIME_LORA_UPDATING, which they read at each request. Set
    once the app is built: read then, it would add vLLM's load and unload routes (which no job may
    call) and a warning that they are on. vLLM caches its variables in a process that ran an
    engine core: the cache is made again."""
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    reread_envs()


def max_cpu_loras(llm: AsyncLLM) -> int:
    """How many adapters the engine holds in memory (MAX_CPU_LORAS, else MAX_LORAS); 0 without LoRA."""
    lora = llm.vllm_config.lora_config
    return (lora.max_cpu_loras or lora.max_loras) if lora else 0


async def load_adapter(llm: AsyncLLM, request: LoRARequest) -> str | None:
    """Loads an adapter into the engine (again, when it was evicted); None when it is held, else
    why vLLM could not load it (its failure stays in this call: the engine serves on)."""
    try:
        await llm.add_lora(request)
    except EngineDeadError:
        raise
    except Exception as exc:  # noqa: BLE001 - vLLM wraps the worker's error in a plain Exception
        message = str(exc)
        return match.group(1) if (match := re.search(r"Worker failed with error '(.*)', please", message)) \
            else message
    return None


async def plugin_adapter(llm: AsyncLLM, name: str) -> LoRARequest | None:
    """The adapter a LoRA resolver registered with vLLM finds (vLLM's filesystem or hub resolver,
    when their VLLM_LORA_RESOLVER_* variables are set, or a user's plugin); None if none does."""
    for resolver_name in sorted(LoRAResolverRegistry.get_supported_resolvers()):
        resolver = LoRAResolverRegistry.get_resolver(resolver_name)
        if (request := await resolver.resolve_lora(llm.model_config.model, name)) is not None:
            return request
    return None


def serve_adapters(models, resolve: ResolveAdapter, loaded: dict[str, LoRARequest],
                   available: Callable[[], Awaitable[list[str]]]) -> None:
    """Makes vLLM's ``OpenAIServingModels`` (one app's) find adapters through the worker's registry:
    its adapters (``LORA_MODULES``', loaded already) join ``loaded``, which it then shares;
    ``resolve_lora`` asks ``resolve``; ``/v1/models`` also lists ``available()``'s names, once each
    (``loaded`` holds other spellings too)."""
    loaded.update(models.lora_requests)
    models.lora_requests = loaded

    async def resolve_lora(name: str) -> LoRARequest | ErrorResponse:
        try:
            return await resolve(name)
        except RequestError as exc:
            status = HTTPStatus(exc.status)
            if status not in (HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND):
                raise GracefulHTTPError(str(exc), status) from None  # vLLM reads 400 and 404 only
            return vllm_error_response(str(exc), status_code=status, param="model",
                                       err_type="NotFoundError" if status == HTTPStatus.NOT_FOUND
                                       else "BadRequestError")

    show_loaded = models.show_available_models

    async def show_available_models():
        listed = await show_loaded()
        cards = {card.id: card for card in listed.data}
        base = models.base_model_paths[0].name
        cards.update((name, ModelCard(id=name, root=name, parent=base, permission=[ModelPermission()]))
                     for name in await available() if name not in cards)
        listed.data = list(cards.values())
        return listed

    models.resolve_lora = resolve_lora
    models.show_available_models = show_available_models


def keep_adapters_loaded(llm: AsyncLLM, reload: Callable[[LoRARequest], Awaitable[None]]) -> None:
    """Every ``llm.generate`` with an adapter awaits ``reload(adapter)`` first. vLLM loads an
    adapter it evicted again inside an engine step, where a failure (its files changed or gone)
    would kill the engine; loaded here, it fails this request alone."""
    generate = llm.generate

    async def generate_with_adapter(prompt, sampling_params: SamplingParams, request_id: str, *args,
                                    lora_request: LoRARequest | None = None, **kwargs):
        if lora_request is not None:
            await reload(lora_request)
        async with aclosing(generate(prompt, sampling_params, request_id, *args,
                                     lora_request=lora_request, **kwargs)) as outputs:
            async for output in outputs:
                yield output

    llm.generate = generate_with_adapter
