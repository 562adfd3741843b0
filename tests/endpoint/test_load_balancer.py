"""A load-balancing endpoint on this machine: ``python -m endpoint --load-balancer`` with two real
workers (ENDPOINT_TYPE=load_balancer, each answering /ping on a port of its own), called as RunPod's
balancer is called: the official openai and anthropic clients, streaming or not; /ping through the
start; RunPod's worker affinity (X-Runpod-Worker-Id); a worker stopped with SIGTERM while it streams
(its stream finishes, the other worker takes the new requests); a worker killed mid-stream (its
caller gets an error, the other serves on). The streams a test stops a worker under are sent there
with strict affinity, and the signal goes as their first token arrives, from the client's loop: two
engines on these 2 cores slow each other so much that a timing of two streams was never sure."""

from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from conftest import engine_env, wait_for
from local_endpoint import API_KEY, HealthSampler, LocalEndpoint, worker_pids

from endpoint.pool import WORKER_ID

MESSAGES = [{"role": "user", "content": "Write a story about the sea"}]


@pytest.fixture(scope="module")
def endpoint(models, tmp_path_factory):
    local = LocalEndpoint(engine_env(models["tiny-llama"]), 2, tmp_path_factory.mktemp("lb") / "endpoint.log",
                          ready_timeout=None, args=("--load-balancer", "--separate-health-port"))
    pings = HealthSampler(local, "/ping", read=lambda response: response.status_code)
    local.ready_after = local._wait_ready(2, 400)
    local.pings = pings.stop()
    yield local
    local.stop()


@pytest.fixture(scope="module")
def model(endpoint) -> str:
    return endpoint.model()


def stream_chat(client: openai.OpenAI, model: str, max_tokens: int, worker: str | None = None,
                on_first_token=lambda: None) -> tuple:
    """The stream's worker (its X-Runpod-Worker-Id), and its token count (its usage) and finish
    reason, or the error it raised. ``worker``: sent there only (strict affinity). ``on_first_token()``
    runs as the first token arrives, before the stream is read further."""
    affinity = {WORKER_ID: f"strict {worker}"} if worker else None
    stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, max_tokens=max_tokens,
                                            temperature=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, extra_headers=affinity)
    answered_by, tokens, finish, started = stream.response.headers[WORKER_ID], None, None, False
    try:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not started:
                started = True
                on_first_token()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    except (openai.APIError, openai.APIConnectionError) as exc:
        return answered_by, exc
    return answered_by, (tokens, finish)


def served_by(client: openai.OpenAI, model: str, affinity: str | None = None) -> str:
    """A short chat's worker (it must succeed), with ``affinity`` as its X-Runpod-Worker-Id."""
    answer = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=2, extra_headers={WORKER_ID: affinity} if affinity else None)
    assert answer.parse().choices[0].message.content
    return answer.headers[WORKER_ID]


def test_ping_says_204_until_a_worker_serves_then_200(endpoint):
    answered = [status for status in endpoint.pings if isinstance(status, int)]
    assert answered[0] == 204 and answered[-1] == 200 and set(answered) == {204, 200}
    assert endpoint.http.get("/ping").status_code == 200
    ready = re.findall(r"endpoint: (local-worker-\d) ready \(port (\d+), /ping on port (\d+)\)", endpoint.log())
    assert sorted(worker for worker, *_ in ready) == ["local-worker-0", "local-worker-1"]
    assert len({port for _, *ports in ready for port in ports}) == 4  # each worker: its own health port


def test_the_openai_client_through_the_balancer(endpoint, model):
    client = endpoint.openai_client()
    # Each request may go to either worker: the same model, greedy, gives the same text on both.
    answers = {client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
               for _ in range(4)}
    assert len(answers) == 1
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answers.pop()
    assert [m.id for m in client.models.list()] == [model]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nobody", messages=MESSAGES, max_tokens=2)


def test_the_anthropic_client_through_the_balancer(endpoint, model):
    claude = anthropic.Anthropic(base_url=endpoint.base, api_key=API_KEY, max_retries=0)
    whole = claude.messages.create(model=model, max_tokens=12, messages=MESSAGES, extra_body={"temperature": 0})
    assert whole.type == "message" and whole.usage.output_tokens > 0
    with claude.messages.stream(model=model, max_tokens=12, messages=MESSAGES,
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="nobody", max_tokens=2, messages=MESSAGES)
    assert caught.value.body["type"] == "error"


def test_raw_jobs_through_the_balancer(endpoint):
    answer = endpoint.http.post("/runsync", json={"input": {"prompt": "Once upon a time", "sampling_params": {
        "max_tokens": 5, "ignore_eos": True, "temperature": 0}}})
    assert answer.status_code == 200 and answer.json()["output"][0]["usage"]["output"] == 5
    assert endpoint.http.post("/runsync", json={"input": {}}).status_code == 400


def test_a_request_naming_a_worker_goes_to_it(endpoint, model):
    client = endpoint.openai_client()
    first = served_by(client, model)
    other = {"local-worker-0": "local-worker-1", "local-worker-1": "local-worker-0"}[first]
    named = [served_by(client, model, affinity) for affinity in (first, first, f"strict {other}", first)]
    assert named == [first, first, other, first]  # without the header, these would take turns


def test_sigterm_lets_a_workers_stream_finish_while_the_other_takes_new_requests(endpoint, model):
    pids = worker_pids(endpoint)
    readies = endpoint.log().count("local-worker-0 ready (")
    out = endpoint.log().count("local-worker-0 not ready: /ping answered 503")
    client, signalled = endpoint.openai_client(), threading.Event()

    def stop_worker_0() -> None:  # while its stream has 999 tokens to go
        os.kill(pids["local-worker-0"], signal.SIGTERM)
        signalled.set()

    with ThreadPoolExecutor(2) as pool:
        draining = pool.submit(stream_chat, client, model, 1000, "local-worker-0", stop_worker_0)
        assert signalled.wait(400)
        wait_for(lambda: endpoint.log().count("local-worker-0 not ready: /ping answered 503") > out, 60)
        # Meanwhile, the balancer sends every new request to the worker still serving.
        new = pool.submit(stream_chat, client, model, 300)
        assert [served_by(client, model) for _ in range(3)] == ["local-worker-1"] * 3
        assert draining.result(300) == ("local-worker-0", (1000, "length"))
        assert new.result(300) == ("local-worker-1", (300, "length"))
    assert "Draining: 1 request(s) in flight" in endpoint.log()
    wait_for(lambda: re.search(r"local-worker-0 exited with status 0", endpoint.log()), 60)
    wait_for(lambda: endpoint.log().count("local-worker-0 ready (") > readies, 400)  # restarted


def test_a_worker_killed_mid_stream_fails_its_caller_and_the_other_serves_on(endpoint, model):
    wait_for(lambda: len(worker_pids(endpoint)) == 2, 60)
    pids, client = worker_pids(endpoint), endpoint.openai_client()

    def kill_worker_1() -> None:  # while its stream has 1,999 tokens to go
        os.killpg(pids["local-worker-1"], signal.SIGKILL)

    # As long as the context allows: a client thread that a busy machine kept from its first token
    # for a few seconds once found the whole of a 1,000-token stream already sent.
    worker, outcome = stream_chat(client, model, 2000, "local-worker-1", kill_worker_1)
    assert worker == "local-worker-1" and isinstance(outcome, openai.APIConnectionError), outcome
    assert stream_chat(client, model, 300) == ("local-worker-0", (300, "length"))
    assert [served_by(client, model) for _ in range(2)] == ["local-worker-0"] * 2
