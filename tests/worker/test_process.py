"""The worker as a process: start-up failures, the exit status the log names in every mode (queue,
``--rp_serve_api``, load-balancing), and jobs over HTTP through runpod's own local API server
(``--rp_serve_api``)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import CPU_ENV, REPO, alive, descendants, engine_env, wait_for
from dev_env import free_port
from starts import record, timed

HANDLER = str(REPO / "src" / "handler.py")
RP_API_ARGS = ("--rp_serve_api", "--rp_api_port", "0", "--rp_api_host", "127.0.0.1")
# Every log line that names the exit status: a failed start's, when its answer window begins and
# ends (or at once, with none), and a dead engine's.
EXIT_LOGGED = re.compile(r"(?:: exit|then exiting with status) (\d+)\b")


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
    with timed("worker processes"):
        proc = subprocess.run([sys.executable, HANDLER],
                              env=worker_env(**engine_env(models["tiny-llama"], STARTUP_FAILURE_ANSWER_SECONDS="0",
                                                          **env)),
                              capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and logged_exits(output) == {2}, output
    assert "Worker could not start: invalid configuration" in output and fragment in output
    assert "Loading" not in output and "Initializing a V1 LLM engine" not in output
    assert time.monotonic() - started < 60


def logged_exits(log: str) -> set[int]:
    return {int(status) for status in EXIT_LOGGED.findall(log)}


class _NoJobs(http.server.BaseHTTPRequestHandler):
    """RunPod's job server with an empty queue: every job take and stop poll answers 204."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.asked.set()
        self.send_response(204)
        self.end_headers()

    def log_message(self, *_args) -> None:
        pass


@pytest.fixture
def job_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoJobs)
    server.asked = threading.Event()  # a worker has asked for jobs
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


# A start-up failure of each status, found in seconds: a model that is not in the (empty) cache
# while offline names MODEL_NAME (2, settings must change), before vLLM is imported; a start-up
# timeout of 1 s (1: the next worker may start), in vLLM's import.
FAILURES = {2: {"MODEL_NAME": "no-such-org/x", "HF_HUB_OFFLINE": "1"}, 1: {"VLLM_STARTUP_TIMEOUT": "1"}}


def failure_env(models, tmp_path, status: int, seconds: int) -> dict[str, str]:
    return engine_env(models["tiny-llama"], HF_HOME=str(tmp_path / "hf-home"),
                      STARTUP_FAILURE_ANSWER_SECONDS=str(seconds), **FAILURES[status])


def failing_worker(mode: str, env: dict[str, str], log_path, job_server) -> subprocess.Popen:
    """The worker in ``mode``, its output in ``log_path``: ``queue`` takes jobs from ``job_server``
    through the SDK's job loop, as on RunPod; ``rp_serve_api`` serves the SDK's local API (uvicorn);
    ``load_balancer`` serves HTTP itself."""
    args, mode_env = {
        "queue": ((), {"RUNPOD_WEBHOOK_GET_JOB": f"http://127.0.0.1:{job_server.server_port}/job-take/$ID",
                       "RUNPOD_POD_ID": "exit-test", "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
                       "RUNPOD_SKIP_GPU_CHECK": "true"}),
        "rp_serve_api": (RP_API_ARGS, {}),
        "load_balancer": ((), {"ENDPOINT_TYPE": "load_balancer", "PORT": str(free_port())}),
    }[mode]
    with log_path.open("w") as sink:
        return subprocess.Popen([sys.executable, HANDLER, *args], env=worker_env(**env, **mode_env),
                                stdout=sink, stderr=subprocess.STDOUT)


def answering(mode: str, log_path, job_server) -> bool:
    """Whether the worker answers with its failure: the SDK's loop or server, or the HTTP server, runs."""
    log = log_path.read_text()
    return "then exiting with status" in log and {
        "queue": job_server.asked.is_set(), "rp_serve_api": "Uvicorn running on" in log,
        "load_balancer": True}[mode]


MODES = ["queue", "rp_serve_api", "load_balancer"]


@pytest.mark.parametrize("status", sorted(FAILURES))
@pytest.mark.parametrize("mode", MODES)
def test_after_the_answer_window_the_worker_exits_with_the_status_it_logs(models, tmp_path, job_server,
                                                                          mode, status):
    """Under --rp_serve_api uvicorn ends the process in main()'s SIGTERM handler, which exited 0 whatever
    the log said."""
    log_path = tmp_path / "worker.log"
    with timed("worker processes"):
        proc = failing_worker(mode, failure_env(models, tmp_path, status, 2), log_path, job_server)
        code = proc.wait(timeout=120)
    log = log_path.read_text()
    assert "Stopping after the answer window (STARTUP_FAILURE_ANSWER_SECONDS): exit" in log, log[-3000:]
    assert code == status and logged_exits(log) == {status}, log[-3000:]


@pytest.mark.parametrize("mode", MODES)
def test_a_sigterm_within_the_answer_window_exits_with_the_failures_status(models, tmp_path, job_server,
                                                                           mode):
    """RunPod stopping a worker that answers its failure: the status is still the failure's."""
    log_path = tmp_path / "worker.log"
    proc = failing_worker(mode, failure_env(models, tmp_path, 2, 60), log_path, job_server)
    try:
        record("worker processes",
               wait_for(lambda: answering(mode, log_path, job_server) or proc.poll() is not None, 60))
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    log = log_path.read_text()
    assert code == 2 and logged_exits(log) == {2}, log[-3000:]


