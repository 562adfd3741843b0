"""What every benchmark shares: the CPU environment, the models, the plan, load timing, statistics.

Importing this module sets the process-wide vLLM CPU settings (``scripts/cpu-dev.env``), as the
tests do, before anything imports vLLM, and puts ``src/`` on the import path.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "scripts")]
from dev_env import CPU_ENV  # noqa: E402 - sets the CPU settings in this process, as the tests do

MODELS_ROOT = REPO / ".cache" / "models"

# The bench's parts (``--parts``): each one's title and the items (numbers of the benchmark issues) it
# measures. RESULTS.md keeps a section per part, so a run of some parts leaves the others' as they were.
PARTS = {"stub": ("Worker cost per token (stub worker, no model)", (4,)),
         "engine": ("Handler overhead: handler() ÷ AsyncLLM.generate", (1,)),
         "openai": ("OpenAI path: worker ÷ vllm serve (openai SDK), first request, start-up", (2, 3, 5)),
         "latency": ("Job start: the job path ÷ vllm serve (vllm bench), slots, emulator cost", (6, 7, 8, 9)),
         "start": ("Cold start: beside vllm serve, compile cache, weight loading", (10, 11, 12)),
         "concurrency": ("Adaptive concurrency: beside vllm serve, two workers, a small KV cache, cost",
                         (13, 14, 15, 16)),
         "image": ("The CPU image: build time, size per layer, start-up beside the checkout", (17, 18, 19)),
         "kv": ("Bursts beyond the KV cache: beside vllm serve at 64 and 128 streams, and a mixed load", (20,)),
         "lora": ("Many LoRA adapters: beside vllm serve, beside the base model, first use", (21,)),
         "lb": ("The load balancer: beside vllm serve, queue mode and its worker alone (vllm bench)", (22,)),
         "cache": ("RunPod's model cache: a start beside one from a network-volume copy", (23,))}
# The paths whose loads (tokens/s, TTFT) are charted, by the part that measures them.
RAW_ENGINE, HANDLER, WORKER, VLLM_SERVE = "raw engine", "handler()", "worker", "vllm serve"
LOAD_PATHS = {"engine": (RAW_ENGINE, HANDLER), "openai": (WORKER, VLLM_SERVE)}

WARM_UP_TOKENS = 8  # a short load on each path before measuring: first-use costs are not measured

# Distinct prompts of equal shape, so no stream rides on another's prefix cache.
PROMPTS = [f"Write story number {i} about a lighthouse keeper and the sea." for i in range(256)]


@dataclass(frozen=True)
class Plan:
    reps: int = 3  # repetitions of every A/B pair (and fresh worker starts for items 3 and 5)
    max_tokens: int = 128  # every stream generates exactly this many tokens (ignore_eos)
    concurrency: tuple[int, ...] = (1, 16, 64)
    openai_goal_concurrency: tuple[int, ...] = (1, 16)  # item 2's goals apply here
    followups: int = 20  # item 3: requests after the first
    first_max_tokens: int = 16  # item 3's requests
    stub_jobs: int = 256  # item 4: jobs per measurement, 16 at a time
    models: tuple[str, ...] = ("smollm2-135m-instruct", "tiny-llama")
    # The tiny model's loads take about a second each and swing twofold on both paths alike
    # (where the OS puts the engine's threads on 2 cores): more repetitions steady the median.
    tiny_load_reps: int = 9
    latency_model: str = "smollm2-135m-instruct"  # items 6, 9, 10 and 12 (real worker)
    compile_model: str = "tiny-llama"  # item 11: compiling SmolLM2 takes minutes on 2 cores
    slot_jobs: int = 300  # item 7: jobs per burst on the stub worker's 30 slots
    trace_requests: int = 50  # items 8 and 9: sequential requests per worker and loop
    trace_max_tokens: int = 8  # item 9's real-worker requests
    adaptive_concurrency: tuple[int, ...] = (16, 64, 128)  # item 13
    # item 20: a worker for each KV_OVERCOMMIT: the default (0, what fits whole), and 1 (about as many
    # as vllm serve starts); a trade-off curve takes more (--kv-overcommit)
    kv_overcommit: tuple[float, ...] = (0.0, 1.0)
    # None: each model's own dtype (bfloat16). A CPU without native bf16 (no AVX-512 BF16 or AMX)
    # runs bf16 through torch's slow fallback, some 3x slower than float32: --dtype float32 there.
    dtype: str | None = None

    def load_reps(self, model: str) -> int:
        """Repetitions of item 1's and item 2's A/B load pairs on ``model``."""
        return self.tiny_load_reps if model == "tiny-llama" else self.reps


QUICK = Plan(reps=2, max_tokens=16, concurrency=(1, 4), adaptive_concurrency=(4, 16),
             openai_goal_concurrency=(1, 4), followups=5,
             first_max_tokens=8, stub_jobs=32, models=("tiny-llama",), tiny_load_reps=2,
             latency_model="tiny-llama", slot_jobs=90, trace_requests=10, trace_max_tokens=4)


def model_env(model: str, plan: Plan) -> dict[str, str]:
    """A complete worker environment for ``model`` (no config-file layers), as the tests build it.

    Models run in their own dtype (bfloat16), as the anchors were measured, unless ``plan.dtype``
    says otherwise; the tests run SmolLM2 in float32 only because it must answer one question right."""
    return {"MODEL_NAME": str(MODELS_ROOT / model), **CPU_ENV,
            "MAX_CONCURRENCY": str(max(plan.concurrency)),
            "VLLM_CONFIG_FILE": "/nonexistent/vllm_config.yaml",
            "LOCAL_MODEL_ARGS_FILE": "/nonexistent/local_model_args.json",
            **({"DTYPE": plan.dtype} if plan.dtype else {})}


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


@dataclass
class Stream:
    """One stream's timing (``time.perf_counter`` seconds) and its output token count."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    end: float = 0.0
    tokens: int = 0

    def got(self, tokens: int) -> None:
        if tokens and self.first is None:
            self.first = time.perf_counter()

    def done(self, tokens: int) -> Stream:
        self.end, self.tokens = time.perf_counter(), tokens
        return self

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Load:
    """N concurrent streams: all output tokens ÷ wall time, and the median time to first token."""

    tokens_per_s: float
    ttft: float

    @classmethod
    def of(cls, streams: list[Stream]) -> Load:
        wall = max(s.end for s in streams) - min(s.start for s in streams)
        return cls(sum(s.tokens for s in streams) / wall,
                   statistics.median(s.first - s.start for s in streams))


