"""The load-balancing endpoint's ASGI app (``load_balancer/app``, its ASGI exchanges in
``load_balancer/asgi_io``) with small stand-ins for vLLM's app and the handler: /ping per phase,
refusals in each route's dialect (a body past the limit, chunked too; JSON nested too deep), vLLM's
errors in the route's dialect, deadlines ending a response, raw jobs' formats, the health port's own
app. The real worker behind it: tests/worker/test_load_balancer_worker.py. Last, its server's
sockets (``load_balancer/server``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import pytest
import sse_events

from worker.config.settings import WorkerSettings
from worker.jobs.deadlines import Deadlines
import handler
from worker.load_balancer.app import Phase, PingOnly, Serving, WorkerApp
from worker.routes.asgi_client import request
from worker.routes.route_table import Route, RouteTable
from worker.wire.errors import StartupError, error_response
from worker.wire.nesting import MAX_DEPTH

ROUTES = RouteTable([Route("/v1/chat/completions", frozenset({"POST"})),
                     Route("/v1/messages", frozenset({"POST"})), Route("/tokenize", frozenset({"POST"})),
                     Route("/v1/responses/{response_id}", frozenset({"GET"}))])


async def vllm_app(scope, receive, send):
    """vLLM's app in small: an SSE stream, or an error in vLLM's shapes, as the body asks."""
    body = json.loads((await receive())["body"] or b"{}")
    if scope["path"] == "/v1/responses/r1":
        return await respond(send, 404, {"error": {"message": "Response r1 not found", "type": "NotFoundError",
                                                   "param": None, "code": 404}})
    if body.get("invalid"):  # a request vLLM's validation rejects: OpenAI's shape, on any route
        return await respond(send, 400, {"error": {"message": "bad field", "type": "Bad Request",
                                                   "param": None, "code": 400}})
    if scope["path"] == "/tokenize":
        return await respond(send, 200, {"path": scope["path"]})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(body.get("events", 2)):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await asyncio.sleep(body.get("pause", 0))
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def respond(send, status, content):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(content).encode()})


async def run_job(job):
    """The handler in small: echoes the input as items; an error item for ``fail``."""
    job_input = job["input"]
    if job_input.get("fail"):
        yield error_response(400, "no good", param="fail")
        return
    if job_input.get("sse"):  # an OpenAI stream's items: SSE text, the last [DONE]
        for event in (*(f"data: {{\"i\": {i}}}\n\n" for i in range(job_input["sse"])), "data: [DONE]\n\n"):
            yield event
        return
    for i in range(job_input.get("items", 2)):
        yield {"i": i, "input": job_input}


class Engine:
    dead = False
    deaths = 0

    def on_death(self):
        self.deaths += 1


def serving_app(**settings) -> tuple[WorkerApp, Engine]:
    app, engine = WorkerApp(max_body_bytes=1000), Engine()
    app.serve(Serving(vllm_app, ROUTES, run_job, Deadlines(), WorkerSettings.model_validate(settings),
                      is_dead=lambda: engine.dead, on_death=engine.on_death))
    return app, engine


def call(app, method, path, body=None, content_type="application/json"):
    async def go():
        async with request(app, method, path, body, content_type) as response:
            return response.status, b"".join([chunk async for chunk in response.body]).decode()
    return asyncio.run(go())


def ping_headers(app) -> dict[str, str]:
    async def go():
        async with request(app, "GET", "/ping") as response:
            return response.headers
    return asyncio.run(go())


def test_a_ping_while_starting_closes_its_connection_and_one_while_serving_keeps_it():
    """The starting server stops as the port's server moves to the engine's loop: a client that kept
    its connection open would have its next ping cut (seen: RemoteProtocolError in the suite)."""
    assert ping_headers(WorkerApp()) == {"connection": "close"}
    assert ping_headers(serving_app()[0]) == {}


def test_ping_answers_by_phase_and_an_engine_death_is_reported_once_per_ping():
    app = WorkerApp()
    assert call(app, "GET", "/ping")[0] == 204
    app.fail(StartupError("no model"))
    assert call(app, "GET", "/ping")[0] == 200  # RunPod routes callers here, to learn why
    app, engine = serving_app()
    assert call(app, "GET", "/ping")[0] == 200 and engine.deaths == 0
    engine.dead = True
    assert call(app, "GET", "/ping")[0] == 503 and engine.deaths == 1
    app.phase = Phase.DRAINING
    assert call(app, "GET", "/ping")[0] == 503


@pytest.mark.parametrize(("path", "dialect"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                               ("/runsync", "job")])
def test_a_worker_that_is_not_serving_refuses_in_the_routes_dialect(path, dialect):
    app = WorkerApp()
    app.fail(StartupError("MODEL_NAME='x': no such repo"))
    status, text = call(app, "POST", path, {})
    body = json.loads(text)
    assert status == 503
    if dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    elif dialect == "job":
        assert body["status"] == "FAILED" and "no such repo" in json.loads(body["error"])["message"]
    else:
        assert body["error"]["code"] == 503 and "could not start: MODEL_NAME='x'" in body["error"]["message"]
    assert "the worker is starting" in call(WorkerApp(), "POST", path, {})[1]


@pytest.mark.parametrize(("path", "fragment"), [
    ("/metrics", "operational"), ("/run", "has no queue"), ("/status/j1", "has no queue"),
    ("/v1/elsewhere", "this worker serves: /ping, /runsync, /stream, /tokenize, /v1/chat/completions")])
def test_routes_not_served_get_a_404_that_says_why(path, fragment):
    status, text = call(serving_app()[0], "POST", path, {})
    assert status == 404 and fragment in json.loads(text)["error"]["message"]


def test_a_body_over_the_limit_is_refused_before_vllm_or_the_handler_reads_it():
    app = serving_app()[0]
    for path in ("/v1/chat/completions", "/runsync"):
        status, text = call(app, "POST", path, b"x" * 1001)
        assert status == 413 and "above the 1000" in text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/runsync"])
def test_a_body_sent_without_its_length_is_refused_once_it_passes_the_limit_and_the_rest_is_left_unread(path):
    """Chunked: no Content-Length to refuse it by. The body is counted as it is read, and neither vLLM
    nor the handler sees any of it."""
    app, reads = serving_app()[0], []
    app.serving = dataclasses.replace(app.serving, vllm_app=None, run_job=None)  # either would fail

    async def receive():  # a client that would send 300 bytes at a time for ever
        reads.append(300)
        return {"type": "http.request", "body": b"x" * 300, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json")]}
    status, body = asyncio.run(answer(app, scope, receive))
    assert status == 413 and "above the 1000 bytes" in str(body) and len(reads) == 4
    if path == "/v1/messages":
        assert body["error"]["type"] == "request_too_large"


async def answer(app, scope, receive) -> tuple[int, dict]:
    """The app's status and JSON body for one request, as the server would send them."""
    sent = []

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_body_nested_too_deep_gets_a_400_that_says_so_and_one_at_the_limit_reaches_vllm():
    app, seen = serving_app(JOB_TIMEOUT=5)[0], []
    app.max_body_bytes = 2**20

    async def counting_app(scope, receive, send):
        seen.append(scope["path"])
        if scope["path"] == "/tokenize":  # a body it does not parse
            return await respond(send, 200, {})
        await vllm_app(scope, receive, send)

    app.serving = dataclasses.replace(app.serving, vllm_app=counting_app)
    for levels in (MAX_DEPTH + 1, 5000):  # the second, too deep for Python's parser
        body = ('{"events": 1, "tools": ' + nested(levels - 1) + "}").encode()
        for path, dialect in (("/v1/chat/completions", "code"), ("/v1/messages", "type")):
            status, text = call(app, "POST", path, body)
            error = json.loads(text)["error"]
            assert status == 400 and dialect in error
            assert "the request body is nested more than 128 levels deep" in error["message"]
    assert seen == []
    at_limit = ('{"events": 1, "tools": ' + nested(MAX_DEPTH - 1) + "}").encode()
    assert call(app, "POST", "/v1/chat/completions", at_limit)[0] == 200 and seen == ["/v1/chat/completions"]
    # A body not said to be JSON is vLLM's to answer.
    assert call(app, "POST", "/tokenize", nested(5000).encode(), "text/plain")[0] == 200


