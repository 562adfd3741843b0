"""``Adapters``: the LoRA adapters one engine serves by name, loaded on first use.

Raw jobs (their ``model``) and vLLM's serving classes (a body's ``model``, through
``vllm_adapter.serve_adapters``) share one registry, so a name is loaded once, under one id. A name
is looked for in the worker's sources (``model/lora_adapters``: the volume, the image, the hub),
then by any LoRA resolver registered with vLLM (its own filesystem and hub plugins, or a user's).
``LORA_MODULES``' adapters, which vLLM loads at start, join the registry when the app is built.

vLLM keeps the adapters it holds within MAX_LORAS (on the GPU, per batch) and MAX_CPU_LORAS (in
memory), evicting the least recently used. Once this worker has known more than it holds, each
request with an adapter loads it again first if it was evicted (``vllm_adapter.keep_adapters_loaded``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from functools import partial
from http import HTTPStatus

from worker.model.lora_adapters import AdapterError, AdapterSources
from worker.vllm_adapter import (
    AsyncLLM,
    LoRARequest,
    keep_adapters_loaded,
    load_adapter,
    max_cpu_loras,
    plugin_adapter,
)
from worker.wire.errors import RequestError

log = logging.getLogger(__name__)

__all__ = ["Adapters"]

# The registry's adapter ids: far above those vLLM gives LORA_MODULES' (1, 2, ...), which may be
# loaded after adapters found here (an app built after raw jobs ran).
FIRST_ID = 1_000_001


class Adapters:
    def __init__(self, llm: AsyncLLM, sources: AdapterSources) -> None:
        self.llm, self.sources = llm, sources
        self.loaded: dict[str, LoRARequest] = {}  # by name; vLLM's ``lora_requests`` once shared
        self._loading: dict[str, asyncio.Future[LoRARequest]] = {}  # one load per name at a time
        self._ids = itertools.count(FIRST_ID)
        self._held = max_cpu_loras(llm)
        keep_adapters_loaded(llm, self._reload)

    async def resolve(self, name: str) -> LoRARequest:
        """The adapter called ``name``, loaded into the engine; raises ``RequestError``: 404 when
        no source has it, 400 when it cannot be served (why), 502 when the hub could not be asked."""
        if (request := self.loaded.get(name)) is not None:
            return request
        if (loading := self._loading.get(name)) is None:
            loading = self._loading[name] = asyncio.ensure_future(self._load(name))
            loading.add_done_callback(partial(self._loaded, name))
        # Shielded: a request cancelled while it waits leaves the load to the others (and the registry).
        return await asyncio.shield(loading)

    def _loaded(self, name: str, loading: asyncio.Future[LoRARequest]) -> None:
        del self._loading[name]
        if not loading.cancelled() and loading.exception() is None:  # retrieved: nobody may wait
            self.loaded[name] = loading.result()

    def available(self) -> list[tuple[str, str]]:
        """The adapters the worker can serve without asking the hub: (name, folder)."""
        return [(adapter.name, str(adapter.path)) for adapter in self.sources.available()]

    async def _load(self, name: str) -> LoRARequest:
        started = time.perf_counter()
        adapter = await asyncio.to_thread(self.sources.find, name)
        if adapter is not None:
            request, source = LoRARequest(name, next(self._ids), str(adapter.path)), adapter.source
        elif (request := await plugin_adapter(self.llm, name)) is not None:
            request.lora_int_id, source = next(self._ids), "a vLLM LoRA resolver"
        else:
            raise RequestError(f"The model `{name}` does not exist.", param="model",
                               status=HTTPStatus.NOT_FOUND)
        if (failure := await load_adapter(self.llm, request)) is not None:
            log.warning("LoRA adapter %s from %s could not be loaded: %s", name, request.lora_path, failure)
            raise AdapterError(name, f"could not be loaded: {failure} (an adapter for another base "
                                     "model, or damaged files?)")
        log.info("LoRA adapter %s loaded from %s (%s) in %.2fs", name, request.lora_path, source,
                 time.perf_counter() - started)
        return request

    async def _reload(self, request: LoRARequest) -> None:
        """Before a request with ``request``'s adapter: load it again if vLLM may have evicted it."""
        if len(self.loaded) <= self._held:
            return  # never more known than held: nothing was evicted
        if (failure := await load_adapter(self.llm, request)) is not None:
            raise AdapterError(request.lora_name, f"could not be loaded again: {failure}")
