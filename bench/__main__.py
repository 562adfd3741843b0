"""Runs the benchmarks and prints one table: ``python -m bench [--quick] [--parts ...] [--out DIR]``.

Parts (items of the benchmark issue): ``stub`` (4: worker cost per token, no model), ``engine``
(1: handler() ÷ AsyncLLM.generate), ``openai`` (2: worker ÷ vllm serve through the openai SDK,
3: first request, 5: start-up), ``latency`` (6-9: job start, before and after the worker's job loop,
on ``Plan.latency_model`` and the stub worker), ``start`` (10-12: start-up beside ``vllm serve``, the
compile cache cold and warm, weight load formats, on ``Plan.latency_model``), ``concurrency`` (13-16:
adaptive concurrency beside ``vllm serve`` and a fixed 30, two workers under a burst, a small KV cache,
the controller's cost), ``image`` (17-19: the CPU image built with buildah, cold and cached, its
layers, its start-up beside the checkout's), ``kv`` (20: under KV pressure beside ``vllm serve``, with 0
and 100 ms of job-take delay), ``lora`` (21: many LoRA adapters by name beside ``vllm serve``, their
first use), ``lb`` (22: the load-balancing endpoint beside ``vllm serve``, queue mode and its worker
alone), ``cache`` (23: a start from RunPod's read-only model cache beside one from a network-volume copy). A run writes its parts' sections of ``bench/RESULTS.md`` (keeping the other parts' sections)
and their charts; ``--quick`` (tiny model, short streams, two repetitions) writes them to a temporary
folder instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import (adaptive_concurrency, cold_start, common, handler_overhead, image_build, job_start,
                   kv_pressure, load_balancer, lora_adapters, model_cache, openai_path, report, stub_cost)
from bench.common import PARTS



def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, short streams")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--models", help="comma-separated model folders under .cache/models")
    parser.add_argument("--out", type=Path, help="folder for RESULTS.md and the chart")
    parser.add_argument("--dtype", help="every model's dtype (DTYPE), instead of its own (bfloat16)")
    parser.add_argument("--concurrency", help="comma-separated concurrent streams, instead of 1,16,64")
    parser.add_argument("--reps", type=int, help="repetitions of each item's loads (a noisy figure's spread "
                                                 "shrinks with more), instead of 3")
    args = parser.parse_args()
    if unknown := set(args.parts.split(",")) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return args


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def main() -> None:
    args = _parse()
    plan = common.QUICK if args.quick else common.Plan()
    if args.models:
        plan = dataclasses.replace(plan, models=tuple(args.models.split(",")))
    if args.dtype:
        plan = dataclasses.replace(plan, dtype=args.dtype)
    if args.concurrency:
        plan = dataclasses.replace(plan, concurrency=tuple(int(n) for n in args.concurrency.split(",")))
    if args.reps:
        plan = dataclasses.replace(plan, reps=args.reps)
    parts = args.parts.split(",")
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else common.REPO / "bench")
    results = common.Results(plan)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    if "stub" in parts:
        _progress("item 4, worker cost per token (stub, no model)")
        stub_cost.run(plan, results)
    for model in plan.models:
        if "engine" in parts:
            _progress(f"item 1, handler() ÷ AsyncLLM.generate on {model}")
            handler_overhead.run(model, plan, results)
        if "openai" in parts:
            _progress(f"items 2, 3, 5, worker ÷ vllm serve, first request, start-up on {model}")
            openai_path.run(model, plan, results)
    if "latency" in parts:
        _progress("items 7, 8, 9, job slots and where a job's first byte waits (stub worker)")
        job_start.run_stub(plan, results)
        _progress(f"items 6, 9, job path ÷ vllm serve (vllm bench), first byte on {plan.latency_model}")
        job_start.run_model(plan, results)
    if "concurrency" in parts:
        _progress(f"items 13-16, adaptive concurrency beside vllm serve on {plan.latency_model}, "
                  "two workers, a small KV cache, the controller's cost")
        adaptive_concurrency.run(plan, results)
    if "kv" in parts:
        _progress(f"item 20, under KV pressure beside vllm serve on {plan.latency_model}, 0 and "
                  f"{kv_pressure.TAKE_DELAY * 1000:.0f} ms job take")
        kv_pressure.run(plan, results)
    if "lora" in parts:
        _progress(f"item 21, {lora_adapters.ADAPTERS} LoRA adapters by name beside vllm serve on "
                  f"{plan.latency_model}, their first use")
        lora_adapters.run(plan, results)
    if "lb" in parts:
        _progress(f"item 22, the load balancer beside vllm serve, queue mode and its worker alone (vllm bench) "
                  f"on {plan.latency_model}")
        load_balancer.run(plan, results)
    if "start" in parts:
        _progress(f"items 10, 11, 12, start-up beside vllm serve, compile cache, load formats on {plan.latency_model}")
        cold_start.run(plan, results)
    if "image" in parts:
        _progress(f"items 17, 18, 19, the CPU image: build, layers, start-up beside the checkout on "
                  f"{plan.latency_model}")
        image_build.run(plan, results)
    if "cache" in parts:
        _progress(f"item 23, a start from RunPod's model cache beside a network-volume copy on {plan.latency_model}")
        model_cache.run(plan, results)
    command = "scripts/bench.sh " + " ".join(sys.argv[1:])
    path = report.write(results, out, parts, command.strip(), (time.monotonic() - started) / 60,
                        (load_before, os.getloadavg()[0]))
    print(report.table(results))
    _progress(f"results written to {path}")


if __name__ == "__main__":
    main()