def test_a_job_input_too_deep_to_parse_is_the_handlers_400_as_on_the_queue():
    app = serving_app()[0]
    app.max_body_bytes = 2**20
    app.serving = dataclasses.replace(app.serving, run_job=handler.handler)
    for path in ("/runsync", "/stream"):
        body = '{"input": {"prompt": "x", "deep": ' + nested(5000) + "}}"
        status, text = call(app, "POST", path, body.encode())
        error = json.loads(text)["error"]
        error = json.loads(error) if path == "/runsync" else error  # RunPod's FAILED job: its error as text
        assert status == 400 and error["param"] == "input"
        assert "the job input is nested more than 128 levels" in error["message"]
    # Split down to the input's keys: the error is in the dialect of the route the job names.
    body = '{"input": {"openai_route": "/v1/messages", "openai_input": {"tools": ' + nested(5000) + "}}}"
    status, text = call(app, "POST", "/runsync", body.encode())
    assert status == 400 and json.loads(json.loads(text)["error"])["type"] == "invalid_request_error"


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_vllm_answers_pass_and_its_validation_errors_take_the_routes_dialect():
    app = serving_app()[0]
    status, text = call(app, "POST", "/v1/chat/completions", {"events": 3})
    assert status == 200 and [d for _, d in sse_events.parse(text)] == ["0", "1", "2", "[DONE]"]
    assert json.loads(call(app, "POST", "/v1/chat/completions", {"invalid": True})[1])["error"]["type"] == "Bad Request"
    status, text = call(app, "POST", "/v1/messages", {"invalid": True})
    assert status == 400 and json.loads(text) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "bad field"}}
    # A stored response lives in one worker's memory: its 404 says so, as on the queue.
    assert "memory of the worker" in call(app, "GET", "/v1/responses/r1")[1]
    assert json.loads(call(app, "POST", "/v1/tokenize", {})[1]) == {"path": "/tokenize"}  # the /v1 alias


