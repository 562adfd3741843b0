"""A load-balancing endpoint on this machine: ``python -m endpoint --load-balancer`` with two real
workers (ENDPOINT_TYPE=load_balancer, each answering /ping on a port of its own), called as RunPod's
balancer is called: the official openai and anthropic clients, streaming or not; /ping through the
start; a worker stopped with SIGTERM while it streams (its streams finish, the other worker takes
the new requests); a worker killed mid-stream (its caller gets an error, the other serves on)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import anthropic
import openai
import pytest
from conftest import engine_env, wait_for
from local_endpoint import API_KEY, HealthSampler, LocalEndpoint, worker_pids

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


def stream_chat(client: openai.OpenAI, model: str, max_tokens: int, started: threading.Event) -> object:
    """The stream's token count (its usage) and finish reason, or the error the stream raised."""
    tokens, finish = None, None
    try:
        for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                    max_tokens=max_tokens, temperature=0,
                                                    stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    except (openai.APIError, openai.APIConnectionError) as exc:
        started.set()
        return exc
    return tokens, finish


def both_ready(endpoint: LocalEndpoint) -> bool:
    """Whether the balancer's latest word on each worker is "ready" (its own /ping says 200 while any is)."""
    last = dict(re.findall(r"endpoint: (local-worker-\d) (ready|not ready)", endpoint.log()))
    return last == {"local-worker-0": "ready", "local-worker-1": "ready"}


def run_streams(endpoint: LocalEndpoint, model: str, max_tokens: int, then) -> list:
    """Two concurrent streams, one per worker (the balancer's least-busy choice, once both are ready);
    ``then()`` once both have tokens, while both still stream; the streams' outcomes."""
    wait_for(lambda: both_ready(endpoint), 400)
    client = endpoint.openai_client()
    outcomes, started = [None, None], [threading.Event(), threading.Event()]

    def run(i: int) -> None:
        outcomes[i] = stream_chat(client, model, max_tokens, started[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # the first is in flight when the second is routed
    assert all(event.wait(120) for event in started)
    assert all(thread.is_alive() for thread in threads), f"a stream ended before the other began: {outcomes}"
    then()
    for thread in threads:
        thread.join(300)
    return outcomes


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


def test_sigterm_lets_a_workers_streams_finish_while_the_other_takes_new_requests(endpoint, model):
    pids = worker_pids(endpoint)
    readies = endpoint.log().count("local-worker-0 ready (")

    def stop_worker_0() -> None:
        os.kill(pids["local-worker-0"], signal.SIGTERM)

    outcomes = run_streams(endpoint, model, 1000, stop_worker_0)
    assert outcomes == [(1000, "length"), (1000, "length")]
    wait_for(lambda: re.search(r"local-worker-0 exited with status 0", endpoint.log()), 60)
    # The balancer sends every new request to the worker still serving, meanwhile.
    client = endpoint.openai_client()
    for _ in range(3):
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    wait_for(lambda: endpoint.log().count("local-worker-0 ready (") > readies, 400)  # restarted


def test_a_worker_killed_mid_stream_fails_its_caller_and_the_other_serves_on(endpoint, model):
    wait_for(lambda: len(worker_pids(endpoint)) == 2, 60)
    pids = worker_pids(endpoint)

    def kill_worker_1() -> None:
        os.killpg(pids["local-worker-1"], signal.SIGKILL)

    outcomes = run_streams(endpoint, model, 1500, kill_worker_1)
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert len(failed) == 1 and (1500, "length") in outcomes, outcomes
    client = endpoint.openai_client()
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices
