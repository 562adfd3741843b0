"""The worker as a process: start-up failures, and jobs over HTTP through runpod's own local
API server (``--rp_serve_api``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import CPU_ENV, REPO, alive, descendants, engine_env, wait_for

HANDLER = str(REPO / "src" / "handler.py")


def worker_env(**env: str) -> dict[str, str]:
    return {**os.environ, **CPU_ENV, **env}


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.mark.parametrize(("env", "fragment"), [
    ({"MAX_MODEL_LEN": "abc"}, "MAX_MODEL_LEN='abc'"),
    ({"MAX_CONCURRENCY": "lots"}, "MAX_CONCURRENCY='lots'"),
    ({"LORA_MODULES": '{"name": "a"}'}, "LORA_MODULES"),
    ({"MODEL_NAME": "/nonexistent/model"}, "MODEL_NAME='/nonexistent/model': no such directory"),
    # vLLM itself rejects this combination when it builds the engine's configuration
    ({"NGRAM_PROMPT_LOOKUP_MAX": "2", "NGRAM_PROMPT_LOOKUP_MIN": "5", "NUM_SPECULATIVE_TOKENS": "3"},
     "NGRAM_PROMPT_LOOKUP_MIN: prompt_lookup_min=5 must be <= prompt_lookup_max=2"),
])
def test_bad_configuration_exits_before_the_model_loads(models, env, fragment):
    """With no answer window (STARTUP_FAILURE_ANSWER_SECONDS=0) the worker exits at once, status 2;
    tests/endpoint/test_startup_failures.py has the window, jobs answered with the cause."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, HANDLER],
                          env=worker_env(**engine_env(models["tiny-llama"], STARTUP_FAILURE_ANSWER_SECONDS="0",
                                                      **env)),
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Worker could not start: invalid configuration" in output and fragment in output
    assert "Loading" not in output and "Initializing a V1 LLM engine" not in output
    assert time.monotonic() - started < 60


@pytest.fixture(scope="module")
def rp_api(models, tmp_path_factory):
    # Port 0: uvicorn binds a free port only once the engine has started (~20 s), and logs it; a
    # port picked here could be taken by then (by vLLM's own free-port probe, among others).
    log = tmp_path_factory.mktemp("rp-api") / "worker.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, HANDLER, "--rp_serve_api", "--rp_api_port", "0", "--rp_api_host", "127.0.0.1"],
            env=worker_env(**engine_env(models["tiny-llama"]), UVICORN_LOG_LEVEL="info"),
            stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if started := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text()):
            url = started[1]
            urllib.request.urlopen(url + "/docs", timeout=10)
            break
        time.sleep(1)
    else:
        proc.kill()
        pytest.fail("worker did not come up:\n" + log.read_text()[-3000:])
    yield url
    spawned = descendants(proc.pid)
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    wait_for(lambda: not any(alive(pid) for pid in spawned), 10)  # vLLM's processes stopped too


def test_runsync_over_http(rp_api):
    result = post(rp_api + "/runsync", {"input": {
        "prompt": "Hello", "sampling_params": {"max_tokens": 5, "ignore_eos": True}}})
    assert result["status"] == "COMPLETED"
    (item,) = result["output"]
    assert item["usage"]["output"] == 5 and len(item["choices"]) == 1


def test_streaming_job_over_http_returns_the_batches(rp_api):
    result = post(rp_api + "/runsync", {"input": {
        "prompt": "Hello", "stream": True, "sampling_params": {"max_tokens": 13, "ignore_eos": True}}})
    outputs = [i["usage"]["output"] for i in result["output"]]
    assert outputs[-1] == 13 and len(outputs) >= 2 and outputs[0] <= 3  # 1, 4, 13 unless merged


def test_bad_job_over_http_then_the_worker_keeps_serving(rp_api):
    result = post(rp_api + "/runsync", {"input": {"prompt": "x", "sampling_params": {"top_p": 7}}})
    assert result["output"][0]["error"]["param"] == "sampling_params.top_p"
    again = post(rp_api + "/runsync", {"input": {"prompt": "x", "sampling_params": {"max_tokens": 2}}})
    assert again["status"] == "COMPLETED" and again["output"][0]["usage"]["output"] <= 2


def test_openai_route_job_over_http(rp_api):
    models = post(rp_api + "/runsync", {"input": {"openai_route": "/v1/models"}})
    model = models["output"][0]["data"][0]["id"]
    result = post(rp_api + "/runsync", {"input": {"openai_route": "/v1/chat/completions", "openai_input": {
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}})
    (completion,) = result["output"]
    assert completion["object"] == "chat.completion" and completion["usage"]["completion_tokens"] <= 4
