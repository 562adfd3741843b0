"""The local endpoint's load-balancing mode without vLLM: the balancer in front of small fake workers
(aiohttp servers started here, which the tests steer), then ``python -m endpoint --load-balancer``
with ``tests/stub_lb_worker.py``: readiness from /ping, the least busy worker, worker affinity, the
relay (streams chunk by chunk, headers, paths and queries), RunPod's limits, failing workers, the API
key, and what the workers are started with."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import REPO
from dev_env import free_port
from yarl import URL

from endpoint.balancer import BalancerConfig, create_balancer_app
from endpoint.pool import WORKER_ID, Pool, Worker
from endpoint.worker_env import worker_env

STUB = REPO / "tests" / "stub_lb_worker.py"
EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}


class FakeWorker:
    """A worker's HTTP server whose /ping status the test sets; it records each request and can
    hold one until the test releases it (``release[name]``)."""

    def __init__(self, name: str, ping: int = 200, listening: bool = True,
                 separate_health: bool = False) -> None:
        """``listening=False``: nothing listens on its port (its /ping too, unless on a port of its own)."""
        self.name, self.ping_status, self.listening = name, ping, listening
        self.requests: list[str] = []  # the paths, in order
        self.held: dict[str, asyncio.Event] = {}  # name → released
        self.closed: list[str] = []  # requests that ended before their answer did
        self.servers = [TestServer(self._app(), port=0) for _ in range(2 if separate_health else 1)]

    def _app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/ping", self.ping), web.route("*", "/echo", self.echo),
                        web.get("/hold/{name}", self.hold), web.get("/sse/{name}", self.sse),
                        web.get("/big", self.big), web.get("/big-stream", self.big_stream),
                        web.get("/die", self.die), web.post("/v1/chat/completions", self.die_mid_stream)])
        return app

    async def start(self) -> Worker:
        main, *health = self.servers
        for server in ([main] if self.listening else []) + health:
            await server.start_server()
        port = main.port if self.listening else free_port()
        return Worker(self.name, port, health[0].port if health else port)

    async def close(self) -> None:
        for server in self.servers:
            await server.close()

    def release(self, name: str) -> None:
        self.held.setdefault(name, asyncio.Event()).set()

    async def _wait(self, request: web.Request, name: str) -> None:
        """Until the test releases ``name``; a request closed meanwhile is recorded in ``closed``."""
        try:
            await self.held.setdefault(name, asyncio.Event()).wait()
        except asyncio.CancelledError:
            self.closed.append(request.path)
            raise

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=self.ping_status)

    async def echo(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        body = (await request.read()).decode()
        return web.json_response({"worker": self.name, "method": request.method, "raw_path": request.raw_path,
                                  "headers": list(request.headers.items()), "body": body},
                                 headers={"Keep-Alive": "timeout=9", "Proxy-Authenticate": "Basic",
                                          "X-Worker": "1"})

    async def hold(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        await self._wait(request, request.match_info["name"])
        return web.json_response({"worker": self.name})

    async def sse(self, request: web.Request) -> web.StreamResponse:
        """One event, then, once released, a second one and the end."""
        self.requests.append(request.path)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENT)
        await self._wait(request, request.match_info["name"])
        await response.write(EVENT + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"x" * int(request.query["n"]))

    async def big_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(int(request.query["n"]) // 100):
            await response.write(b"x" * 100)
        await response.write_eof()
        return response

    async def die(self, request: web.Request) -> web.Response:
        """The worker's process dies before it answers."""
        self.requests.append(request.path)
        request.transport.abort()
        return web.Response()

    async def die_mid_stream(self, request: web.Request) -> web.StreamResponse:
        """A streamed chat completion whose worker dies after the first token, once released."""
        self.requests.append(request.path)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(CHUNK)}\n\n".encode())
        await self._wait(request, "die")
        request.transport.abort()
        return response


