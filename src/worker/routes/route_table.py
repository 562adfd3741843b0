"""The routes a job can reach: derived from vLLM's own app, minus operational and admin routes.

``RouteTable(app)`` lists every HTTP route vLLM registered for the loaded model (so embeddings
only for pooling models, audio only for speech models, ...), except those in ``DENIED``, each
denied for a stated reason. For each served route it keeps the facts the worker needs:

- its path (a template such as ``/v1/responses/{response_id}``) and methods;
- its error dialect (Anthropic's on ``/v1/messages...``, else OpenAI's);
- how many events its stream sends before any output (see ``preamble``);
- whether it takes a form upload (audio), which a job carries as JSON (see ``forms``);
- its errors in its dialect (see ``error_item``).

RunPod relays only ``.../openai/v1/<route>``: a route vLLM serves outside ``/v1/``
(``/tokenize``, ``/pooling``, ``/v2/rerank``, ...) is also reachable as ``/v1`` + its path
(``/v1/tokenize``, ``/v1/v2/rerank``) unless vLLM has that path itself.

No vLLM import: only FastAPI's and Starlette's route objects, which vLLM's app is made of.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import params
from fastapi.routing import APIRoute
from starlette.routing import compile_path

from worker.wire.dialects import is_anthropic_route
from worker.wire.errors import ErrorPayload, RequestError, error_response
from worker.wire.redact import served_text

__all__ = ["DENIED", "REVIEWED", "WORKER_LOCAL", "Route", "RouteTable", "unclassified_routes"]

_OPERATIONAL = "operational: RunPod monitors and scales the worker itself"
_ADMIN = "changes or inspects the server for every user: a job must not"
_DOCS = "the HTTP server's documentation pages, not an API"
_SAGEMAKER = "SageMaker's entry points, which re-dispatch to the routes served here"
_WEBSOCKET = "a WebSocket: a job carries one request body, not a connection"

# vLLM's routes that no job may call, with the reason.
DENIED: Mapping[str, str] = {
    "/health": _OPERATIONAL, "/load": _OPERATIONAL, "/metrics": _OPERATIONAL,
    "/version": _OPERATIONAL, "/server_info": _OPERATIONAL, "/kv_event_sources": _OPERATIONAL,
    "/is_sleeping": _OPERATIONAL, "/is_paused": _OPERATIONAL, "/get_world_size": _OPERATIONAL,
    "/fault_tolerance/status": _OPERATIONAL, "/v1/fault_tolerance/status": _OPERATIONAL,
    "/is_scaling_elastic_ep": _OPERATIONAL, "/checkpoint/status": _OPERATIONAL,
    "/ready": _OPERATIONAL, "/readyz": _OPERATIONAL,
    "/ping": _SAGEMAKER, "/invocations": _SAGEMAKER,
    "/docs": _DOCS, "/docs/oauth2-redirect": _DOCS, "/openapi.json": _DOCS, "/redoc": _DOCS,
    "/v1/realtime": _WEBSOCKET,
    # Adapters load by name from shared sources (engine/adapters), never from a path one job gives;
    # aborting by id would stop other users' requests.
    **dict.fromkeys([
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters", "/adapters/{adapter_name}",
        "/inference/v1/abort_requests",
        "/abort_requests", "/scale_elastic_ep", "/sleep", "/wake_up", "/pause", "/resume",
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/collective_rpc",
        "/start_profile", "/stop_profile", "/release_kv_cache_memory", "/update_weights",
        "/update_weight_version", "/weight_checker", "/weight_info", "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
        "/start_draft_weight_update", "/fault_tolerance/apply", "/v1/fault_tolerance/apply",
        "/checkpoint/prepare", "/checkpoint/restore"],
        _ADMIN),
}

# vLLM's routes reviewed and served. Serving is derived (a route not denied is served); this list
# only lets ``unclassified_routes`` report a route nobody has reviewed, so that the tests and the
# contract check against a newer vLLM fail on it until it is put here or in DENIED.
REVIEWED: frozenset[str] = frozenset({
    "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info",
    # generation
    "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/completions",
    "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/cancel", "/inference/v1/generate", "/generative_scoring",
    "/v1/systemone", "/v1/decisions", "/cohere/v2/chat",
    # rendering a request to tokens and back, without generating
    "/v1/chat/completions/render", "/v1/chat/completions/derender", "/v1/completions/render",
    "/v1/completions/derender", "/v1/messages/render", "/v1/responses/render",
    "/cohere/v2/chat/render",
    # pooling models
    "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
    "/v1/rerank", "/v2/rerank",
    # speech-to-text models (form uploads)
    "/v1/audio/transcriptions", "/v1/audio/translations",
})

# Routes whose answer depends on state one worker holds in memory: their 404s say so.
_STORED = ("stored responses (VLLM_ENABLE_RESPONSES_API_STORE) live in the memory of the worker "
           "that created them; on an endpoint with several workers this job may have reached another")
WORKER_LOCAL: Mapping[str, str] = {"/v1/responses/{response_id}": _STORED,
                                   "/v1/responses/{response_id}/cancel": _STORED}

# Events a stream sends before any output: a chat stream's role chunk per choice, Anthropic's
# ``message_start``, the Responses API's ``created`` and ``in_progress``.
_PREAMBLE_EVENTS = {"/v1/messages": 1, "/v1/responses": 2}


@dataclass(frozen=True)
class Route:
    path: str  # vLLM's path template
    methods: frozenset[str]
    form: bool = False  # takes a multipart form (an upload) rather than JSON

    @property
    def anthropic(self) -> bool:
        return is_anthropic_route(self.path)

    def preamble(self, body: Any) -> int:
        """How many events this route streams before any output, for this request body."""
        if self.path == "/v1/chat/completions":
            n = body.get("n") if isinstance(body, dict) else None
            return n if isinstance(n, int) and n > 0 else 1
        return _PREAMBLE_EVENTS.get(self.path, 0)

    def error_item(self, status: int, content: Any) -> Any:
        """vLLM's error answer (``content``, its parsed JSON) in this route's dialect.

        Anthropic routes always answer Anthropic's error object: vLLM itself does so for serving
        errors but answers request-validation errors in OpenAI's shape. A 404 of a route that
        depends on one worker's memory says so. This machine's paths in vLLM's text are masked.
        """
        error = content.get("error") if isinstance(content, dict) else None
        if isinstance(error, str):  # e.g. vLLM's {"error": "Unauthorized"}
            error = {"message": error}
        message = served_text((error.get("message") if isinstance(error, dict) else None) or str(
            content.get("detail") if isinstance(content, dict) else content))
        if status == HTTPStatus.NOT_FOUND and (note := WORKER_LOCAL.get(self.path)):
            message = f"{message} ({note})"
        if isinstance(error, dict):
            content = {**content, "error": {**error, "message": message}}
        if isinstance(error, dict) and "type" in error and not self.anthropic:
            return ErrorPayload(content)  # vLLM's own error body, as it is
        return error_response(status, message, anthropic=self.anthropic)

    def method_for(self, body: Any) -> str:
        """The method a job means when it names none: the route's only one; on a route with several,
        POST for a body and GET without (else the other of the two). Never a method that edits or
        deletes (PUT, DELETE) by default: on a route with neither GET nor POST, the job must name one.
        (vLLM 0.32 serves no route with several methods; OpenAI's API has GET and DELETE on one.)"""
        if len(self.methods) == 1:
            return next(iter(self.methods))
        preferred = ("POST", "GET") if body is not None else ("GET", "POST")
        if method := next((method for method in preferred if method in self.methods), None):
            return method
        raise RequestError(f"route {self.path!r} takes {', '.join(sorted(self.methods))}: name one in "
                           "the job's 'method'", param="method")


def _takes_form(route: APIRoute) -> bool:
    return any(isinstance(param.field_info, params.Form) for param in route.dependant.body_params)


def _app_routes(app: Any) -> Iterable[APIRoute]:
    return (route for route in app.routes if isinstance(route, APIRoute))


def unclassified_routes(app: Any) -> list[str]:
    """The app's routes that are neither reviewed as served nor denied: new in this vLLM."""
    return sorted({path for route in app.routes if (path := getattr(route, "path", None))
                   and path not in REVIEWED and path not in DENIED})


class RouteTable:
    """The served routes, found by the job's route (a path, possibly with parameters)."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = {route.path: route for route in routes}
        self._patterns = [(compile_path(route.path)[0], route) for route in self.routes.values()
                          if "{" in route.path]
        # RunPod relays only /v1/...: other paths get a /v1 prefix unless vLLM has that path.
        self.aliases = {"/v1" + path: path for path in self.routes
                        if not path.startswith("/v1/") and "/v1" + path not in self.routes}

    @classmethod
    def from_app(cls, app: Any) -> RouteTable:
        routes: dict[str, Route] = {}
        for route in _app_routes(app):
            if route.path in DENIED:
                continue
            seen = routes.get(route.path, Route(route.path, frozenset()))  # one path, several methods
            routes[route.path] = Route(route.path, seen.methods | route.methods,
                                       seen.form or _takes_form(route))
        return cls(routes.values())

    def find(self, path: str) -> Route | None:
        path = self.aliases.get(path, path)
        if (route := self.routes.get(path)) is not None:
            return route
        return next((route for pattern, route in self._patterns if pattern.fullmatch(path)), None)

    def vllm_path(self, path: str) -> str:
        """The path to call in vLLM's app for a job's route (an alias resolved)."""
        return self.aliases.get(path, path)

    def names(self) -> list[str]:
        """Every job route, for logs and error messages."""
        return sorted([*self.routes, *self.aliases])
