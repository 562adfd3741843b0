"""Runs the benchmarks and prints one table: ``python -m bench [--quick] [--parts ...] [--out DIR]``.

Parts (items of the benchmark issue): ``stub`` (4: worker cost per token, no model), ``engine``
(1: handler() ÷ AsyncLLM.generate), ``openai`` (2: worker ÷ vllm serve through the openai SDK,
3: first request, 5: start-up), ``latency`` (6-9: job start, before and after the worker's job loop,
on ``Plan.latency_model`` and the stub worker), ``start`` (10-12: start-up beside ``vllm serve``, the
compile cache cold and warm, weight load formats, on ``Plan.latency_model``), ``concurrency`` (13-16:
adaptive concurrency beside ``vllm serve`` and a fixed 30, two workers under a burst, a small KV cache,
the controller's cost), ``image`` (17-19: the CPU image built with buildah, cold and cached, its
layers, its start-up beside the checkout's), ``kv`` (20: bursts beyond the KV cache beside ``vllm serve``,
at 64 and 128 streams and a mixed load, a worker per ``KV_OVERCOMMIT``), ``lora`` (21: many LoRA adapters by name beside ``vllm serve``, their
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
    parser.add_argument("--kv-overcommit", help="item 20's workers: comma-separated KV_OVERCOMMIT values, "
                                                "instead of 0 and 1")
    args = parser.parse_args()
    if unknown := set(args.parts.split(",")) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return args


# Each part's steps, in the order they run: (part, its progress line, its run). The stub's first;
# then, for each of ``plan.models``, those that take the model ({model}); then those on
# ``plan.latency_model`` ({model} too).
FIRST = (("stub", "item 4, worker cost per token (stub, no model)", stub_cost.run),)
PER_MODEL = (
    ("engine", "item 1, handler() ÷ AsyncLLM.generate on {model}", handler_overhead.run),
    ("openai", "items 2, 3, 5, worker ÷ vllm serve, first request, start-up on {model}", openai_path.run),
)
ON_LATENCY_MODEL = (
    ("latency", "items 7, 8, 9, job slots and where a job's first byte waits (stub worker)",
     job_start.run_stub),
    ("latency", "items 6, 9, job path ÷ vllm serve (vllm bench), first byte on {model}",
     job_start.run_model),
    ("concurrency", "items 13-16, adaptive concurrency beside vllm serve on {model}, two workers, a small KV "
                    "cache, the controller's cost", adaptive_concurrency.run),
    ("kv", "item 20, bursts beyond the KV cache beside vllm serve on {model}", kv_pressure.run),
    ("lora", f"item 21, {lora_adapters.ADAPTERS} LoRA adapters by name beside vllm serve on {{model}}, "
             "their first use", lora_adapters.run),
    ("lb", "item 22, the load balancer beside vllm serve, queue mode and its worker alone (vllm bench) on "
           "{model}", load_balancer.run),
    ("start", "items 10, 11, 12, start-up beside vllm serve, compile cache, load formats on {model}",
     cold_start.run),
    ("image", "items 17, 18, 19, the CPU image: build, layers, start-up beside the checkout on {model}",
     image_build.run),
    ("cache", "item 23, a start from RunPod's model cache beside a network-volume copy on {model}",
     model_cache.run),
)


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _run(steps: tuple, parts: list[str], model: str | None, *args: object) -> None:
    """The ``steps`` of ``parts``, each with ``args``, its progress line naming ``model``."""
    for part, line, run in steps:
        if part in parts:
            _progress(line.format(model=model))
            run(*args)


def _plan(args: argparse.Namespace) -> common.Plan:
    """The plan, with the options given in place of its own."""
    plan = common.QUICK if args.quick else common.Plan()
    given = {"models": args.models and tuple(args.models.split(",")), "dtype": args.dtype,
             "concurrency": args.concurrency and tuple(int(n) for n in args.concurrency.split(",")),
             "reps": args.reps,
             "kv_overcommit": args.kv_overcommit and tuple(float(x) for x in args.kv_overcommit.split(","))}
    return dataclasses.replace(plan, **{name: value for name, value in given.items() if value})


def main() -> None:
    args = _parse()
    plan = _plan(args)
    parts = args.parts.split(",")
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else common.REPO / "bench")
    results = common.Results(plan)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    _run(FIRST, parts, None, plan, results)
    for model in plan.models:
        _run(PER_MODEL, parts, model, model, plan, results)
    _run(ON_LATENCY_MODEL, parts, plan.latency_model, plan, results)
    command = "scripts/bench.sh " + " ".join(sys.argv[1:])
    path = report.write(results, out, parts, command.strip(), (time.monotonic() - started) / 60,
                        (load_before, os.getloadavg()[0]))
    print(report.table(results))
    _progress(f"results written to {path}")


if __name__ == "__main__":
    main()
