"""Item 21: many LoRA adapters served by name (``src/worker/engine/adapters.py``), beside ``vllm serve``.

``ADAPTERS`` random adapters (``scripts/build_models.build_lora``: rank ``RANK`` on q_proj and v_proj)
in one folder: the worker finds them there through LORA_DIRS, ``vllm serve`` through its filesystem
resolver; both load an adapter on its first use. Both run ``plan.latency_model`` in its own dtype with
MAX_LORAS = ``ADAPTERS`` (all of them in one batch) and the same KV cache and max_model_len. Each
repetition starts each side afresh, in turn, and on it:

- first use: sequential openai SDK chats of ``plan.first_max_tokens`` tokens, all with the same prompt:
  the base model, then one adapter (the engine's first request, then its first adapter), then each
  other adapter twice, never used and used: the latencies and what the first use adds;
- load: vLLM's load generator (as item 6) at ``CONCURRENCY`` concurrent requests, ``PROMPTS`` chats
  of ``plan.max_tokens`` tokens, each naming the next adapter (``--lora-assignment round-robin``),
  and the same naming the base model, in turn. Every adapter was used before: no load is timed here.

Figures: output tokens/s and median TTFT of each load; worker ÷ ``vllm serve`` with adapters and with
the base model; adapters ÷ base model on each side; the first-use latencies.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import VLLM_SERVE, WORKER, Plan, Results, in_turn, model_env
from bench.job_start import vllm_bench_result
from bench.openai_path import chat, openai_client
from bench.servers import Endpoint, Server, VllmServe

ITEM = "21 many LoRA adapters"
ADAPTERS, RANK = 8, 8
NAMES = tuple(f"adapter-{i}" for i in range(ADAPTERS))
CONCURRENCY, PROMPTS = 16, 64
WITH_ADAPTERS, BASE = f"{ADAPTERS} adapters", "base model"
# `vllm serve` finds adapters by name through vLLM's filesystem resolver, a general plugin.
# VLLM_PLUGINS loads it alone: the only other one installed is the hub resolver, unused here.
RESOLVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_PLUGINS": "lora_filesystem_resolver"}


@dataclass(frozen=True)
class Side:
    """What one fresh server measured: first-use latencies (label → ms), vllm bench results by load."""

    first_use: dict[str, float]
    loads: dict[str, dict]


def run(plan: Plan, results: Results) -> None:
    worker_env, serve_env = _envs(plan)
    sides = {WORKER: (Endpoint, worker_env), VLLM_SERVE: (VllmServe, serve_env)}
    for rep in range(plan.reps):
        done = in_turn(rep, {name: lambda kind=kind, env=env: _on_fresh(kind, env, rep, plan)
                             for name, (kind, env) in sides.items()})
        _record(plan.latency_model, done, results)


def _envs(plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """The worker's environment and `vllm serve`'s: the same engine flags, the same adapters."""
    from build_models import build_lora  # in scripts/, which bench.common puts on the import path

    env = {**model_env(plan.latency_model, plan), "ENABLE_LORA": "true", "MAX_LORAS": str(ADAPTERS),
           "MAX_LORA_RANK": str(RANK)}
    env.pop("MAX_CONCURRENCY")  # each side's own default, as in item 20
    env.pop("DTYPE", None)  # the model's own (bfloat16), as in item 20
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-adapters-"))
    for seed, name in enumerate(NAMES):
        # Their configs name the model by the path both servers get: vllm serve's resolver requires it.
        build_lora(Path(env["MODEL_NAME"]), folder / name, seed=seed, rank=RANK)
    return ({**env, "LORA_DIRS": str(folder)},
            {**env, **RESOLVER_ENV, "VLLM_LORA_RESOLVER_CACHE_DIR": str(folder)})


def _on_fresh(kind: type[Server], env: dict[str, str], rep: int, plan: Plan) -> Side:
    logs = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    server = kind(env, logs / "server.log")
    try:
        first_use = _first_use(server.base_url, env["MODEL_NAME"], plan.first_max_tokens)
        loads = in_turn(rep, {WITH_ADAPTERS: lambda: _load(server, env, NAMES, plan.max_tokens),
                              BASE: lambda: _load(server, env, (), plan.max_tokens)})
        return Side(first_use, loads)
    finally:
        server.stop()


def _first_use(base_url: str, model: str, max_tokens: int) -> dict[str, float]:
    async def ms(client, name: str) -> float:
        return (await chat(client, name, 0, max_tokens)).latency * 1000

    async def run() -> dict[str, float]:
        async with openai_client(base_url) as client:
            await ms(client, model)  # the engine's first request: not an adapter's cost
            first_adapter = await ms(client, NAMES[0])
            pairs = [(await ms(client, name), await ms(client, name)) for name in NAMES[1:]]
        return {"first adapter on a fresh server": first_adapter,
                "an adapter's first use": statistics.median(first for first, _ in pairs),
                "the same adapter used again": statistics.median(again for _, again in pairs),
                "added by an adapter's first use": statistics.median(first - again for first, again in pairs)}

    return asyncio.run(run())


def _load(server: Server, env: dict[str, str], adapters: tuple[str, ...], output_tokens: int) -> dict:
    lora = ("--lora-modules", *adapters, "--lora-assignment", "round-robin") if adapters else ()
    return vllm_bench_result(server, env["MODEL_NAME"], CONCURRENCY, PROMPTS, output_tokens, more=lora)


def _record(model: str, sides: dict[str, Side], results: Results) -> None:
    def tokens_per_s(side: str, load: str) -> float:
        return sides[side].loads[load]["output_throughput"]

    for name, side in sides.items():
        for label, ms in side.first_use.items():
            results.figure(ITEM, model, f"{label}, {name}", "ms").values.append(ms)
        for load, result in side.loads.items():
            results.figure(ITEM, model, f"output tokens/s, {name}, {load} @{CONCURRENCY}",
                           "tokens/s").values.append(result["output_throughput"])
            results.figure(ITEM, model, f"median TTFT, {name}, {load} @{CONCURRENCY}", "ms").values.append(
                result["median_ttft_ms"])
        results.figure(ITEM, model, f"output tokens/s {WITH_ADAPTERS} ÷ {BASE}, {name}").values.append(
            tokens_per_s(name, WITH_ADAPTERS) / tokens_per_s(name, BASE))
    for load, goal in ((WITH_ADAPTERS, ("≥", 0.95)), (BASE, None)):
        results.figure(ITEM, model, f"output tokens/s worker ÷ vllm serve, {load} @{CONCURRENCY}",
                       goal=goal).values.append(tokens_per_s(WORKER, load) / tokens_per_s(VLLM_SERVE, load))
