"""One worker process on a load-balancing endpoint (ENDPOINT_TYPE=load_balancer), called over
HTTP as RunPod's balancer calls it: /ping through the start, the official clients, raw jobs on
/runsync and /stream, errors, and SIGTERM with requests in flight. The local balancer in front of
several such workers: tests/endpoint/test_load_balancer.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
import sse_events
from conftest import CPU_ENV, REPO, alive, descendants, engine_env, wait_for
from dev_env import free_port
from starts import record

HANDLER = str(REPO / "src" / "handler.py")
GRACE_SECONDS = 6
LONG_CONTEXT = 16384
RAW_GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}  # the openai client's


class Worker:
    """The worker process, and every /ping status seen from its start until it served. ``health_port``:
    PORT_HEALTH, when not PORT."""

    def __init__(self, env: dict[str, str], log_path, health_port: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_port = health_port
        ports = {"PORT": str(self.port), **({"PORT_HEALTH": str(health_port)} if health_port else {})}
        # A session of its own: a test that fails leaves no engine process behind (``kill``).
        self.proc = subprocess.Popen([sys.executable, HANDLER], stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **CPU_ENV, **env, "ENDPOINT_TYPE": "load_balancer",
                                          **ports}, start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.pings: list[int | str] = []
        self.launched = time.monotonic()

    def ping(self) -> int | str:
        try:
            # Answered at once, but a loaded CI machine once kept a starting worker's answer past 5 s.
            return self.http.get("/ping", timeout=30).status_code
        except httpx.TransportError as exc:
            return type(exc).__name__

    def wait_serving(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.pings.append(status := self.ping())
            if status == 200:
                record("worker processes", time.monotonic() - self.launched)
                return
            time.sleep(0.05)
        self.kill()
        pytest.fail("worker did not serve:\n" + self.log()[-4000:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """The worker and every process it started (vLLM's), at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def worker(models, tmp_path_factory):
    # A context of 16k (tiny-llama's own is 2,048; its text does not matter here): room for a request
    # that cannot end within the grace period on any machine the suite runs on.
    worker = Worker(engine_env(models["tiny-llama"], SHUTDOWN_GRACE_PERIOD=str(GRACE_SECONDS),
                               MAX_MODEL_LEN=str(LONG_CONTEXT), VLLM_ALLOW_LONG_MAX_MODEL_LEN="1"),
                    tmp_path_factory.mktemp("lb-worker") / "worker.log", health_port=free_port())
    worker.wait_serving()
    yield worker
    worker.kill()  # stopped already by the last test, unless a test failed


@pytest.fixture(scope="module")
def model(worker) -> str:
    return worker.http.get("/v1/models").json()["data"][0]["id"]


def test_ping_says_204_while_the_worker_starts_and_200_once_it_serves(worker):
    """No gap once it answered: the port is bound first, and stays bound while its server moves
    to the engine's loop (a refused /ping would make RunPod drop the worker)."""
    answered = [status for status in worker.pings if isinstance(status, int)]
    first = worker.pings.index(answered[0])
    assert set(worker.pings[:first]) <= {"ConnectError"}  # before the process bound the port
    assert answered[:-1] and set(answered[:-1]) == {204} and answered[-1] == 200
    assert worker.pings[first:] == answered
    log = worker.log()
    assert log.index("/ping on port") < log.index("Initialized vLLM engine") < log.index("Worker ready: serving HTTP")


def test_the_openai_client_talks_to_the_worker_directly(worker, model):
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content and len(chunks) >= 8
    completion = client.completions.create(model=model, prompt="Once upon", **GREEDY)
    assert completion.usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)