@pytest.mark.parametrize(("events", "status", "last", "limits"), [
    (0, 408, None, {"JOB_TIMEOUT": 0.3}), (50, 200, "error", {"JOB_TIMEOUT": 0.3}),
    (0, 408, None, {"JOB_TIMEOUT": 5, "REQUEST_TIMEOUT": 0.3})])
def test_job_timeout_ends_a_request_with_the_workers_error(events, status, last, limits):
    """Before the answer started: the 408 itself; once a stream started: an error event ends it. The
    smaller of JOB_TIMEOUT and REQUEST_TIMEOUT applies, and is named."""
    app = serving_app(**limits)[0]

    async def slow_app(scope, receive, send):
        if not events:
            await asyncio.sleep(60)
        await vllm_app(scope, receive, send)

    app.serving = dataclasses.replace(app.serving, vllm_app=slow_app)
    got_status, text = call(app, "POST", "/v1/chat/completions", {"events": events, "pause": 0.05})
    limit = min(limits, key=limits.get)
    assert got_status == status and f"ran past its timeout of 0.3 s ({limit})" in text
    if last:
        assert json.loads(sse_events.parse(text)[-1][1])["error"]["code"] == 408


def test_drain_refuses_new_requests_and_ends_the_ones_in_flight_at_the_grace_periods_end():
    app = serving_app(SHUTDOWN_GRACE_PERIOD=0.3)[0]

    async def go():
        async with request(app, "POST", "/v1/chat/completions", {"events": 1000, "pause": 0.01}) as response:
            chunks = [await anext(response.body)]
            drained = asyncio.create_task(app.drain())
            await asyncio.sleep(0)
            assert call_in_loop_status(app) == 503
            chunks += [chunk async for chunk in response.body]
            await drained
            return b"".join(chunks).decode()

    text = asyncio.run(go())
    error = json.loads(sse_events.parse(text)[-1][1])["error"]
    assert error["code"] == 503 and "0.3 s grace period (SHUTDOWN_GRACE_PERIOD)" in error["message"]
    assert app.serving.deadlines.running == 0


