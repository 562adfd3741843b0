"""The local endpoint's HTTP layer without workers (the tests play the worker over its job
protocol): auth, limits, unknown ids, /health, the OpenAI relay, execution timeouts."""

import asyncio
import json
import re

import anthropic
import openai
import pytest
import sse_events
from aiohttp.test_utils import TestClient, TestServer
from endpoint.app import EndpointConfig, create_app
from endpoint.jobs import JobStore

from worker.wire.body_envelope import Envelope
from worker.jobs.deadlines import DeadlinePassed, deadline_error
from worker.wire.dialects import is_anthropic_route

CHAT = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}


def with_client(scenario, execution_timeout=600.0, **config):
    async def run():
        app = create_app(EndpointConfig(**config), JobStore(execution_timeout))
        async with TestClient(TestServer(app)) as client:
            return await scenario(client)
    return asyncio.run(run())


async def take(client, worker="w1"):
    """The next job, polled for as the runpod SDK's worker loop does."""
    while (taken := await client.get(f"/v2/local/job-take/{worker}?gpu=x&job_in_progress=0")).status != 200:
        pass
    return await taken.json()


async def post(client, kind, job, body, worker="w1"):
    """job-stream or job-done, as the runpod SDK posts them."""
    await client.post(f"/v2/local/{kind}/{worker}/{job['id']}?gpu=x", data=json.dumps(body))


async def answered(request, worker):
    """A client request's response, with the worker serving it meanwhile."""
    serving = asyncio.ensure_future(worker)
    try:
        return await request
    finally:
        await serving


def test_api_key_is_required_when_set():
    async def scenario(client):
        bare = await client.post("/v2/local/run", json={"input": {}})
        bearer = await client.post("/v2/local/run", json={"input": {}},
                                   headers={"Authorization": "Bearer k"})
        anthropic_style = await client.get("/v2/local/health", headers={"x-api-key": "k"})
        return bare.status, bearer.status, anthropic_style.status

    assert with_client(scenario, api_key="k") == (401, 200, 200)


def test_request_bodies_are_size_limited():
    async def scenario(client):
        response = await client.post("/v2/local/run", data=json.dumps({"input": "x" * 2000}))
        return response.status

    assert with_client(scenario, max_body_bytes=1000) == 413


def test_unknown_jobs_are_404_and_bad_bodies_400():
    async def scenario(client):
        statuses = [(await client.get(f"/v2/local/{path}/nope")).status for path in ("status", "stream")]
        statuses.append((await client.post("/v2/local/cancel/nope")).status)
        statuses.append((await client.post("/v2/local/run", data=b"{not json")).status)
        statuses.append((await client.post("/v2/local/run", json={"no_input": 1})).status)
        return statuses

    assert with_client(scenario) == [404, 404, 404, 400, 400]


def test_worker_protocol_round_trip():
    """A job through the routes the runpod SDK's worker loop calls, as the SDK formats them."""
    async def scenario(client):
        job = await (await client.post("/v2/local/run", json={"input": {"prompt": "x"}})).json()
        taken = await (await client.get("/v2/local/job-take/w1?gpu=x&job_in_progress=0")).json()
        await client.post(f"/v2/local/job-stream/w1/{job['id']}?gpu=x&isStream=false",
                          data=json.dumps({"output": "part"}),
                          headers={"Content-Type": "application/x-www-form-urlencoded"})
        stream = await (await client.get(f"/v2/local/stream/{job['id']}")).json()
        await client.post(f"/v2/local/job-done/w1/{job['id']}?gpu=x&isStream=true",
                          data=json.dumps({"output": ["part"]}))
        status = await (await client.get(f"/v2/local/status/{job['id']}")).json()
        empty = await client.get("/v2/local/job-take-batch/w1?gpu=x&batch_size=4&job_in_progress=0")
        return job, taken, stream, status, empty.status

    job, taken, stream, status, empty = with_client(scenario)
    assert taken == {"id": job["id"], "input": {"prompt": "x"}}
    assert stream["status"] == "IN_PROGRESS" and stream["stream"] == [{"output": "part"}]
    assert status["status"] == "COMPLETED" and status["output"] == ["part"] and empty == 204


