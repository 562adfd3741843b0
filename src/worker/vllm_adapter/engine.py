"""vLLM's engine, AsyncLLM, started as `vllm serve` starts it, with the load tap (the scheduler's
state after each step, for adaptive concurrency) and without Prometheus metrics; what the running
engine says of itself (its KV cache's size, its batch, whether it died); and the types it takes and
gives."""

from __future__ import annotations

from collections.abc import Callable

from vllm import AsyncEngineArgs, TokensPrompt
from vllm.config import VllmConfig
from vllm.outputs import RequestOutput
from vllm.pooling_params import PoolingParams
from vllm.tasks import POOLING_TASKS
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine import FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import AggregateStatLoggerBase, PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats

from worker.vllm_adapter.engine_env import engine_process_env

__all__ = ["AsyncLLM", "is_dead", "kv_cache_size", "LoadObserver", "max_num_seqs", "POOLING_TASKS",
           "PoolingParams", "RequestOutput", "start_engine", "TokensPrompt"]


# What the engine reports after each step (``start_engine``'s ``on_load``), as keyword arguments:
# running, waiting, kv_usage (0-1), the requests started, finished and preempted in that step, and
# those that finished (not aborted) as (prompt tokens, output tokens, max_tokens, prompt tokens found
# in the prefix cache).
LoadObserver = Callable[..., None]
_NO_OUTPUT = IterationStats()  # a step that produced no output started and finished nothing
_ENDED_EARLY = frozenset({FinishReason.ABORT, FinishReason.ERROR})  # their length says nothing


def _load_tap(on_load: LoadObserver) -> type[AggregateStatLoggerBase]:
    """A stat logger handing ``on_load`` vLLM's scheduler state after each engine step (in the
    engine's output handler: a few attribute reads). With data parallelism each engine reports on
    its own: the counts are summed over the engines' latest reports and the KV usage averaged."""

    class LoadTap(AggregateStatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
            self.latest = {index: (0, 0, 0.0) for index in engine_indexes}

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
            if scheduler_stats is None:
                return
            self.latest[engine_idx] = (scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                                       scheduler_stats.kv_cache_usage)
            running, waiting, kv_usage = (sum(column) for column in zip(*self.latest.values(), strict=True))
            step = iteration_stats or _NO_OUTPUT
            finished = step.finished_requests
            on_load(running=running, waiting=waiting, kv_usage=kv_usage / len(self.latest),
                    # first tokens: a preempted request that resumes is not counted again
                    started=len(step.time_to_first_tokens_iter), finished=len(finished),
                    preempted=step.num_preempted_reqs,
                    outputs=tuple((f.num_prompt_tokens, f.num_generation_tokens, f.max_tokens_param,
                                   f.num_cached_tokens) for f in finished if f.finish_reason not in _ENDED_EARLY))

        def log_engine_initialized(self) -> None:
            pass

    return LoadTap


def start_engine(vllm_config: VllmConfig, engine_args: AsyncEngineArgs,
                 on_load: LoadObserver | None = None) -> AsyncLLM:
    """AsyncLLM as `vllm serve` builds it, from the configuration made by
    ``engine_config.create_engine_config`` (on the CPU, with its compiled kernels kept as a cache
    entry: ``engine_env``; without Prometheus metrics); ``on_load`` gets the scheduler's state after
    each step (see ``_load_tap``): vLLM then collects statistics even with ``disable_log_stats``
    (without logging them)."""
    engine_process_env(vllm_config)
    llm = AsyncLLM.from_vllm_config(
        vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
        stat_loggers=[_load_tap(on_load)] if on_load else None)
    _drop_prometheus(llm)
    return llm


def is_dead(llm: AsyncLLM) -> bool:
    """True once the engine has failed for good (its processes died): the worker must be replaced."""
    return llm.errored


def kv_cache_size(llm: AsyncLLM) -> tuple[int, int, int, bool] | None:
    """The KV cache's usable blocks (over data-parallel engines; less each one's null block, which
    vLLM keeps out of use), the tokens a block holds, the model's context length, and whether vLLM
    caches prefixes (a request's sequences then share its prompt's whole blocks). None when a
    request does not hold a block per ``block_size`` tokens of its own in every layer: sliding-window
    attention, state-space layers (hybrid models), no attention, an encoder-decoder's cross-attention."""
    config = llm.vllm_config
    model = config.model_config
    if (model.is_attention_free or model.is_hybrid or model.is_encoder_decoder
            or model.get_sliding_window() is not None):
        return None
    engines = config.parallel_config.data_parallel_size
    return ((config.cache_config.num_gpu_blocks or 0) - engines, config.cache_config.block_size,
            config.model_config.max_model_len, bool(config.cache_config.enable_prefix_caching))


def _drop_prometheus(llm: AsyncLLM) -> None:
    """Stops vLLM's Prometheus metrics, which it records whenever it collects statistics (samples of
    every token's latency, about 18 µs of the front end's CPU per token here) for a ``/metrics``
    route the worker does not serve."""
    if llm.logger_manager is not None:
        loggers = llm.logger_manager.stat_loggers
        loggers[:] = [logger for logger in loggers if not isinstance(logger, PrometheusStatLogger)]


def max_num_seqs(llm: AsyncLLM) -> int:
    """How many requests the engine runs at once at most (resolved by vLLM): one step's batch, on
    each data-parallel engine."""
    config = llm.vllm_config
    return config.scheduler_config.max_num_seqs * config.parallel_config.data_parallel_size