def test_the_anthropic_client_talks_to_the_worker_directly(worker, model):
    client = anthropic.Anthropic(base_url=worker.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.messages.create(model=model, messages=messages, max_tokens=8, extra_body={"temperature": 0})
    assert whole.usage.output_tokens >= 1 and whole.content[0].type == "text"
    with client.messages.stream(model=model, messages=messages, max_tokens=8, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == whole.content[0].text
    # vLLM answers a request it cannot validate in OpenAI's shape: here, as on the queue, Anthropic's
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, messages=messages, max_tokens=-1)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"


def test_raw_jobs_on_runsync_and_stream_keep_the_queue_format(worker):
    job = {"input": {"prompt": "Once upon a time", "sampling_params": RAW_GREEDY}}
    answer = worker.http.post("/runsync", json=job)
    assert answer.status_code == 200
    body = answer.json()
    assert body["status"] == "COMPLETED" and body["id"].startswith("http-")
    [item] = body["output"]
    assert item["usage"] == {"input": item["usage"]["input"], "output": 8}
    with worker.http.stream("POST", "/stream", json={"input": {**job["input"], "max_batch_size": 50}}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse_events.parse(stream.read().decode())
    assert events[-1] == (None, "[DONE]")
    items = [json.loads(data) for _, data in events[:-1]]
    # An item per engine output (a token each, two when the reader fell a step behind on a loaded
    # machine), whatever the job's batching knobs say (they would make items of 1, 3 and 4 tokens).
    outputs = [0] + [i["usage"]["output"] for i in items]
    assert outputs[-1] == 8 and all(1 <= b - a <= 2 for a, b in zip(outputs, outputs[1:]))
    assert "".join(t for i in items for t in i["choices"][0]["tokens"]) == "".join(item["choices"][0]["tokens"])


def test_a_failed_job_answers_as_the_queue_reports_it(worker):
    answer = worker.http.post("/runsync", json={"input": {"prompt": "x", "sampling_params": {"max_tokens": -1}}})
    assert answer.status_code == 400
    body = answer.json()
    assert body["status"] == "FAILED" and "max_tokens" in json.loads(body["error"])["message"]
    streamed = worker.http.post("/stream", json={"input": {"sampling_params": {}}})
    assert streamed.status_code == 400 and "'prompt', 'messages' or 'openai_route'" in streamed.text
    assert worker.http.post("/runsync", content=b"{not json").status_code == 400


@pytest.mark.parametrize(("method", "path", "status", "fragment"), [
    ("GET", "/metrics", 404, "operational: RunPod monitors"),
    ("POST", "/v1/load_lora_adapter", 404, "changes or inspects the server"),
    ("POST", "/run", 404, "a load-balancing endpoint has no queue"),
    ("GET", "/status/abc", 404, "a load-balancing endpoint has no queue"),
    ("GET", "/v1/nothing", 404, "this worker serves: /ping, /runsync, /stream"),
])
def test_routes_not_served_are_named(worker, method, path, status, fragment):
    answer = worker.http.request(method, path)
    assert answer.status_code == status and fragment in answer.json()["error"]["message"]


def test_a_root_route_is_also_served_under_v1(worker):
    """As on the queue, where RunPod relays only /v1/...: /tokenize is /v1/tokenize too."""
    direct = worker.http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert worker.http.post("/v1/tokenize", json={"prompt": "hello world"}).json() == direct
    assert direct["count"] == len(direct["tokens"]) > 0


def test_a_body_over_the_balancers_limit_is_refused_before_it_is_read(worker):
    answer = worker.http.post("/v1/completions", content=b" " * (30 * 2**20 + 1),
                              headers={"content-type": "application/json"})
    assert answer.status_code == 413 and str(30 * 2**20) in answer.json()["error"]["message"]
    assert worker.ping() == 200


def test_a_health_port_of_its_own_answers_ping_only(worker):
    """PORT_HEALTH is for RunPod's /ping: the routes are served on PORT, on the engine's loop."""
    health = httpx.Client(base_url=f"http://127.0.0.1:{worker.health_port}", timeout=30)
    assert health.get("/ping").status_code == 200
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/runsync")):
        answer = health.request(method, path, json={"input": {"prompt": "x"}, "prompt": "x", "max_tokens": 2})
        assert answer.status_code == 404 and "answers /ping only" in answer.json()["error"]["message"]
    assert worker.http.get("/v1/models").status_code == 200


def test_a_chunked_body_past_the_limit_is_refused_before_it_ends_while_a_stream_goes_on(worker, model):
    """Chunked: no Content-Length says how large it is. The 413 comes once the limit is passed, while
    the client still holds the request open; the rest is never read, and the worker serves on."""
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    started = threading.Event()

    def stream() -> int:
        chunks = client.completions.create(model=model, prompt="Once upon a time", stream=True,
                                           max_tokens=300, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        for chunk in chunks:
            started.set()
            usage = chunk.usage
        return usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        assert started.wait(60)
        with socket.create_connection(("127.0.0.1", worker.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: worker\r\n"
                         b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (2**20, b" " * 2**20)
            for _ in range(30):
                sock.sendall(chunk)
            sock.sendall(b"1\r\n \r\n")  # one byte past the 30 MiB; the closing chunk never comes
            status, body = read_response(sock)
        assert status == 413 and str(30 * 2**20) in json.loads(body)["error"]["message"]
        assert streaming.result(120) == 300
    assert worker.ping() == 200


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length: its status and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"the connection closed: {data!r}")
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail(f"the connection closed: {data!r}")
    return int(head.split()[1]), body


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_a_body_nested_too_deep_gets_a_400_that_says_so_and_the_worker_serves_on(worker, model):
    """~1,000 levels: too deep for Python's JSON parser. A raw job's is refused as a queue job's is;
    a vLLM route's before vLLM reads it. No traceback in the log. At the limit, a job is served."""
    logged = len(worker.log())
    job = worker.http.post("/runsync", content='{"input": {"prompt": "x", "deep": %s}}' % nested(1000))
    assert job.status_code == 400 and job.json()["status"] == "FAILED"
    error = json.loads(job.json()["error"])
    assert error["param"] == "input" and "the job input is nested more than 128 levels" in error["message"]
    body = '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "tools": %s}' % (
        model, nested(999))
    for route, dialect in (("/v1/chat/completions", "code"), ("/v1/messages", "type")):
        answer = worker.http.post(route, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and dialect in answer.json()["error"]
        assert "the request body is nested more than 128 levels deep" in answer.json()["error"]["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested(3000)}}  # vLLM parses it
    answer = worker.http.post("/v1/chat/completions", json={"model": model, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]})
    assert answer.status_code == 400 and "nested more than 128 levels deep" in answer.json()["error"]["message"]
    at_limit = '{"input": {"prompt": "x", "sampling_params": %s, "note": %s}}' % (
        json.dumps(RAW_GREEDY), nested(127))
    assert worker.http.post("/runsync", content=at_limit).json()["status"] == "COMPLETED"
    assert "Traceback" not in worker.log()[logged:] and worker.ping() == 200


def test_sigterm_drains_the_requests_in_flight_then_exits(worker, model):
    """Last in this module: it stops the worker. A request that finishes within the grace period
    completes; one that cannot ends with the worker's 503 event; /ping says 503 at once and a new
    request gets a 503; then the worker exits 0, with vLLM's processes."""
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story"}]
    outcomes: dict[str, object] = {}
    first_tokens = {"short": threading.Event(), "long": threading.Event()}

    def chat(name: str, max_tokens: int) -> None:
        text = []
        try:
            for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                        max_tokens=max_tokens, temperature=0,
                                                        extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    first_tokens[name].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcomes[name] = chunk.choices[0].finish_reason
        except openai.APIError as exc:
            outcomes[name] = exc

    # The long one: 16,000 tokens, 8 times the grace period's worth on these machines (a 2,000-token
    # one, the most a 2,048 context holds, ended within it once).
    threads = [threading.Thread(target=chat, args=("short", 16)),
               threading.Thread(target=chat, args=("long", LONG_CONTEXT - 384))]
    for thread in threads:
        thread.start()
    assert first_tokens["long"].wait(60)
    spawned = descendants(worker.proc.pid)
    worker.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: worker.ping() == 503, 10)
    refused = worker.http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for thread in threads:
        thread.join(GRACE_SECONDS + 60)
    assert outcomes["short"] == "length"
    assert isinstance(outcomes["long"], openai.APIError) and "grace period" in str(outcomes["long"])
    assert worker.proc.wait(timeout=60) == 0
    wait_for(lambda: not any(alive(pid) for pid in spawned), 10)
    log = worker.log()
    assert "SIGTERM: draining" in log and "Stopped serving HTTP" in log


def test_a_start_that_fails_answers_every_request_with_the_cause(models, tmp_path):
    """/ping says 200, so RunPod routes callers here to learn why, in each route's dialect; then
    the worker exits 2 (settings must change)."""
    worker = Worker(engine_env(models["tiny-llama"], MAX_MODEL_LEN="abc", STARTUP_FAILURE_ANSWER_SECONDS="8"),
                    tmp_path / "worker.log")
    worker.wait_serving(60)
    chat = worker.http.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert chat.status_code == 503 and "MAX_MODEL_LEN='abc'" in chat.json()["error"]["message"]
    messages = worker.http.post("/v1/messages", json={})
    assert messages.status_code == 503 and messages.json()["error"]["type"] == "overloaded_error"
    job = worker.http.post("/runsync", json={"input": {"prompt": "x"}})
    assert job.status_code == 503 and job.json()["status"] == "FAILED" and "MAX_MODEL_LEN" in job.json()["error"]
    assert worker.proc.wait(timeout=60) == 2
    assert "Loading" not in worker.log()