async def until(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def balanced(scenario, *workers: FakeWorker, **config):
    """``scenario(client, pool, workers)`` against the balancer in front of ``workers``, once the
    balancer has asked each one's /ping."""
    async def run():
        pool = Pool([await worker.start() for worker in workers])
        app = create_balancer_app(pool, BalancerConfig(**{"ping_interval_seconds": 0.05, **config}))
        try:
            async with TestClient(TestServer(app)) as client:
                await until(lambda: all(w.state != "not started" for w in pool.workers))
                return await scenario(client, pool)
        finally:
            for worker in workers:
                await worker.close()
    return asyncio.run(asyncio.wait_for(run(), 60))


async def served_by(client: TestClient, path: str = "/echo", **kwargs) -> str:
    response = await client.get(path, **kwargs)
    assert response.status == 200, await response.text()
    return (await response.json())["worker"]


def test_requests_go_only_to_workers_whose_ping_answers_200(capsys):
    w0, w1 = FakeWorker("w0"), FakeWorker("w1", ping=204)

    async def scenario(client, pool):
        assert [await served_by(client) for _ in range(6)] == ["w0"] * 6
        assert (await client.get("/ping")).status == 200  # the balancer's own: a worker is ready
        w0.ping_status = 503
        await until(lambda: not pool.by_id["w0"].ready)
        assert (await client.get("/ping")).status == 204
        w1.ping_status = 200
        await until(lambda: pool.by_id["w1"].ready)
        assert await served_by(client) == "w1"

    balanced(scenario, w0, w1)
    assert w1.requests == ["/echo"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("endpoint:")]
    assert lines[0].startswith("endpoint: w0 ready (port ")
    assert lines[1:] == ["endpoint: w0 not ready: /ping answered 503", lines[2]]
    assert lines[2].startswith("endpoint: w1 ready (port ")


def test_a_request_waits_for_a_worker_to_become_ready():
    w0 = FakeWorker("w0", ping=204)

    async def scenario(client, pool):
        request = asyncio.ensure_future(served_by(client))
        await asyncio.sleep(0.3)
        assert not request.done() and w0.requests == []
        w0.ping_status = 200
        return await request

    assert balanced(scenario, w0, worker_wait_seconds=30) == "w0"


def test_no_ready_worker_within_the_wait_is_a_400_that_says_why():
    async def scenario(client, pool):
        response = await client.post("/v1/chat/completions", json={})
        return response.status, await response.json()

    status, body = balanced(scenario, FakeWorker("w0", ping=204), FakeWorker("w1", listening=False),
                            worker_wait_seconds=0.3)
    assert status == 400
    assert body["error"].startswith(
        "no worker was ready within 0.3 s (w0: /ping answered 204; w1: nothing listens on port ")


def test_the_ready_worker_with_the_fewest_requests_in_flight_is_chosen_ties_in_turn():
    w0, w1 = FakeWorker("w0"), FakeWorker("w1")

    async def scenario(client, pool):
        async def quick(held: int) -> str:
            """A request's worker, once the balancer has counted it done (``held`` still in flight)."""
            worker = await served_by(client)
            await until(lambda: sum(w.in_flight for w in pool.workers) == held)
            return worker

        first = asyncio.ensure_future(served_by(client, "/hold/a"))
        await until(lambda: w0.requests == ["/hold/a"])  # ties: in turn, from the first
        second = asyncio.ensure_future(served_by(client, "/hold/b"))
        await until(lambda: w1.requests == ["/hold/b"])  # w0 is busy
        w1.release("b")
        assert await second == "w1"
        await until(lambda: pool.by_id["w1"].in_flight == 0)
        busy = [await quick(held=1) for _ in range(3)]  # w0 still holds a: each goes to w1
        w0.release("a")
        assert await first == "w0"
        await until(lambda: pool.by_id["w0"].in_flight == 0)
        return busy, [await quick(held=0) for _ in range(4)]  # both idle: in turn, after w1

    assert balanced(scenario, w0, w1) == (["w1"] * 3, ["w0", "w1", "w0", "w1"])


def test_each_answer_names_its_worker_and_a_request_naming_one_goes_there():
    w0, w1 = FakeWorker("w0"), FakeWorker("w1")

    async def scenario(client, pool):
        async def by(affinity: str) -> str:
            return await served_by(client, headers={WORKER_ID.lower(): affinity})

        answer = await client.get("/echo")
        body = await answer.json()
        assert answer.headers[WORKER_ID] == body["worker"] == "w0"  # the first in turn
        assert WORKER_ID.lower() not in {name.lower() for name, _ in body["headers"]}
        held = asyncio.ensure_future(served_by(client, "/hold/a", headers={WORKER_ID: "strict w1"}))
        await until(lambda: w1.requests == ["/hold/a"])
        # w1 is the busier, yet the one named; an id it does not have, or none: the usual choice.
        chosen = [await by("w1"), await by(" strict  w1 "), await by("strict-resume w1"), await by("w9"),
                  await by("")]
        w1.release("a")
        assert await held == "w1"
        return chosen

    assert balanced(scenario, w0, w1) == ["w1", "w1", "w1", "w0", "w0"]


def test_a_named_worker_that_is_not_ready_soft_falls_back_strict_waits_unknown_is_404():
    w0, w1 = FakeWorker("w0", ping=503), FakeWorker("w1")

    async def scenario(client, pool):
        async def strict(worker: str) -> tuple[int, dict]:
            response = await client.get("/echo", headers={WORKER_ID: f"strict {worker}"})
            return response.status, await response.json()

        assert await served_by(client, headers={WORKER_ID: "w0"}) == "w1"
        timed_out, gone = await strict("w0"), await strict("w9")
        bad = [await client.get("/echo", headers={WORKER_ID: value}) for value in ("strict", "w0 w1")]
        waiting = asyncio.ensure_future(strict("w0"))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        w0.ping_status = 200  # its restart, say
        return timed_out, gone, [(r.status, (await r.json())["error"]) for r in bad], await waiting

    timed_out, gone, bad, waited = balanced(scenario, w0, w1, affinity_wait_seconds=0.5)
    assert timed_out == (400, {"error": "timed out waiting for worker w0 (0.5 s; /ping answered 503)"})
    assert gone == (404, {"error": "affinity_worker_gone: this endpoint has no worker 'w9' (w0, w1)"})
    assert [status for status, _ in bad] == [400, 400]
    assert bad[0][1] == ("X-Runpod-Worker-Id must be <worker-id>, strict <worker-id> or strict-resume "
                         "<worker-id>, not 'strict'")
    assert waited[0] == 200 and waited[1]["worker"] == "w0"
    assert w0.requests == ["/echo"] and w1.requests == ["/echo"]


def test_server_sent_events_are_relayed_as_they_come():
    w0 = FakeWorker("w0")

    async def scenario(client, pool):
        response = await client.get("/sse/end")
        assert response.headers["Content-Type"] == "text/event-stream"
        first = b""
        while not first.endswith(b"\n\n"):
            first += await response.content.readline()
        w0.release("end")  # only now does the worker send the rest
        return first, await response.read()

    assert balanced(scenario, w0) == (EVENT, EVENT + b"data: [DONE]\n\n")


def test_a_client_that_leaves_closes_its_request_on_the_worker():
    w0 = FakeWorker("w0")

    async def scenario(client, pool):
        response = await client.get("/sse/never")
        assert (await response.content.readline()).startswith(b"data: ")
        response.close()  # the client hangs up mid-stream
        await until(lambda: w0.closed == ["/sse/never"])  # the worker's request ends too
        await until(lambda: pool.by_id["w0"].in_flight == 0)
        return pool.by_id["w0"].ready

    assert balanced(scenario, w0)  # a client leaving says nothing about the worker


def test_a_request_body_over_the_limit_is_a_413_and_reaches_no_worker():
    w0 = FakeWorker("w0")

    async def scenario(client, pool):
        over = await client.post("/echo", data=b"x" * 1001)
        at_limit = await client.post("/echo", data=b"x" * 1000)
        return over.status, await over.json(), at_limit.status

    status, body, at_limit = balanced(scenario, w0, max_body_bytes=1000)
    assert (status, body, at_limit) == (413, {"error": "the request body is larger than 1000 bytes "
                                              "(RunPod's limit)"}, 200)
    assert w0.requests == ["/echo"]


def test_a_response_over_the_limit_is_an_error_or_cut_off():
    async def scenario(client, pool):
        declared = await client.get("/big?n=1001")  # its length known before anything is sent
        streamed = await client.get("/big-stream?n=2000")
        assert streamed.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await streamed.read()
        return declared.status, await declared.json(), (await client.get("/big?n=1000")).status

    status, body, at_limit = balanced(scenario, FakeWorker("w0"), max_response_bytes=1000)
    assert (status, at_limit) == (502, 200) and "larger than 1000 bytes" in body["error"]


def test_a_request_over_the_timeout_is_a_524_or_cut_off_and_closed_on_its_worker():
    w0 = FakeWorker("w0")

    async def scenario(client, pool):
        unanswered = await client.get("/hold/never")
        streaming = await client.get("/sse/never")
        assert streaming.status == 200 and (await streaming.content.readline()).startswith(b"data: ")
        with pytest.raises(aiohttp.ClientPayloadError):
            await streaming.read()
        await until(lambda: len(w0.closed) == 2)  # the worker sees both requests end
        return unanswered.status, await unanswered.json()

    status, body = balanced(scenario, w0, request_timeout_seconds=1)
    assert (status, body) == (524, {"error": "no complete answer within 1 s (RunPod's limit)"})
    assert sorted(w0.closed) == ["/hold/never", "/sse/never"]


def test_a_worker_that_refuses_is_a_502_and_stops_being_ready_at_once():
    async def scenario(client, pool):
        await until(lambda: pool.by_id["w0"].ready)  # its /ping, on a port of its own, answers 200
        refused = await client.get("/echo")
        assert not pool.by_id["w0"].ready  # at once, not at its next /ping (in an hour)
        after = await client.get("/echo")
        return refused.status, await refused.json(), after.status

    status, body, after = balanced(scenario, FakeWorker("w0", listening=False, separate_health=True),
                                   ping_interval_seconds=3600, worker_wait_seconds=0.3)
    assert (status, after) == (502, 400)
    assert body["error"].startswith("worker w0 failed: its connection failed before answering")


def test_a_worker_that_dies_before_answering_is_a_502_not_retried_and_the_others_serve():
    w0, w1 = FakeWorker("w0"), FakeWorker("w1")

    async def scenario(client, pool):
        died = await client.get("/die")  # w0, the first in turn
        assert not pool.by_id["w0"].ready and died.headers[WORKER_ID] == "w0"
        return died.status, [await served_by(client) for _ in range(2)]

    status, after = balanced(scenario, w0, w1, ping_interval_seconds=3600)
    assert (status, after) == (502, ["w1", "w1"])
    assert w0.requests == ["/die"] and w1.requests == ["/echo", "/echo"]


def test_a_worker_dying_mid_stream_is_an_error_for_a_streaming_openai_client():
    w0 = FakeWorker("w0")

    async def scenario(client, pool):
        sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        stream = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                   stream=True)
        received = []
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            async for chunk in stream:
                received.append(chunk.choices[0].delta.content)
                w0.release("die")  # the worker dies once its first token has reached the client
        return received, pool.by_id["w0"].ready

    assert balanced(scenario, w0, ping_interval_seconds=3600) == (["hi"], False)


