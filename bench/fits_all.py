"""A KV cache that fits every request (issue 17's 2 GiB), the worker now and at a revision, each ÷
``vllm serve``: ``python -m bench.fits_all --before REV [--reps N]``.

vLLM's load generator (as item 13: random 64 tokens in, 128 out, ``2n`` chats) at 64 and 128 concurrent
requests, SmolLM2 in bfloat16. The three servers start once (the revision's worker from a git worktree,
behind this checkout's local endpoint), warm up, then run in turn (ABC, CBA, …). Prints each run's
median TTFT, p99 end-to-end latency and output tokens/s, and each worker's ratios to ``vllm serve``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.common import REPO, Plan, in_turn, model_env
from bench.job_start import vllm_bench_result
from bench.servers import Endpoint, Server, VllmServe

FIGURES = ("median_ttft_ms", "p99_e2el_ms", "output_throughput")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fits_all", description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare against")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-fits-all-"))
    tree = folder / "before"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), args.before], cwd=REPO, check=True)
    env = {**model_env("smollm2-135m-instruct", Plan()), "KV_CACHE_MEMORY_BYTES": "2g"}
    env.pop("MAX_CONCURRENCY")
    env.pop("DTYPE", None)
    servers: dict[str, Server] = {}
    try:
        servers["now"] = Endpoint(env, folder / "now.log", handler=REPO / "src" / "handler.py")
        servers["before"] = Endpoint(env, folder / "before.log", handler=tree / "src" / "handler.py")
        servers["serve"] = VllmServe(env, folder / "serve.log")
        _compare(servers, env["MODEL_NAME"], args.reps)
    finally:
        for server in servers.values():
            server.stop()
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


def _compare(servers: dict[str, Server], model: str, reps: int) -> None:
    for server in servers.values():  # first-use costs; the workers ramp up here
        vllm_bench_result(server, model, 128, 128, 8)
    ratios: dict[tuple[int, str, str], list[float]] = {}
    for rep in range(reps):
        for n in (64, 128):
            runs = {name: lambda s=server, n=n: vllm_bench_result(s, model, n, 2 * n, 128)
                    for name, server in servers.items()}
            got = in_turn(rep, runs)
            print(f"@{n}", {name: tuple(round(run[key]) for key in FIGURES) for name, run in got.items()}, flush=True)
            for name in ("now", "before"):
                for key in FIGURES:
                    ratios.setdefault((n, name, key), []).append(got[name][key] / got["serve"][key])
    for (n, name, key), values in sorted(ratios.items()):
        print(f"@{n} {name:6} {key:18} ÷ vllm serve: median {statistics.median(values):.3f}, "
              f"runs {', '.join(f'{v:.3f}' for v in values)}")


if __name__ == "__main__":
    main()
