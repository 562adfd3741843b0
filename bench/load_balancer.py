"""Item 22: the load-balancing endpoint (``endpoint/balancer.py`` in front of a worker serving HTTP,
``src/worker/load_balancer/``), beside ``vllm serve`` and beside queue mode.

Four servers of ``plan.latency_model`` with the same engine flags (``model_env``, as item 6, but a KV
cache of ``KV_CACHE`` that holds 64 of these requests whole), each with one engine, all up at once and
started afresh for each repetition (item 6's ``job_start.loads_in_turn``):

- ``vllm serve``;
- the local balancer (``python -m endpoint --load-balancer``, one worker): requests at its own
  ``/v1/chat/completions``, relayed to the worker's HTTP server;
- that worker alone (``src/handler.py`` with ``ENDPOINT_TYPE=load_balancer``), called on its ``PORT``:
  what the balancer adds is the balancer's own cost, the rest the worker's;
- the local queue endpoint (``python -m endpoint``, one worker: item 6's path, untraced), requests at
  ``/v2/local/openai/v1/chat/completions``, each a job.

Load: item 6's (``job_start.loads_in_turn``: vLLM's load generator, random 64-token prompts,
``plan.max_tokens`` out with ``--ignore-eos``, max(16, 2n) chats), warmed up first, at each of
``plan.concurrency``, on each server in turn while the others idle, ``plan.reps`` times. Figures:
vllm bench's median TTFT and output tokens/s of each path; their ratios, each path ÷ ``vllm serve``
(the balancer's goal: within 5 % on both), the balancer ÷ queue mode and the balancer ÷ its worker alone.

The KV cache: this item measures the HTTP paths. With the tests' 256 MiB (11,008 tokens) the load at 64
does not fit whole; the worker then admits requests as they fit (item 13's admission, in both modes)
where ``vllm serve`` admits them all and preempts, and that policy's cost in tokens/s (item 13, and the
README's concurrency table) would be counted as the path's.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from bench.common import VLLM_SERVE, Load, Plan, Results, model_env
from bench.job_start import loads_in_turn
from bench.servers import Balancer, BalancerWorker, Endpoint, Server, VllmServe

ITEM = "22 load balancer (vllm bench)"
KV_CACHE = "1g"  # 44,000 tokens of SmolLM2: 64 requests of 64 + 128 tokens need 16,384 (128-token blocks)
BALANCER, ALONE, QUEUE = "load balancer", "LB worker alone", "queue endpoint"
SERVERS: dict[str, type[Server]] = {VLLM_SERVE: VllmServe, BALANCER: Balancer, ALONE: BalancerWorker,
                                    QUEUE: Endpoint}
# The ratios, (numerator, denominator); the goals apply to the first one's: within 5 % of vllm serve.
RATIOS = ((BALANCER, VLLM_SERVE), (QUEUE, VLLM_SERVE), (ALONE, VLLM_SERVE), (BALANCER, QUEUE), (BALANCER, ALONE))
FIGURES = {"TTFT": (lambda load: load.ttft, ("≤", 1.05)),
           "tokens/s": (lambda load: load.tokens_per_s, ("≥", 0.95))}


def run(plan: Plan, results: Results) -> None:
    model = plan.latency_model
    env = {**model_env(model, plan), "KV_CACHE_MEMORY_BYTES": KV_CACHE}
    logs = Path(tempfile.mkdtemp(prefix=f"bench-lb-{model}-"))
    starts = {name: functools.partial(kind, env, logs / f"{name.replace(' ', '-')}.log")
              for name, kind in SERVERS.items()}
    for n, loads in loads_in_turn(starts, plan):
        _record(model, n, loads, results)


def _record(model: str, n: int, loads: dict[str, Load], results: Results) -> None:
    for path, load in loads.items():
        results.balancer_loads.setdefault((model, path, n), []).append(load)
    for a, b in RATIOS:
        for figure, (value, goal) in FIGURES.items():
            results.figure(ITEM, model, f"{figure} {a} ÷ {b} @{n}",
                           goal=goal if (a, b) == RATIOS[0] else None).values.append(
                value(loads[a]) / value(loads[b]))