def test_a_job_nested_too_deep_for_python_is_passed_on_as_it_came():
    """As by RunPod, whose parser takes it: refusing it is the worker's business (a 400)."""
    deep = "[" * 5000 + "]" * 5000

    async def scenario(client):
        for body in ('{"input": {"prompt": "x", "deep": %s}}' % deep, '{"input": {"prompt": "y"}}'):
            await client.post("/v2/local/run", data=body)
        relayed = asyncio.ensure_future(client.post("/v2/local/openai/v1/chat/completions",
                                                    data='{"model": "m", "tools": %s}' % deep))
        await asyncio.sleep(0.1)
        batch = await client.get("/v2/local/job-take-batch/w1?gpu=x&batch_size=4&job_in_progress=0")
        relayed.cancel()  # its client leaves: the job is cancelled
        return await batch.text()

    text = with_client(scenario)
    ids = re.findall(r'"id": "(local-[^"]+)"', text)
    assert text == ('[{"id": "%s", "input": {"prompt": "x", "deep": %s}}, '
                    '{"id": "%s", "input": {"prompt": "y"}}, '
                    '{"id": "%s", "input": {"openai_route": "/v1/chat/completions", "openai_input": '
                    '{"model": "m", "tools": %s}}}]' % (ids[0], deep, ids[1], ids[2], deep))


def test_health_has_runpods_worker_counts_and_each_workers_state():
    """As the supervisor drives the store: one worker calling in, one starting, one exited and
    waiting to restart, whose dead process's heartbeat is not heard."""
    async def run():
        store = JobStore()
        async with TestClient(TestServer(create_app(EndpointConfig(), store))) as client:
            for worker in ("w1", "w2", "w3"):
                store.revive(worker)
            await client.get("/v2/local/ping/w1?gpu=x")
            await store.forget("w3", 1, restart_in=30)
            await client.get("/v2/local/ping/w3?gpu=x")
            return await (await client.get("/v2/local/health")).json()

    health = asyncio.run(run())
    assert health["workers"] == {"idle": 1, "running": 0, "ready": 1, "initializing": 1, "unhealthy": 1,
                                 "throttled": 0}
    assert {w: d["state"] for w, d in health["local"].items()} == {
        "w1": "ready", "w2": "initializing", "w3": "restarting"}
    assert health["local"]["w3"]["lastExitStatus"] == 1 and 0 < health["local"]["w3"]["restartIn"] <= 30


@pytest.mark.parametrize(("shutdown", "status", "anthropic_type"),
                         [(False, 408, "timeout_error"), (True, 503, "overloaded_error")])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
def test_the_workers_own_errors_reach_the_sdks_with_their_status_and_dialect(
        route, shutdown, status, anthropic_type):
    """A job timeout or the shutdown grace period, as the handler words it and the runpod SDK
    posts it (``str()`` of the item's ``error``), through the relay to the official clients."""
    wording = deadline_error("Job j", DeadlinePassed(shutdown), 0.3, 25.0,
                             anthropic=is_anthropic_route(route))

    async def worker(client):
        await post(client, "job-done", await take(client), {"error": str(wording["error"])})

    async def scenario(client):
        base = f"http://127.0.0.1:{client.port}/v2/local/openai"
        if is_anthropic_route(route):
            sdk = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
            call = sdk.messages.create(**CHAT)
        else:
            sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            call = sdk.chat.completions.create(**CHAT)
        try:
            await answered(call, worker(client))
        except (anthropic.APIStatusError, openai.APIStatusError) as exc:
            return exc

    error = with_client(scenario)
    assert error.status_code == status
    if is_anthropic_route(route):
        assert error.body == {"type": "error", "error": {"type": anthropic_type,
                                                         "message": wording["error"]["message"]}}
    else:
        assert error.body["code"] == status and error.body["message"] == wording["error"]["message"]


@pytest.mark.parametrize(("status", "content_type", "body", "headers"), [
    (200, "application/octet-stream", b"\x00\x00\x80?\xff", {"metadata": '{"shape": [1]}'}),
    (202, "text/plain; charset=utf-8", "spoken words\n".encode(), {"x-request-id": "r1"})])
def test_a_non_json_answer_reaches_the_client_as_vllm_sent_it(status, content_type, body, headers):
    """An envelope item (the worker's form of a non-JSON answer) becomes that HTTP answer again."""
    item = Envelope(status, content_type, body, headers).output()

    async def worker(client):
        await post(client, "job-done", await take(client), {"output": [item]})

    async def scenario(client):
        request = client.post("/v2/local/openai/v1/embeddings",
                              json={"model": "m", "input": "x", "encoding_format": "bytes"})
        response = await answered(request, worker(client))
        return response.status, response.headers, await response.read()

    got_status, got_headers, got_body = with_client(scenario)
    assert (got_status, got_headers["Content-Type"], got_body) == (status, content_type, body)
    assert all(got_headers[name] == value for name, value in headers.items())