def test_the_api_key_is_required_and_not_passed_on():
    w0 = FakeWorker("w0")

    async def scenario(client, pool):
        bare = await client.get("/echo")
        ping = await client.get("/ping")
        bearer = await client.get("/echo", headers={"Authorization": "Bearer k"})
        anthropic_style = await client.get("/echo", headers={"x-api-key": "k"})
        seen = [{name.lower() for name, _ in (await r.json())["headers"]} for r in (bearer, anthropic_style)]
        return bare.status, await bare.json(), ping.status, bearer.status, anthropic_style.status, seen

    bare, body, ping, bearer, anthropic_style, seen = balanced(scenario, w0, api_key="k")
    assert body == {"error": "missing or wrong API key"}
    assert (bare, ping, bearer, anthropic_style) == (401, 401, 200, 200)
    assert all({"authorization", "x-api-key"}.isdisjoint(headers) for headers in seen)


def test_the_method_path_query_body_and_end_to_end_headers_pass_as_sent():
    path = "/echo?b=%20c&a=1&a=2&e=f+g&s=%2F&empty="
    sent = {"Connection": "X-Private", "X-Private": "1", "Keep-Alive": "timeout=5", "TE": "trailers",
            "Proxy-Authorization": "Basic eA==", "X-Kept": "yes", "Content-Type": "text/plain"}

    async def scenario(client, pool):
        url = URL(str(client.make_url("/")).rstrip("/") + path, encoded=True)
        response = await client.session.patch(url, data=b"the body", headers=sent)
        return await response.json(), response.headers

    echo, headers = balanced(scenario, FakeWorker("w0"))
    assert (echo["method"], echo["raw_path"], echo["body"]) == ("PATCH", path, "the body")
    names = {name.lower(): value for name, value in echo["headers"]}
    assert (names["x-kept"], names["content-type"], names["content-length"]) == ("yes", "text/plain", "8")
    assert {"x-private", "keep-alive", "te", "proxy-authorization"}.isdisjoint(names)
    assert headers["X-Worker"] == "1" and "Keep-Alive" not in headers and "Proxy-Authenticate" not in headers