def test_a_health_port_of_its_own_answers_ping_and_nothing_else():
    app = serving_app()[0]
    health = PingOnly(app)
    assert call(health, "GET", "/ping")[0] == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/runsync")):
        status, text = call(health, method, path, {"events": 1})
        assert status == 404 and "answers /ping only" in json.loads(text)["error"]["message"]
    app.phase = Phase.DRAINING
    assert call(health, "GET", "/ping")[0] == 503
    assert call(PingOnly(WorkerApp()), "GET", "/ping")[0] == 204


def call_in_loop_status(app) -> int:
    """/ping's status, answered synchronously: the app does not await anything for it."""
    sent = []

    async def send(message):
        sent.append(message)

    coroutine = app({"type": "http", "path": "/ping", "method": "GET", "headers": []}, None, send)
    with pytest.raises(StopIteration):
        coroutine.send(None)
    return sent[0]["status"]


def test_runsync_answers_as_runpods_runsync_and_stream_an_event_per_item():
    app = serving_app()[0]
    status, text = call(app, "POST", "/runsync", {"input": {"prompt": "p", "items": 3}})
    body = json.loads(text)
    assert status == 200 and body["status"] == "COMPLETED" and [o["i"] for o in body["output"]] == [0, 1, 2]
    status, text = call(app, "POST", "/runsync", {"input": {"fail": True}})
    assert status == 400 and json.loads(json.loads(text)["error"])["param"] == "fail"
    status, text = call(app, "POST", "/stream", {"input": {"prompt": "p", "items": 3, "max_batch_size": 9}})
    events = sse_events.parse(text)
    assert status == 200 and events[-1] == (None, "[DONE]") and len(events) == 4
    # The batching knobs are the engine step's, whatever the job said.
    assert json.loads(events[0][1])["input"] == {"prompt": "p", "items": 3, "stream": True, "max_batch_size": 1,
                                                 "min_batch_size": 1, "batch_size_growth_factor": 1}
    status, text = call(app, "POST", "/stream", {"input": {"fail": True}})
    assert status == 400 and json.loads(text)["error"]["param"] == "fail"
    status, text = call(app, "POST", "/stream", {"input": {"prompt": "p", "sse": 2}})  # SSE text as it is
    assert (status, text) == (200, 'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: [DONE]\n\n')
    for body, fragment in ((b"{nope", "not JSON"), (b"[]", 'expected {"input"')):
        status, text = call(app, "POST", "/runsync", body)
        assert status == 400 and fragment in json.loads(json.loads(text)["error"])["message"]


@pytest.mark.parametrize("path", ["/runsync", "/stream"])
def test_a_caller_who_leaves_ends_the_job(path):
    """The job's items stop being drawn, and its generator is closed (which aborts its vLLM request)."""
    app, closed = serving_app()[0], asyncio.Event()

    async def endless(job):
        try:
            while True:
                yield {"tokens": ["x"]}
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    app.serving = dataclasses.replace(app.serving, run_job=endless)

    async def call_then_wait():
        async with request(app, "POST", path, {"input": {"prompt": "p"}}) as response:  # /runsync: waits here
            await anext(response.body)
            await asyncio.sleep(60)

    async def go():
        calling = asyncio.create_task(call_then_wait())
        await asyncio.sleep(0.2)
        calling.cancel()  # the caller leaves, mid-stream or while the job runs
        await asyncio.wait_for(closed.wait(), 10)

    asyncio.run(go())


def test_the_servers_connections_send_each_write_at_once():
    """TCP_NODELAY on every accepted connection (``server.bind``): otherwise a stream's small writes
    wait for the client's delayed ACKs, some 40 ms each."""
    from worker.load_balancer.server import bind

    async def go():
        nodelay = asyncio.get_running_loop().create_future()

        def accepted(reader, writer):
            nodelay.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listening = bind(0)
        server = await asyncio.start_server(accepted, sock=listening)
        _, writer = await asyncio.open_connection("127.0.0.1", listening.getsockname()[1])
        try:
            return await asyncio.wait_for(nodelay, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(go()) != 0
