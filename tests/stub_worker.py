"""A worker without a model, for the job loop's tests and the bench: ``python tests/stub_worker.py``
(``python -m endpoint --handler tests/stub_worker.py`` runs it behind the local endpoint).

It runs ``runpod.serverless.start`` exactly as ``src/handler.py`` does, with the worker's job loop
(``JOB_LOOP=sdk``: the SDK's own), and a handler that answers at once:

- ``{"chunks": n, "seconds": s}``: ``n`` items ``{"chunk": i}``, the first at once, the job
  lasting about ``s`` seconds;
- ``{"openai_route": ..., "openai_input": {...}}``: one chat completion SSE event and ``[DONE]``.

``STUB_CONCURRENCY_FILE``, when set, names a file holding the concurrency (re-read at every call
of the modifier); otherwise it is ``MAX_CONCURRENCY`` (default 30).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import runpod  # noqa: E402

from worker.scheduling import job_loop  # noqa: E402

EVENT = "data: " + json.dumps({"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                               "model": "stub", "choices": [{"index": 0, "delta": {"content": "hi"},
                                                             "finish_reason": "stop"}]}) + "\n\n"


async def handler(job):
    job_input = job["input"]
    if "openai_route" in job_input:
        yield EVENT
        yield "data: [DONE]\n\n"
        return
    chunks = int(job_input.get("chunks", 1))
    step = float(job_input.get("seconds", 0)) / max(1, chunks - 1)
    for i in range(chunks):
        yield {"chunk": i}
        if step and (i < chunks - 1 or chunks == 1):
            await asyncio.sleep(step)


def concurrency(_current: int) -> int:
    if path := os.environ.get("STUB_CONCURRENCY_FILE"):
        return int(Path(path).read_text())  # written atomically (renamed into place)
    return int(os.environ.get("MAX_CONCURRENCY", "30"))


if __name__ == "__main__":
    job_loop.install(os.environ.get("JOB_LOOP", "worker") != "sdk")
    runpod.serverless.start({"handler": handler, "concurrency_modifier": concurrency,
                             "return_aggregate_stream": True})