def test_load_balancing_workers_get_their_ports_and_no_job_protocol(monkeypatch):
    monkeypatch.setenv("RUNPOD_WEBHOOK_GET_JOB", "http://elsewhere/job-take")  # never passed on
    monkeypatch.delenv("ENDPOINT_TYPE", raising=False)
    env = worker_env("http://127.0.0.1:8000", "local-worker-1", "k", (4001, 4002))
    names = ("ENDPOINT_TYPE", "PORT", "PORT_HEALTH", "RUNPOD_POD_ID", "RUNPOD_AI_API_KEY")
    assert {name: env[name] for name in names} == {
        "ENDPOINT_TYPE": "load_balancer", "PORT": "4001", "PORT_HEALTH": "4002",
        "RUNPOD_POD_ID": "local-worker-1", "RUNPOD_AI_API_KEY": "k"}
    assert not [k for k in env if k.startswith("RUNPOD_WEBHOOK_")]
    queue = worker_env("http://127.0.0.1:8000/v2/local", "local-worker-1", "k")
    assert queue["RUNPOD_WEBHOOK_GET_JOB"] == "http://127.0.0.1:8000/v2/local/job-take/$ID?gpu=local"
    assert {k.removeprefix("RUNPOD_WEBHOOK_") for k in queue if k.startswith("RUNPOD_WEBHOOK_")} == {
        "GET_JOB", "POST_OUTPUT", "POST_STREAM", "PING"}
    assert "ENDPOINT_TYPE" not in queue


