"""worker-vllm 2.24's contract on a real worker under the local endpoint, driven by the runpod SDK:
raw jobs in its format (RAW_JOB_FORMAT=openai) answered exactly as `vllm serve` answers the same body
(the same model and flags, beside it), through /run, /runsync and /stream, streamed and not;
VLLM_EXTRA_ARGS applied above the environment; REQUEST_TIMEOUT bounding a job; request parameters at
a job's top level refused; worker-vllm's subprocess variables warned about; the start's phases logged.
"""

from __future__ import annotations

import json
import re

import pytest
import runpod
from conftest import engine_env
from local_endpoint import API_KEY, LocalEndpoint

from tests.engine.vllm_server import canonical_stream, normalize, parse_sse, vllm_servers

SERVED = "tiny-extra"  # VLLM_EXTRA_ARGS names it, above SERVED_MODEL_NAME
# A short job takes 0.1 s here, under 1 s beside four busy processes; but with two tests at a time a
# job has waited 3 s, and once 30 s, beside engines starting and generating in the other process.
# LONG takes about 100 s (6 of its 32 sequences at a time).
REQUEST_TIMEOUT = 20
EXTRA_ARGS = f"--max-num-seqs 6 --served-model-name {SERVED} --uvicorn-log-level warning"
CHAT = [{"role": "user", "content": "Tell me a story"}]
GREEDY = {"max_tokens": 12, "temperature": 0}
LONG = {"prompt": "x", "sampling_params": {"max_tokens": 2000, "ignore_eos": True, "n": 32}}
EVENT = re.compile(r"data: [^\n]*\n\n")