def serve_api(models, log) -> tuple[subprocess.Popen, str]:
    """The worker on tiny-llama under runpod's local API server, and the server's URL."""
    # Port 0: uvicorn binds a free port only once the engine has started (~20 s), and logs it; a
    # port picked here could be taken by then (by vLLM's own free-port probe, among others).
    env = worker_env(**engine_env(models["tiny-llama"]), UVICORN_LOG_LEVEL="info")
    del env["VLLM_WORKER_MULTIPROC_METHOD"]  # the worker's own choice (cpu-dev.env makes it for tests)
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, HANDLER, *RP_API_ARGS], env=env, stdout=sink,
                                stderr=subprocess.STDOUT)
    launched = time.monotonic()
    deadline = launched + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if started := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text()):
            urllib.request.urlopen(started[1] + "/docs", timeout=10)
            record("worker processes", time.monotonic() - launched)
            return proc, started[1]
        time.sleep(1)
    proc.kill()
    pytest.fail("worker did not come up:\n" + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def rp_worker(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("rp-api") / "worker.log"
    proc, url = serve_api(models, log)
    yield proc, url
    spawned = descendants(proc.pid)
    proc.terminate()
    assert proc.wait(timeout=30) == 0 and not logged_exits(log.read_text())
    wait_for(lambda: not any(alive(pid) for pid in spawned), 10)  # vLLM's processes stopped too


@pytest.fixture(scope="module")
def rp_api(rp_worker):
    return rp_worker[1]


def program_at(pid: int) -> str:
    """Where the process's program is mapped (its first mapping): a forked process's is its
    parent's, a spawned one is a program started anew, placed elsewhere (address randomization)."""
    with open(f"/proc/{pid}/maps") as maps:
        return maps.readline().split()[0]


def test_on_the_cpu_the_engine_core_is_forked_and_its_model_worker_spawned_with_bound_threads(rp_worker):
    """vLLM's CPU platform spawns both, each importing vLLM again (~8 s of a core); the worker forks
    the engine core, as vLLM does on a GPU. The model worker is spawned: vLLM binds its OpenMP
    threads to cores (cpu-dev.env's VLLM_CPU_OMP_THREADS_BIND=0-1) through variables OpenMP reads as
    a process loads it, which a forked one loaded before. (A user's VLLM_WORKER_MULTIPROC_METHOD is
    kept: test_vllms_engine_processes_send_no_usage_statistics_by_default finds its spawned process.)"""
    proc, _ = rp_worker
    (core,) = [pid for pid in descendants(proc.pid) if cmdline(pid).startswith(b"VLLM::EngineCore")]
    (model,) = [pid for pid in descendants(proc.pid) if cmdline(pid).startswith(b"VLLM::Worker")]
    assert program_at(core) == program_at(proc.pid) != program_at(model)
    assert threads_bound_to(model) == {1, 2}  # each thread on one core, both cores used (forked: {3})


def threads_bound_to(pid: int) -> set[int]:
    """The CPU masks of the process's own threads (named as the process: vLLM's, OpenMP's): 1 is core
    0, 2 core 1, 3 either (a thread the kernel moves between the two)."""
    return {sum(1 << cpu for cpu in os.sched_getaffinity(int(task)))
            for task in os.listdir(f"/proc/{pid}/task")
            if Path(f"/proc/{pid}/task/{task}/comm").read_text().strip() == "VLLM::Worker"}


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return file.read()


def engine_core_of(pid: int) -> int:
    (core,) = [child for child in descendants(pid) if cmdline(child).startswith(b"VLLM::EngineCore")]
    return core


def test_a_dead_engine_under_the_local_api_server_exits_1_as_it_logs(models, tmp_path):
    """After the job's error, uvicorn ends the process in main()'s SIGTERM handler, which exited 0."""
    log = tmp_path / "worker.log"
    proc, url = serve_api(models, log)
    try:
        os.kill(engine_core_of(proc.pid), signal.SIGKILL)
        result = post(url + "/runsync", {"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 2}}})
        assert "EngineCore" in result["output"][0]["error"]["message"], result
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert code == 1 and logged_exits(log.read_text()) == {1}, log.read_text()[-3000:]


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


def test_vllms_engine_processes_send_no_usage_statistics_by_default(models, tmp_path):
    """vLLM reports usage from its engine's first GPU worker, in the engine's process, unless
    VLLM_NO_USAGE_STATS=1 there (or DO_NOT_TRACK); the operator set none of them. A spawned process's
    environment is readable in /proc as it started (a forked one's is its parent's at exec)."""
    env = worker_env(**{**engine_env(models["tiny-llama"]), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    for name in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK"):
        env.pop(name, None)
    log = tmp_path / "worker.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, HANDLER], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        with timed("worker processes"):
            engine = spawned_engine(proc, 180)
    finally:
        spawned = descendants(proc.pid)
        proc.terminate()
        proc.wait(timeout=60)
        for pid in spawned:  # a start stopped midway: leave none of vLLM's processes behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert engine.get(b"VLLM_NO_USAGE_STATS") == b"1", log.read_text()[-3000:]
    assert "vLLM's usage statistics: not sent (VLLM_NO_USAGE_STATS=1)" in log.read_text()


def spawned_engine(proc: subprocess.Popen, timeout: float) -> dict[bytes, bytes]:
    """The environment of the engine-core process the worker ``proc`` spawns, once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for child in descendants(proc.pid):
            with contextlib.suppress(OSError):
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"spawn_main" not in cmdline.read():
                        continue
                with open(f"/proc/{child}/environ", "rb") as environ:
                    return dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
        time.sleep(0.2)
    pytest.fail("no engine process was spawned")