class Endpoint:
    """``python -m endpoint --load-balancer`` with stub workers, its output in ``log``."""

    def __init__(self, tmp_path, *args: str, **env: str) -> None:
        self.port, self.log = free_port(), tmp_path / "endpoint.log"
        inherited = {k: v for k, v in os.environ.items() if k not in ("ENDPOINT_TYPE", "PORT", "PORT_HEALTH")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "endpoint", "--load-balancer", "--port", str(self.port), "--api-key", "k",
             "--handler", str(STUB), *args], cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            env={**inherited, **env})
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30,
                                 headers={"Authorization": "Bearer k"})

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, times: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.text().count(text) < times:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text()
            time.sleep(0.1)

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=60)


@pytest.mark.parametrize("separate", [False, True], ids=["one port", "separate health port"])
def test_the_cli_starts_load_balancing_workers_on_ports_of_their_own(tmp_path, separate):
    endpoint = Endpoint(tmp_path, "--workers", "2", *(["--separate-health-port"] if separate else []))
    try:
        endpoint.wait_for("endpoint: 2 worker(s) ready in ")
        assert endpoint.http.get("/ping").status_code == 200
        envs = [endpoint.http.get("/env").json() for _ in range(2)]
    finally:
        status = endpoint.stop()
    assert status == 0
    text = endpoint.text()
    assert text.startswith(
        f"endpoint: starting 2 worker(s) (load balancer)\n  HTTP: http://127.0.0.1:{endpoint.port}/<path> "
        "(any route of the worker: /v1/chat/completions, /v1/messages, /runsync, /ping)")
    assert f'OpenAI(base_url="http://127.0.0.1:{endpoint.port}/v1"' in text
    assert [env["RUNPOD_POD_ID"] for env in envs] == ["local-worker-0", "local-worker-1"]  # ties: in turn
    ports = [int(env[name]) for env in envs for name in ("PORT", "PORT_HEALTH")]
    assert len(set(ports)) == (4 if separate else 2) and endpoint.port not in ports
    for env in envs:
        assert env["ENDPOINT_TYPE"] == "load_balancer" and (env["PORT"] != env["PORT_HEALTH"]) == separate
        assert f"endpoint: {env['RUNPOD_POD_ID']} ready (port {env['PORT']}" in text
        assert not [name for name in env if name.startswith("RUNPOD_WEBHOOK_")]


