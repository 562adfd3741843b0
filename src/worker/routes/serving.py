"""``OpenAIvLLMEngine``: OpenAI and Anthropic routes, answered by vLLM's own server code.

A job ``{"openai_route": "/v1/<route>", "openai_input": <body>}`` is sent, in-process, to the
same FastAPI app ``vllm serve`` runs (built once at start-up, in the engine's event loop, with
vLLM's serving classes), so each route answers exactly as vLLM's HTTP server would: same
validation messages, status codes, Anthropic error objects and SSE framing.

Outputs:
- a JSON response: one item, the response object (an error body when the status is 4xx/5xx);
- any other response (``encoding_format: "bytes"`` embeddings, ...): one item, the answer in a
  ``body_envelope.Envelope`` (body in base64, content type, headers);
- a stream: batches of SSE events (``BatchSize`` growth, worker defaults overridable per job; the
  events vLLM sends before any output ride with the first token);
  with ``RAW_OPENAI_OUTPUT`` on, each batch is the events' text joined, ``[DONE]`` included;
  off, a list of the events' JSON objects, without ``[DONE]``.

Raw jobs in worker-vllm 2.24's format (``RAW_JOB_FORMAT=openai``) are served here too, as the
requests ``routes/raw_format`` makes of them: their streams are always SSE text, one event per item
unless stream batching is set.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from worker.config.settings import WorkerSettings
from worker.engine.vllm_engine import FromParts
from worker.jobs.batching import Batches, BatchSize, job_batch_size
from worker.jobs.job_input import JobInput
from worker.routes.asgi_client import Response, request
from worker.routes.forms import form_body
from worker.routes.raw_format import raw_request
from worker.routes.route_table import DENIED, Route, RouteTable
from worker.vllm_adapter.openai_app import build_openai_app
from worker.wire.body_envelope import Envelope, is_json
from worker.wire.dialects import is_anthropic_route
from worker.wire.errors import ErrorPayload, error_response
from worker.wire.redact import show_as_is
from worker.wire.sse import EventSplitter, data_json

if TYPE_CHECKING:
    from worker.engine.vllm_engine import vLLMEngine

log = logging.getLogger(__name__)

__all__ = ["OpenAIvLLMEngine"]


def _answer_item(response: Response, body: bytes, route: Route) -> Any:
    """A whole (not streamed) answer as the job's item: its JSON, or a non-JSON answer in an
    ``Envelope``; errors stay errors for the runpod SDK."""
    if response.status < 400:
        if not body:
            return {}
        if is_json(response.headers.get("content-type", "")):
            with contextlib.suppress(ValueError):
                return json.loads(body)
        return Envelope.of(response.status, response.headers, body).output()
    try:
        content = json.loads(body) if body else {}
    except ValueError:
        content = {"detail": body.decode(errors="replace")}
    return route.error_item(response.status, content)


async def _event_batches(response: Response, size: BatchSize,
                         preamble: int = 0) -> AsyncIterator[list[str]]:
    """The response's SSE events in the batches ``Batches`` cuts (``preamble`` events free).

    Each read waits, in the app's task, until the events the current batch still needs have
    arrived, so this wakes once per batch instead of once per event (one per engine step).
    """
    splitter, batches = EventSplitter(), Batches(size, free=preamble)
    while data := await response.read_events(batches.needed()):
        for batch in batches.add(splitter.feed(data)):
            yield batch
    for batch in batches.add(splitter.close()):  # an unterminated last event
        yield batch
    if rest := batches.rest():
        yield rest


def _serving_namespace(vllm_engine: vLLMEngine, namespace: argparse.Namespace | None,
                       settings: WorkerSettings) -> argparse.Namespace:
    """The `vllm serve` namespace the routes are served with: the engine's own by default, with
    OPENAI_SERVED_MODEL_NAME_OVERRIDE applied (on a copy)."""
    if namespace is None:
        config = vllm_engine.config
        namespace = config.args.namespace if config else argparse.Namespace(model="", served_model_name=None)
    namespace = copy.copy(namespace)
    if override := settings.openai_served_model_name_override:
        namespace.served_model_name = [override]
    return namespace


class OpenAIvLLMEngine(FromParts):
    """Serves OpenAI-route jobs on an existing ``vLLMEngine``'s AsyncLLM and event loop."""

    def __init__(self, vllm_engine: vLLMEngine, namespace: argparse.Namespace | None = None,
                 settings: WorkerSettings | None = None) -> None:
        """``namespace`` and ``settings`` default to the engine's own configuration."""
        settings = settings or vllm_engine.settings
        namespace = _serving_namespace(vllm_engine, namespace, settings)
        started = time.perf_counter()
        # Created once, in the engine's loop, before any job: no lazy first-request set-up.
        served_repo = vllm_engine.config.args.served_repo if vllm_engine.config else None
        app = vllm_engine.loop.run(build_openai_app(vllm_engine.llm, namespace, vllm_engine.adapters,
                                                    model_root=served_repo))
        self._assemble(vllm_engine, app, RouteTable.from_app(app), namespace=namespace, settings=settings)
        log.info("OpenAI routes ready in %.2fs: %s", time.perf_counter() - started,
                 ", ".join(self.routes.names()))

    def _assemble(self, vllm_engine: vLLMEngine, app: Any, routes: RouteTable, *,
                  namespace: argparse.Namespace | None = None, settings: WorkerSettings | None = None) -> None:
        """Also ``from_parts``: serves ``app`` (vLLM's app, or any ASGI app serving ``routes``) on the
        engine's loop. ``namespace`` and ``settings`` default as ``__init__``'s do (a namespace that
        is served already comes out the same)."""
        self.engine, self.app, self.routes = vllm_engine, app, routes
        self.settings = settings or vllm_engine.settings
        self.namespace = _serving_namespace(vllm_engine, namespace, self.settings)
        show_as_is(self.namespace.served_model_name or [self.namespace.model])  # callers name the model so

    @property
    def served_model_name(self) -> str:
        names = self.namespace.served_model_name
        return names[0] if names else self.namespace.model

    async def generate(self, job: JobInput) -> AsyncIterator[Any]:
        """Items for one OpenAI-route job, or a raw job in worker-vllm 2.24's format (one without a
        route); callable from any event loop."""
        if job.openai_route is not None:
            items = self._generate(job)
        else:
            raw = raw_request(job, self.served_model_name, self.settings)
            items = self._generate(raw.job, per_event=raw.per_event, text=True)
        async for item in self.engine.loop.stream(items):
            yield item

    def _route_error(self, route: str | None) -> ErrorPayload:
        if route in DENIED:
            message = f"route {route!r} is not served to jobs: {DENIED[route]}"
        else:
            message = (f"route {route!r} is not served for model {self.served_model_name!r}; "
                       f"this model serves: {', '.join(self.routes.names())}")
        return error_response(HTTPStatus.NOT_FOUND, message, param="openai_route",
                              anthropic=is_anthropic_route(route))

    async def _generate(self, job: JobInput, *, per_event: BatchSize | None = None,
                        text: bool = False) -> AsyncIterator[Any]:
        """``per_event``: a stream's batches, the events before any output counted as any other
        (else the job's, those events free); ``text``: SSE text whatever RAW_OPENAI_OUTPUT says."""
        path, _, query = job.openai_route.partition("?")  # RunPod relays the query string too
        if (route := self.routes.find(path)) is None:
            yield self._route_error(path)
            return
        body, content_type = job.openai_input, "application/json"
        method = job.method or route.method_for(body)
        if method == "GET":
            body = None
        elif route.form:
            body, content_type = form_body(body or {})
        else:
            body = body or {}
        async with request(self.app, method, self.routes.vllm_path(path), body, content_type,
                           query=query) as response:
            if not response.is_event_stream:
                content = b"".join([chunk async for chunk in response.body])
                yield _answer_item(response, content, route)
                return
            size = per_event or job_batch_size(job, self.settings)
            preamble = 0 if per_event else route.preamble(job.openai_input)
            async for batch in _event_batches(response, size, preamble):
                if text or self.settings.raw_openai_output:
                    yield "".join(batch)
                elif parsed := data_json(batch):
                    yield parsed
