"""The local endpoint's HTTP layer without workers: auth, limits, unknown ids, worker protocol."""

import asyncio
import json

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from endpoint.app import EndpointConfig, create_app

import handler
from deadlines import DeadlinePassed
from error_types import is_anthropic_route


def with_client(scenario, **config):
    async def run():
        async with TestClient(TestServer(create_app(EndpointConfig(**config)))) as client:
            return await scenario(client)
    return asyncio.run(run())


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


@pytest.mark.parametrize(("shutdown", "status", "anthropic_type"),
                         [(False, 408, "timeout_error"), (True, 503, "overloaded_error")])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
def test_the_workers_own_errors_reach_the_sdks_with_their_status_and_dialect(
        route, shutdown, status, anthropic_type):
    """A job timeout or the shutdown grace period, as the handler words it and the runpod SDK
    posts it (``str()`` of the item's ``error``), through the relay to the official clients."""
    wording = handler._deadline_error("j", DeadlinePassed(shutdown), 0.3, 25.0,
                                      anthropic=is_anthropic_route(route))

    async def worker(client):
        while (taken := await client.get("/v2/local/job-take/w1?gpu=x&job_in_progress=0")).status != 200:
            pass
        job = await taken.json()
        await client.post(f"/v2/local/job-done/w1/{job['id']}?gpu=x&isStream=false",
                          data=json.dumps({"error": str(wording["error"])}))

    async def scenario(client):
        base = f"http://127.0.0.1:{client.port}/v2/local/openai"
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        if is_anthropic_route(route):
            sdk = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
            call = sdk.messages.create(**body)
        else:
            sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
            call = sdk.chat.completions.create(**body)
        serving = asyncio.ensure_future(worker(client))
        try:
            await call
        except (anthropic.APIStatusError, openai.APIStatusError) as exc:
            return exc
        finally:
            await serving

    error = with_client(scenario)
    assert error.status_code == status
    if is_anthropic_route(route):
        assert error.body == {"type": "error", "error": {"type": anthropic_type,
                                                         "message": wording["error"]["message"]}}
    else:
        assert error.body["code"] == status and error.body["message"] == wording["error"]["message"]