def test_a_worker_that_exits_is_a_502_and_restarted_while_the_other_serves(tmp_path):
    # A restart is ready 2.5 s after an exit at the earliest: the supervisor's 1 s back-off, then the start.
    endpoint = Endpoint(tmp_path, "--workers", "2", STUB_START_SECONDS="1.5")
    try:
        endpoint.wait_for("endpoint: 2 worker(s) ready in ")
        assert endpoint.http.post("/exit").status_code == 502  # local-worker-0, first in turn, dies
        survivors = {endpoint.http.get("/env").json()["RUNPOD_POD_ID"] for _ in range(2)}
        endpoint.wait_for("endpoint: local-worker-0 exited with status 3")
        endpoint.wait_for("endpoint: local-worker-0 ready", times=2)  # its restart
    finally:
        status = endpoint.stop()
    assert status == 0
    assert survivors == {"local-worker-1"}
    assert "endpoint: local-worker-0 not ready: its connection failed before answering" in endpoint.text()


def test_an_image_worker_gets_its_ports_in_its_container(tmp_path):
    from test_endpoint_supervisor import FAKE_BUILDAH  # buildah's stand-in, which logs its calls

    log, fake = tmp_path / "buildah.log", tmp_path / "bin" / "buildah"
    fake.parent.mkdir()
    stub = f"import runpy; runpy.run_path({str(STUB)!r}, run_name='__main__')"  # the image's command
    fake.write_text(FAKE_BUILDAH.format(python=sys.executable, log=str(log), code=stub))
    fake.chmod(0o755)
    endpoint = Endpoint(tmp_path, "--workers", "1", "--image", "localhost/worker:test",
                        PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    try:
        endpoint.wait_for("endpoint: 1 worker(s) ready in ")
        env = endpoint.http.get("/env").json()
    finally:
        status = endpoint.stop()
    assert status == 0
    run = next(call for call in map(json.loads, log.read_text().splitlines()) if call[0] == "run")
    options = run[:run.index("--")]
    for name in ("ENDPOINT_TYPE", "PORT", "PORT_HEALTH"):
        assert f"--env={name}={env[name]}" in options
    assert not [option for option in options if option.startswith("--env=RUNPOD_WEBHOOK_")]