@pytest.fixture(scope="module")
def env(models) -> dict[str, str]:
    return engine_env(models["tiny-llama"], RAW_JOB_FORMAT="openai", VLLM_EXTRA_ARGS=EXTRA_ARGS,
                      MAX_NUM_SEQS="32", SERVED_MODEL_NAME="from-env", REQUEST_TIMEOUT=str(REQUEST_TIMEOUT),
                      VLLM_PORT="8000", VLLM_BASE_URL="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def endpoint(env, tmp_path_factory):
    local = LocalEndpoint(env, 1, tmp_path_factory.mktemp("endpoint") / "endpoint.log", ready_timeout=None)
    yield local
    local.stop()


@pytest.fixture(scope="module")
def vllm_serve(env, endpoint, tmp_path_factory):
    """`vllm serve` with the worker's flags (VLLM_EXTRA_ARGS' included), started beside the worker."""
    with vllm_servers({"tiny": env}, tmp_path_factory.mktemp("vllm-serve")) as servers:
        endpoint._wait_ready(1, 400)
        yield servers["tiny"]


@pytest.fixture(scope="module")
def worker(vllm_serve, endpoint) -> runpod.Endpoint:
    """The official runpod SDK on the local endpoint, once both servers are ready."""
    runpod.api_key = API_KEY
    runpod.endpoint_url_base = endpoint.base.removesuffix("/local")
    return runpod.Endpoint("local")


def body_of(job_input: dict) -> tuple[str, dict]:
    """The route and body worker-vllm 2.24 sends `vllm serve` for a raw job."""
    route = "/v1/chat/completions" if "messages" in job_input else "/v1/completions"
    llm_input = {key: job_input[key] for key in ("prompt", "messages") if key in job_input}
    return route, {**job_input["sampling_params"], "stream": job_input.get("stream", False), **llm_input,
                   "model": SERVED}


RAW_JOBS = {
    "prompt": {"prompt": "Once upon a time", "sampling_params": GREEDY},
    "messages": {"messages": CHAT, "sampling_params": {**GREEDY, "max_tokens": 9}},
    "sampled with a seed": {"prompt": "Hello", "sampling_params": {"max_tokens": 6, "n": 2, "seed": 1,
                                                                   "temperature": 0.8, "logprobs": 2}},
    # the other prompts /v1/completions takes
    "prompts": {"prompt": ["The capital of France is", "One, two,"], "sampling_params": GREEDY},
    "token ids": {"prompt": [504, 1575, 282, 461, 314], "sampling_params": GREEDY},  # tiny's vocabulary: 2,048
    "lists of token ids": {"prompt": [[504, 1575], [282, 461, 314]], "sampling_params": GREEDY},
}


@pytest.mark.parametrize("name", RAW_JOBS)
def test_a_raw_job_answers_as_vllm_serve_answers_its_body(worker, vllm_serve, name):
    job_input = RAW_JOBS[name]
    route, body = body_of(job_input)
    expected = normalize(vllm_serve.post(route, json=body).json())
    (synced,) = worker.run_sync({"input": job_input}, timeout=60)
    job = worker.run({"input": job_input})
    assert job.status() in ("IN_QUEUE", "IN_PROGRESS", "COMPLETED")
    assert normalize(synced) == expected == normalize(job.output(timeout=60)[0])
    assert expected["usage"]["completion_tokens"] > 0


def test_apply_chat_template_makes_a_string_prompt_a_chat(worker, vllm_serve):
    (answer,) = worker.run_sync({"input": {"prompt": "Tell me a story", "apply_chat_template": True,
                                           "sampling_params": GREEDY}}, timeout=60)
    expected = vllm_serve.post("/v1/chat/completions", json={**GREEDY, "messages": CHAT, "model": SERVED})
    assert normalize(answer) == normalize(expected.json())


WITH_USAGE = {**GREEDY, "stream_options": {"include_usage": True}}
STREAMS = {
    "prompt": {"prompt": "Once upon a time", "sampling_params": WITH_USAGE},
    "messages": {"messages": CHAT, "sampling_params": WITH_USAGE},
}


def streamed(worker: runpod.Endpoint, job_input: dict) -> list[str]:
    """The items of a streamed job, read as they come through /stream."""
    return list(worker.run({"input": {**job_input, "stream": True}}).stream())


@pytest.mark.parametrize("name", STREAMS)
def test_a_streamed_raw_job_is_vllm_serves_stream_one_event_per_item(worker, vllm_serve, name):
    job_input = STREAMS[name]
    route, body = body_of({**job_input, "stream": True})
    expected = canonical_stream(parse_sse(vllm_serve.post(route, json=body).text))
    items = streamed(worker, job_input)
    assert all(isinstance(item, str) and EVENT.fullmatch(item) for item in items)
    assert items[-1] == "data: [DONE]\n\n" and len(items) >= 3  # some text, the usage, [DONE]
    assert canonical_stream(parse_sse("".join(items))) == expected
    aggregated = worker.run_sync({"input": {**job_input, "stream": True}}, timeout=60)  # /runsync: every item
    assert canonical_stream(parse_sse("".join(aggregated))) == expected


def test_stream_batching_puts_several_whole_events_in_an_item(worker, vllm_serve):
    job_input = {**STREAMS["messages"], "max_batch_size": 4, "min_batch_size": 2}
    items = streamed(worker, job_input)
    events = [EVENT.findall(item) for item in items]
    assert all("".join(found) == item for found, item in zip(events, items, strict=True))  # whole events only
    assert max(map(len, events)) > 1 and len(items) < sum(map(len, events))
    route, body = body_of({**STREAMS["messages"], "stream": True})
    expected = canonical_stream(parse_sse(vllm_serve.post(route, json=body).text))
    assert canonical_stream(parse_sse("".join(items))) == expected


def test_route_jobs_answer_the_same_in_both_formats(worker, vllm_serve):
    route, body = body_of(RAW_JOBS["prompt"])
    raw, = worker.run_sync({"input": RAW_JOBS["prompt"]}, timeout=60)
    for job_input in ({"openai_route": route, "openai_input": body},
                      {"route": route, "body": body, "method": "POST"}):
        (answer,) = worker.run_sync({"input": job_input}, timeout=60)
        assert normalize(answer) == normalize(raw)


def failed(endpoint: LocalEndpoint, job_input: dict) -> dict:
    """A job the worker refuses: FAILED, its error worker-vllm's item shape as JSON."""
    job = endpoint.http.post("/runsync", json={"input": job_input}).json()
    assert job["status"] == "FAILED", job
    error = json.loads(job["error"])
    assert {"message", "type", "code"} <= error.keys()
    return error


BAD_INPUTS = {
    "neither prompt nor messages": ({"sampling_params": GREEDY}, 400, "needs 'prompt', 'messages'"),
    "both": ({"prompt": "x", "messages": CHAT}, 400, "both 'prompt' and 'messages'"),
    "messages not a list": ({"messages": "Hello"}, 400, "messages: Input should be a valid list"),
    "sampling_params not an object": ({"prompt": "x", "sampling_params": [1]}, 400, "sampling_params:"),
    "a sampling parameter at the top level": ({"prompt": "x", "max_tokens": 5}, 400,
                                              "'max_tokens' at the input's top level is not read"),
    "guided_json at the top level (worker-vllm's issue #235)": (
        {"prompt": "x", "guided_json": {"type": "object"}}, 400, "'guided_json' at the input's top level"),
    "an unknown adapter": ({"prompt": "x", "model": "no-such-adapter"}, 404, "no-such-adapter"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_the_error_item_and_the_worker_serves_on(endpoint, worker, case):
    job_input, status, fragment = BAD_INPUTS[case]
    error = failed(endpoint, job_input)
    assert error["code"] == status and fragment in error["message"]
    (answer,) = worker.run_sync({"input": RAW_JOBS["prompt"]}, timeout=60)
    assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_a_body_vllm_rejects_gets_vllm_serves_error(endpoint, vllm_serve):
    job_input = {"prompt": "x", "sampling_params": {"temperature": -1}}
    route, body = body_of(job_input)
    expected = vllm_serve.post(route, json=body)
    error = failed(endpoint, job_input)
    assert (error["code"], error["message"]) == (expected.status_code, expected.json()["error"]["message"]) \
        and error["code"] == 400


@pytest.mark.parametrize(("job_timeout", "limit"), [(None, "REQUEST_TIMEOUT"), (60, "REQUEST_TIMEOUT"),
                                                    (0.5, "timeout")])
def test_request_timeout_bounds_a_job_with_the_smallest_limit_set(endpoint, worker, job_timeout, limit):
    job_input = {**LONG, **({"timeout": job_timeout} if job_timeout else {})}
    error = failed(endpoint, job_input)
    seconds = job_timeout if limit == "timeout" else REQUEST_TIMEOUT
    assert error["code"] == 408 and f"ran past its timeout of {seconds:g} s ({limit})" in error["message"]
    (answer,) = worker.run_sync({"input": RAW_JOBS["prompt"]}, timeout=60)  # the engine serves on
    assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_extra_args_are_applied_above_the_environment(endpoint, worker):
    models = endpoint.http.get("/openai/v1/models").json()["data"]
    assert models[0]["id"] == SERVED  # not SERVED_MODEL_NAME's "from-env"
    log = endpoint.log()
    assert "taking 1 to 6 concurrent jobs" in log  # --max-num-seqs 6 over MAX_NUM_SEQS=32
    assert "max_num_seqs='6' (env VLLM_EXTRA_ARGS: --max-num-seqs)" in log
    assert "VLLM_EXTRA_ARGS: --uvicorn-log-level ignored: uvicorn's logs" in log


def test_worker_vllms_subprocess_variables_are_warned_about_once(endpoint, worker):
    log = endpoint.log()
    for name in ("VLLM_PORT", "VLLM_BASE_URL"):
        assert log.count(f"WARNING worker.config.legacy_env: {name} is ignored: ") == 1


def test_an_unknown_key_or_a_label_is_ignored_with_a_warning(endpoint, worker):
    job_input = {**RAW_JOBS["prompt"], "webhook_note": "x", "user": "customer-42"}
    (answer,) = worker.run_sync({"input": job_input}, timeout=60)
    assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert "input keys 'user', 'webhook_note' are not read (ignored)" in endpoint.log()


def test_the_start_names_its_phases_as_it_enters_them(endpoint, worker):
    phases = re.findall(r"Start-up phase: ([\w-]+), [\d.]+ s after the start", endpoint.log())
    assert phases == ["load", "compile", "warm-up"]  # the weights' load seen in vLLM's engine process