async def run_load(n: int, stream: Callable[[int, int], Awaitable[Stream]], max_tokens: int) -> Load:
    """``n`` streams ``stream(i, max_tokens)`` started together; each must produce ``max_tokens`` tokens."""
    streams = await asyncio.gather(*(stream(i, max_tokens) for i in range(n)))
    if wrong := [s.tokens for s in streams if s.tokens != max_tokens or s.first is None]:
        raise RuntimeError(f"streams produced {wrong} tokens, expected {max_tokens} each")
    return Load.of(streams)


def ab(rep: int, a: Callable[[], T], b: Callable[[], T]) -> tuple[T, T]:
    """``(a(), b())``, measured in alternating order (ABBA…), so slow drift favours neither."""
    if rep % 2:
        second = b()
        return a(), second
    first = a()
    return first, b()


def turn_order(rep: int, names: Iterable[str]) -> list[str]:
    """``names`` in their order, reversed on odd repetitions (ABC, CBA, …), so drift favours none."""
    return list(names)[::-1] if rep % 2 else list(names)


def in_turn(rep: int, runs: dict[str, Callable[[], T]]) -> dict[str, T]:
    """Every run once, in ``turn_order``."""
    return {name: runs[name]() for name in turn_order(rep, runs)}


@dataclass
class Figure:
    """One row of the results table: repeated values of one figure and its goal."""

    item: str
    model: str
    name: str
    unit: str = ""
    goal: tuple[str, float] | None = None  # ("≥", 0.99) or ("≤", 1.1), checked on the median
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        op, bound = self.goal
        return self.median >= bound if op == "≥" else self.median <= bound


@dataclass
class Results:
    """Everything one run measured: the table's figures and the chart's per-path loads."""

    plan: Plan
    figures: list[Figure] = field(default_factory=list)
    # (model, path, concurrency) → one Load per repetition; paths: raw engine, worker, vllm serve
    loads: dict[tuple[str, str, int], list[Load]] = field(default_factory=dict)
    # Item 6: (model, path, concurrency) → one vllm bench result per repetition (bench/job_start.py)
    job_path: dict[tuple[str, str, int], list[Load]] = field(default_factory=dict)
    # Item 9: (worker, "before" | "after") → step → median ms
    decomposition: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    # Item 13: (model, path, concurrency) → one vllm bench result per repetition (adaptive_concurrency.py)
    concurrency_loads: dict[tuple[str, str, int], list[Load]] = field(default_factory=dict)
    # Item 22: (model, path, concurrency) → one vllm bench result per repetition (load_balancer.py)
    balancer_loads: dict[tuple[str, str, int], list[Load]] = field(default_factory=dict)
    # Items 14-15: chart title → worker → (seconds, held, target, running, waiting, KV usage, preempted)
    series: dict[str, dict[str, list[tuple]]] = field(default_factory=dict)
    # What could not be measured, and why (item → reason; the reason's key starts with the item's number)
    notes: dict[str, str] = field(default_factory=dict)

    def figure(self, item: str, model: str, name: str, unit: str = "",
               goal: tuple[str, float] | None = None) -> Figure:
        """The figure of that name, created on first use."""
        for fig in self.figures:
            if (fig.item, fig.model, fig.name) == (item, model, name):
                return fig
        self.figures.append(Figure(item, model, name, unit, goal))
        return self.figures[-1]

    def add_load(self, model: str, path: str, concurrency: int, load: Load) -> None:
        self.loads.setdefault((model, path, concurrency), []).append(load)
