"""Items 10-12: cold start.

10. Side by side: the worker, from its process's start to its first call for work (under the local
    endpoint), and ``vllm serve``, from its process's start to ``/health`` answering; same model and
    engine flags, started in turn (ABBA…). Each side's start is split at the same lines of vLLM's
    log (time stamps to the millisecond, VLLM_LOGGING_CONFIG_PATH): vLLM configured, the engine's
    process started, the engine core ready; then the rest up to ready.
11. The compile cache: a worker with torch.compile on (no ``ENFORCE_EAGER``, no
    ``TORCH_COMPILE_DISABLE``), each start on a fresh container disk (its own ``XDG_CACHE_HOME`` and
    ``TMPDIR``), with a network volume (``BASE_PATH``) that is empty (cold) or holds what the cold
    start published (warm). The compile phase is vLLM's engine initialisation (profiling run,
    KV cache, warm-up: where the model is compiled), from vLLM's own log line. Beside it (ABBA),
    ``vllm serve`` with the same flags, cold on an empty disk and warm on the disk its cold start
    left: the start-ups' ratios.
12. Weight loading: the engine phase, and vLLM's "Loading weights took" where the loader logs it, for
    each load format (and safetensors load strategy) that works on this CPU.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import TypeVar

from bench.common import Plan, Results, ab, model_env, turn_order
from bench.servers import Endpoint, VllmServe
from worker.config.worker_config import VOLUME_CACHE_DIR

# vLLM's own log lines (EngineCore's output, relayed to the worker's log).
INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
LOAD_WEIGHTS = re.compile(r"Loading weights took ([\d.]+) s")
CACHE_STATE = re.compile(r"Worker ready: .*; compile cache (\w+)")
RECOMPILED = re.compile(r"Compiling model again due to a load failure from \S+, reason: .*")
S = TypeVar("S", Endpoint, VllmServe)
COMPILE_ON = {"ENFORCE_EAGER": "false", "TORCH_COMPILE_DISABLE": "0"}
# LOAD_FORMAT (and SAFETENSORS_LOAD_STRATEGY) settings measured in item 12.
LOAD_FORMATS = {"auto": {}, "safetensors, eager": {"LOAD_FORMAT": "safetensors",
                                                   "SAFETENSORS_LOAD_STRATEGY": "eager"},
                "safetensors, prefetch": {"LOAD_FORMAT": "safetensors",
                                          "SAFETENSORS_LOAD_STRATEGY": "prefetch"},
                "runai_streamer": {"LOAD_FORMAT": "runai_streamer"},
                "fastsafetensors": {"LOAD_FORMAT": "fastsafetensors"}}


def _logged(pattern: re.Pattern, log: str) -> str:
    if (match := pattern.search(log)) is None:
        raise RuntimeError(f"no line matching {pattern.pattern!r} in the worker's log:\n{log[-3000:]}")
    return match[1]


def _started(kind: type[S], env: dict[str, str], log_path: Path) -> S:
    """A server of ``kind`` that has started; stopped before it is returned, so that neither side
    of a comparison starts while the other still runs."""
    server = kind(env, log_path)
    server.stop()
    return server


def _worker(env: dict[str, str], log_path: Path) -> Endpoint:
    """A worker started under the local endpoint, and stopped."""
    return _started(Endpoint, env, log_path)


def side_by_side(model: str, plan: Plan, logs: Path, results: Results) -> None:
    """Item 10, with each side's start split at the same milestones of vLLM's own log."""
    env = {**model_env(model, plan), "VLLM_LOGGING_CONFIG_PATH": str(_millisecond_logging(logs))}
    item = "10 start-up side by side"
    for rep in range(plan.reps):
        worker, serve = ab(rep, lambda: _worker(env, logs / f"worker-{rep}.log"),
                           lambda: _started(VllmServe, env, logs / f"serve-{rep}.log"))
        for side, server, total in (("worker", worker, worker.start_up.total),
                                    ("vllm serve", serve, serve.start_up)):
            results.figure(item, model, f"{side}: process start → {READY[side]}", "s").values.append(total)
            for name, seconds in _segments(server, total).items():
                results.figure(item, model, f"{side}: {name}", "s").values.append(seconds)
        results.figure(item, model, "start-up worker ÷ vllm serve", goal=("≤", 1.0)).values.append(
            worker.start_up.total / serve.start_up)


READY = {"worker": "taking jobs", "vllm serve": "/health"}
# vLLM's log lines that split a start, the same on both sides: the main process has vLLM's
# configuration, the engine's process has started (and imported vLLM), the engine core is ready.
MILESTONES = (("imports and configuration", re.compile(r"Resolved architecture")),
              ("engine process start", re.compile(r"Initializing a V1 LLM engine")),
              ("engine core (load, profile, KV cache)", INIT_ENGINE))
LOGGED_AT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")


def _millisecond_logging(logs: Path) -> Path:
    """A vLLM logging configuration (VLLM_LOGGING_CONFIG_PATH) whose time stamps have milliseconds."""
    path = logs / "vllm-logging.json"
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"ms": {"format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s "
                                        "%(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "ms",
                             "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False}}}))
    return path


def _segments(server, total: float) -> dict[str, float]:
    """Seconds between the process's start, each milestone and being ready."""
    lines = server.log().splitlines()
    marks = []
    for _, pattern in MILESTONES:
        line = next(line for line in lines if pattern.search(line))
        marks.append(datetime.strptime(LOGGED_AT.search(line)[0], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    started = server.started
    points = [started, *marks, started + total]
    names = [name for name, _ in MILESTONES] + ["after the engine core (app, warm-up, ready)"]
    return dict(zip(names, (b - a for a, b in pairwise(points)), strict=True))


def compile_cache(model: str, plan: Plan, logs: Path, results: Results) -> None:
    """Item 11: per repetition, the worker's cold start on an empty volume, then a warm one on a fresh
    disk with what it left on the volume (a new machine); beside them `vllm serve`'s cold start on
    an empty disk, then its warm one on the same disk (the best a server without a volume gets)."""
    item = "11 compile cache"
    for rep in range(plan.reps):
        worker, serve = ab(rep, lambda: _worker_cold_warm(model, plan, logs / f"compile-{rep}", results),
                           lambda: _serve_cold_warm(model, plan, logs / f"compile-{rep}"))
        for state in ("cold", "warm"):
            results.figure(item, model, f"vllm serve: process start → /health, {state}", "s").values.append(
                serve[state])
            results.figure(item, model, f"start-up worker ÷ vllm serve, {state}", goal=("≤", 0.95)).values.append(
                worker[state] / serve[state])


def _worker_cold_warm(model: str, plan: Plan, logs: Path, results: Results) -> dict[str, float]:
    """The worker's cold and warm starts (their compile phases recorded); each one's seconds."""
    item = "11 compile cache"
    volume = Path(tempfile.mkdtemp(prefix="bench-volume-"))
    phases, totals = {}, {}
    for state in ("cold", "warm"):
        disk = Path(tempfile.mkdtemp(prefix=f"bench-disk-{state}-"))
        env = {**model_env(model, plan), **COMPILE_ON, "BASE_PATH": str(volume),
               "XDG_CACHE_HOME": str(disk / "cache"), "TMPDIR": str(disk)}
        endpoint = _worker(env, Path(f"{logs}-{state}.log"))
        log = endpoint.log()
        if (found := _logged(CACHE_STATE, log)) != state:
            results.notes[f"{item}, {logs.name}"] = (
                f"the {state} start logged its compile cache as {found}" + _reload_failure(log))
        if state == "cold":
            _wait_published(volume)
        phases[state], totals[state] = float(_logged(INIT_ENGINE, log)), endpoint.start_up.total
        results.figure(item, model, f"compile phase (vLLM's engine init), {state}", "s").values.append(
            phases[state])
        results.figure(item, model, f"process start → taking jobs, {state}", "s").values.append(totals[state])
    results.figure(item, model, "compile phase cold ÷ warm", goal=("≥", 5.0)).values.append(
        phases["cold"] / phases["warm"])
    return totals


def _serve_cold_warm(model: str, plan: Plan, logs: Path) -> dict[str, float]:
    """`vllm serve`'s cold start on an empty disk, then its warm one on the same disk: each one's seconds."""
    disk = Path(tempfile.mkdtemp(prefix="bench-serve-disk-"))
    env = {**model_env(model, plan), **COMPILE_ON, "XDG_CACHE_HOME": str(disk / "cache"), "TMPDIR": str(disk)}
    return {state: _started(VllmServe, env, Path(f"{logs}-serve-{state}.log")).start_up
            for state in ("cold", "warm")}


def _reload_failure(log: str) -> str:
    """vLLM's reason for compiling again although the cache held an entry, if it gave one."""
    match = RECOMPILED.search(log)
    return f"; vLLM: {match[0]}" if match else ""


def _wait_published(volume: Path, timeout: float = 120) -> None:
    """The cold start publishes in the background: wait until its entries are on the volume."""
    deadline = time.monotonic() + timeout
    while not any((volume / VOLUME_CACHE_DIR / "torch_compile_cache").glob("*")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing was published to {volume}")
        time.sleep(0.5)


def load_formats(model: str, plan: Plan, logs: Path, results: Results) -> None:
    """Item 12: each load format in turn, ``plan.reps`` times (a format this CPU cannot use is noted)."""
    item = "12 weight loading"
    for rep in range(plan.reps):
        for name in turn_order(rep, LOAD_FORMATS):
            env = {**model_env(model, plan), **LOAD_FORMATS[name]}
            try:
                endpoint = _worker(env, logs / f"load-{rep}-{name}.log")
            except RuntimeError as exc:
                results.notes.setdefault(f"{item}: {name}", str(exc).splitlines()[-1][:300])
                continue
            # Not every loader logs its time (runai_streamer does not): the engine phase holds it.
            results.figure(item, model, f"engine phase (loading included), {name}", "s").values.append(
                endpoint.start_up.phases["engine"])
            if loaded := LOAD_WEIGHTS.search(endpoint.log()):
                results.figure(item, model, f"Loading weights took, {name}", "s").values.append(
                    float(loaded[1]))


def run(plan: Plan, results: Results) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-cold-start-"))
    model = plan.latency_model
    side_by_side(model, plan, logs, results)
    compile_cache(plan.compile_model, plan, logs, results)
    load_formats(model, plan, logs, results)
