"""Runs a worker script with time stamps on its job path: ``TRACE_TARGET=src/handler.py TRACE_FILE=f
python bench/trace_worker.py`` (``python -m endpoint --handler bench/trace_worker.py`` runs it there).
With ``LOAD_TRACE_FILE``, it also records what the concurrency controller saw after each engine step.

Item 9 of the bench needs to know where a job's first byte spends its time inside the worker, without
changing the worker: this wraps the job fetch (the worker's ``take_jobs``, the SDK's ``get_job``,
returned the job), the job task (``handle_job`` entered, in the SDK's ``JobScaler`` and in
``job_loop.JobLoop``), the stream post (``stream_result`` called) and the handler given to
``runpod.serverless.start`` (called, first item), and appends ``stage job_id time.time()`` lines to
``TRACE_FILE``. Then it runs the target as ``__main__``; vLLM's spawned processes re-import the target
(``__mp_main__``) without the wrappers.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# Open while the worker runs; either may be unset.
TRACE = open(os.environ.get("TRACE_FILE", os.devnull), "a", buffering=1)  # noqa: SIM115
# "{worker}" in LOAD_TRACE_FILE: this worker's id (the local endpoint's RUNPOD_POD_ID), a file per worker.
LOAD_TRACE = open(os.environ.get("LOAD_TRACE_FILE", os.devnull).format(  # noqa: SIM115
    worker=os.environ.get("RUNPOD_POD_ID", "worker")), "a", buffering=1)
_seen: set[tuple[str, str]] = set()


def stamp(stage: str, job_id: str, at: float | None = None) -> None:
    """The first time ``stage`` happens for ``job_id`` (later ones, like later chunks, are not wanted)."""
    if (stage, job_id) not in _seen:
        _seen.add((stage, job_id))
        TRACE.write(f"{stage} {job_id} {time.time() if at is None else at:.6f}\n")


def _wrap_get_job(get_job):
    @functools.wraps(get_job)
    async def traced(session, num_jobs=1):
        jobs = await get_job(session, num_jobs)
        for job in jobs or ():
            stamp("worker_got", job["id"])
        return jobs
    return traced


def _stamp_before(stage: str, call):
    """``call`` (``handle_job(self, session, job)`` or ``stream_result(session, output, job)``),
    stamping ``stage`` for the job, its third argument, first."""
    @functools.wraps(call)
    async def traced(*args):
        stamp(stage, args[2]["id"])
        return await call(*args)
    return traced


def _wrap_handler(handler):
    @functools.wraps(handler)
    async def traced(job):
        stamp("handler_called", job["id"])
        async for item in handler(job):
            stamp("first_item", job["id"])
            yield item
    return traced


def _wrap_start(start):
    @functools.wraps(start)
    def traced(config):
        return start({**config, "handler": _wrap_handler(config["handler"])})
    return traced


def _wrap_observe(observe):
    """``Concurrency.observe``, appending ``time held target running waiting kv_usage started finished
    preempted`` after each engine step (as the controller saw it) to LOAD_TRACE_FILE."""
    @functools.wraps(observe)
    def traced(self, **load):
        observe(self, **load)
        LOAD_TRACE.write(f"{time.time():.6f} {self._held()} {self.target} {load['running']} "
                         f"{load['waiting']} {load['kv_usage']:.4f} {load['started']} {load['finished']} "
                         f"{load.get('preempted', 0)}\n")
    return traced


def install() -> None:
    sys.path.insert(0, str(SRC))
    import runpod
    from runpod.serverless.modules import rp_job, rp_scale

    from worker.scheduling import concurrency
    from worker.scheduling import job_loop

    concurrency.Concurrency.observe = _wrap_observe(concurrency.Concurrency.observe)

    # The worker makes job_loop's take_jobs the SDK's get_job (JobScaler.__init__ reads it there).
    job_loop.take_jobs = _wrap_get_job(job_loop.take_jobs)
    for cls in (rp_scale.JobScaler, job_loop.JobLoop):
        cls.handle_job = _stamp_before("task_start", cls.__dict__["handle_job"])
    rp_job.stream_result = _stamp_before("stream_post", rp_job.stream_result)  # imported there by name
    runpod.serverless.start = _wrap_start(runpod.serverless.start)


def pin_engine() -> None:
    """With ``TRACE_PIN_ENGINE``, the engine's threads of the local endpoint's N-th worker run on core
    N alone (modulo the cores), as if each worker had its machine: two engines on the same cores slow
    each other's start of a burst by seconds."""
    worker = os.environ.get("RUNPOD_POD_ID", "")
    if os.environ.get("TRACE_PIN_ENGINE") and worker.rpartition("-")[2].isdigit():
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(worker.rpartition("-")[2]) % os.cpu_count())


if __name__ == "__main__":
    target = Path(os.environ["TRACE_TARGET"]).resolve()
    pin_engine()
    install()
    sys.path.insert(0, str(target.parent))  # as running the script itself would
    sys.argv[0] = str(target)
    runpy.run_path(str(target), run_name="__main__")
