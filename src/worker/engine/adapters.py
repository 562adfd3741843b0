"""``Adapters``: the LoRA adapters one engine serves by name, loaded on first use.

Raw jobs (their ``model``) and vLLM's serving classes (a body's ``model``, through
``vllm_adapter/lora.serve_adapters``) share one registry, so a name is loaded once, under one id. A name
is looked for in the worker's sources (``model/lora_adapters``: the volume, the image, the hub),
then by any LoRA resolver registered with vLLM (its own filesystem and hub plugins, or a user's).
``LORA_MODULES``' adapters, which vLLM loads at start, join the registry when the app is built.

Every name meets the adapter-name rule first (``adapter_files.NAME``), on every path, vLLM's
resolvers included: ``/abs/dir`` or ``../x`` would reach folders outside a resolver's, and whether
such a folder exists must not show. A name no source has, or one a resolver fails on, is one 404.
A hub adapter named in another case than the hub's is served as the hub's (one adapter, one slot),
its spelling kept as an alias (``MAX_ALIASES``). Finding (folders, the hub's downloads) runs in a
thread pool of the registry's own, apart from the one prompts are tokenised in.

vLLM keeps the adapters it holds within MAX_LORAS (on the GPU, per batch) and MAX_CPU_LORAS (in
memory), evicting the least recently used. Once this worker has known more than it holds, each
request with an adapter loads it again first if it was evicted
(``vllm_adapter/lora.keep_adapters_loaded``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http import HTTPStatus

from worker.model.adapter_files import NAME
from worker.model.lora_adapters import AdapterError, AdapterSources
from worker.vllm_adapter.engine import AsyncLLM
from worker.vllm_adapter.lora import (
    LoRARequest,
    keep_adapters_loaded,
    load_adapter,
    max_cpu_loras,
    plugin_adapter,
)
from worker.wire.errors import RequestError
from worker.wire.redact import answer_text

log = logging.getLogger(__name__)

__all__ = ["Adapters"]

# The registry's adapter ids: far above those vLLM gives LORA_MODULES' (1, 2, ...), which may be
# loaded after adapters found here (an app built after raw jobs ran).
FIRST_ID = 1_000_001
MAX_ALIASES = 256  # other spellings of hub adapters kept; past them, a request must use the hub's
LISTING_SECONDS = 10.0  # /v1/models walks the adapter folders at most this often
FINDERS = 4  # threads finding adapters (a hub download holds one)


class Adapters:
    def __init__(self, llm: AsyncLLM, sources: AdapterSources) -> None:
        self.llm, self.sources = llm, sources
        self.loaded: dict[str, LoRARequest] = {}  # by name; vLLM's ``lora_requests`` once shared
        self._loading: dict[str, asyncio.Future[LoRARequest]] = {}  # one load per name at a time
        self._aliases: set[str] = set()  # names in ``loaded`` that are another's spelling
        self._ids = itertools.count(FIRST_ID)
        self._held = max_cpu_loras(llm)
        self._finders = ThreadPoolExecutor(FINDERS, thread_name_prefix="lora-adapters")
        self._listing: tuple[float, list[str]] | None = None  # (when, names) of the last folder walk
        self._listing_lock = asyncio.Lock()
        keep_adapters_loaded(llm, self._reload)

    async def resolve(self, name: str) -> LoRARequest:
        """The adapter called ``name``, loaded into the engine; raises ``RequestError``: 404 when
        no source has it, 400 when it cannot be served (why), 502 when the hub could not be asked."""
        if (request := self.loaded.get(name)) is not None:
            return request
        if not NAME.fullmatch(name):
            raise _unknown(name)
        if (loading := self._loading.get(name)) is None:
            loading = self._loading[name] = asyncio.ensure_future(self._load(name))
            loading.add_done_callback(partial(self._loaded, name))
        # Shielded: a request cancelled while it waits leaves the load to the others (and the registry).
        return await asyncio.shield(loading)

    def _loaded(self, name: str, loading: asyncio.Future[LoRARequest]) -> None:
        del self._loading[name]
        if not loading.cancelled() and loading.exception() is None:  # retrieved: nobody may wait
            self.loaded[name] = loading.result()

    async def available(self) -> list[str]:
        """The names of the adapters the worker can serve without asking the hub, from a walk of the
        folders (in the registry's threads) at most ``LISTING_SECONDS`` old."""
        async with self._listing_lock:
            if self._listing is None or time.monotonic() - self._listing[0] > LISTING_SECONDS:
                found = await asyncio.get_running_loop().run_in_executor(self._finders, self.sources.available)
                self._listing = (time.monotonic(), [adapter.name for adapter in found])
            return self._listing[1]

    async def _load(self, name: str) -> LoRARequest:
        started = time.perf_counter()
        adapter = await asyncio.get_running_loop().run_in_executor(self._finders, self.sources.find, name)
        if adapter is not None and adapter.name != name:  # a hub adapter, in another case than the hub's
            return await self._alias(name, adapter.name)
        if adapter is not None:
            request, source = LoRARequest(name, next(self._ids), str(adapter.path)), adapter.source
        elif (request := await self._from_resolvers(name)) is not None:
            request.lora_int_id, source = next(self._ids), "a vLLM LoRA resolver"
        else:
            raise _unknown(name)
        if (failure := await load_adapter(self.llm, request)) is not None:
            log.warning("LoRA adapter %s from %s could not be loaded: %s", name, request.lora_path, failure)
            raise AdapterError(name, f"could not be loaded: {answer_text(failure)} (an adapter for another "
                                     "base model, or damaged files? The worker's log has the details)")
        log.info("LoRA adapter %s loaded from %s (%s) in %.2fs", name, request.lora_path, source,
                 time.perf_counter() - started)
        return request

    async def _alias(self, name: str, spelt: str) -> LoRARequest:
        """The adapter the hub spells ``spelt``, also known as ``name`` from now on."""
        if len(self._aliases) >= MAX_ALIASES:
            raise AdapterError(name, f"is spelt '{spelt}' on the hub: name it so")
        request = await self.resolve(spelt)
        self._aliases.add(name)
        return request

    async def _from_resolvers(self, name: str) -> LoRARequest | None:
        """What vLLM's resolvers find; a resolver's failure (a folder it cannot read) is logged and
        answered as a name not found, so that it tells a caller nothing of the disk."""
        try:
            return await plugin_adapter(self.llm, name)
        except Exception:  # noqa: BLE001 - any resolver's, a user's plugin included
            log.warning("LoRA adapter %s: a vLLM LoRA resolver failed", name, exc_info=True)
            return None

    async def _reload(self, request: LoRARequest) -> None:
        """Before a request with ``request``'s adapter: load it again if vLLM may have evicted it."""
        if len(self.loaded) - len(self._aliases) <= self._held:
            return  # never more known than held: nothing was evicted
        if (failure := await load_adapter(self.llm, request)) is not None:
            log.warning("LoRA adapter %s from %s could not be loaded again: %s", request.lora_name,
                        request.lora_path, failure)
            raise AdapterError(request.lora_name, f"could not be loaded again: {answer_text(failure)}")


def _unknown(name: str) -> RequestError:
    return RequestError(f"The model `{name}` does not exist.", param="model", status=HTTPStatus.NOT_FOUND)