def test_paths_runpod_does_not_relay_get_an_openai_shaped_404():
    async def scenario(client):
        response = await client.post("/v2/local/openai/pooling", json={"model": "m", "input": "x"})
        return response.status, await response.json()

    status, body = with_client(scenario)
    assert status == 404 and body["error"]["code"] == 404
    assert "/openai/v1/<route>" in body["error"]["message"]
    assert "/openai/v1/pooling" in body["error"]["message"]


def test_the_query_string_reaches_the_job_route_as_sent():
    seen = []

    async def worker(client):
        job = await take(client)
        seen.append(job["input"])
        await post(client, "job-done", job, {"output": [{"object": "list", "data": []}]})

    async def scenario(client):
        request = client.post("/v2/local/openai/v1/embeddings?user=a%26b&x=1", json={"input": "x"})
        return (await answered(request, worker(client))).status

    assert with_client(scenario) == 200
    assert seen == [{"openai_route": "/v1/embeddings?user=a%26b&x=1", "openai_input": {"input": "x"}}]


def test_a_get_with_stream_true_in_its_query_is_relayed_as_a_stream():
    """vLLM's ``GET /v1/responses/{id}?stream=true`` replays a stored response as events."""
    events = 'event: response.created\ndata: {"type": "response.created"}\n\n'
    seen = []

    async def worker(client):
        job = await take(client)
        seen.append(job["input"])
        await post(client, "job-stream", job, {"output": events})
        await post(client, "job-done", job, {"output": [events]})

    async def scenario(client):
        response = await answered(client.get("/v2/local/openai/v1/responses/resp_1?stream=true"),
                                  worker(client))
        return response.headers["Content-Type"], await response.text()

    assert with_client(scenario) == ("text/event-stream", events)
    assert seen == [{"openai_route": "/v1/responses/resp_1?stream=true", "openai_input": None}]


def test_an_openai_request_waits_for_its_job_past_the_runsync_wait():
    async def worker(client):
        job = await take(client)
        await asyncio.sleep(0.3)  # well past runsync_wait_seconds
        await post(client, "job-done", job, {"output": [{"object": "chat.completion"}]})

    async def scenario(client):
        response = await answered(client.post("/v2/local/openai/v1/chat/completions", json=CHAT),
                                  worker(client))
        return response.status, await response.json()

    assert with_client(scenario, runsync_wait_seconds=0.01) == (200, {"object": "chat.completion"})


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_job_past_the_execution_timeout_is_stopped_and_its_client_gets_a_504(route):
    """The worker never answers: the job times out, its worker is told to stop it, and what the
    worker reports for it afterwards is ignored."""
    after = {}

    async def worker(client):
        job = await take(client)
        stop = await client.get("/v2/local/job-stop/w1?gpu=x")  # held open until the timeout
        after["stop"] = await stop.json()
        await post(client, "job-done", job, {"output": [{"late": True}]})
        after["status"] = await (await client.get(f"/v2/local/status/{job['id']}")).json()
        after["id"] = job["id"]

    async def scenario(client):
        response = await answered(client.post(f"/v2/local/openai{route}", json=CHAT), worker(client))
        health = await (await client.get("/v2/local/health")).json()
        return response.status, await response.json(), health

    status, body, health = with_client(scenario, execution_timeout=0.2)
    assert status == 504
    if is_anthropic_route(route):
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
        message = body["error"]["message"]
    else:
        assert body["error"]["code"] == 504 and body["error"]["type"] == "InternalServerError"
        message = body["error"]["message"]
    assert "execution timeout of 0.2 s" in message and "--execution-timeout" in message
    assert after["stop"] == {"jobsToStop": [after["id"]]}
    assert after["status"]["status"] == "TIMED_OUT" and "output" not in after["status"]
    assert health["jobs"]["failed"] == 1 and health["jobs"]["completed"] == 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_started_stream_past_the_execution_timeout_ends_with_an_error_event(route):
    first = 'data: {"object": "chat.completion.chunk"}\n\n'

    async def worker(client):
        await post(client, "job-stream", await take(client), {"output": first})

    async def scenario(client):
        request = client.post(f"/v2/local/openai{route}", json={**CHAT, "stream": True})
        response = await answered(request, worker(client))
        return response.status, await response.text()

    status, text = with_client(scenario, execution_timeout=0.2)
    assert status == 200 and text.startswith(first)
    (name, data), = sse_events.parse(text[len(first):])
    if is_anthropic_route(route):  # Anthropic's SDK raises on ``event: error``
        assert name == "error" and json.loads(data)["error"]["type"] == "api_error"
    else:
        assert name is None and json.loads(data)["error"]["code"] == 504
