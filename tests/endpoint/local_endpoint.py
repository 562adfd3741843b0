"""A local endpoint with real worker processes, for the endpoint tests: start it, wait for it,
find its processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import CPU_ENV, REPO, descendants
from dev_env import free_port
from starts import record

API_KEY = "test-key-5f1c"  # the workers' RUNPOD_AI_API_KEY too
HF_TOKEN = "hf_test_secret_9b2e"  # read by huggingface_hub; must never be logged


class LocalEndpoint:
    def __init__(self, env: dict[str, str], workers: int, log_path, handler: str | None = None,
                 ready_timeout: float | None = 400, args: tuple[str, ...] = ()) -> None:
        """Starts the endpoint and waits up to ``ready_timeout`` s for its workers (None: not at all).
        With ``--load-balancer`` in ``args``, a load-balancing endpoint: requests keep their paths."""
        self.port = free_port()
        self.load_balancer = "--load-balancer" in args
        self.base = f"http://127.0.0.1:{self.port}" + ("" if self.load_balancer else "/v2/local")
        self.log_path = log_path
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "endpoint", "--port", str(self.port), "--workers", str(workers),
             "--api-key", API_KEY, *(["--handler", handler] if handler else []), *args],
            cwd=REPO, env={**os.environ, **CPU_ENV, **env},
            stdout=log_path.open("w"), stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {API_KEY}"},
                                 timeout=120)
        try:
            if ready_timeout is None:
                self.ready_after = None
                self._wait_serving()
            else:
                self.ready_after = self._wait_ready(workers, ready_timeout)
        finally:
            record("endpoints", time.monotonic() - self.started, workers)

    def _wait_serving(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.http.get("/ping" if self.load_balancer else "/health")  # the balancer's own /ping
                return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        pytest.fail("endpoint did not serve:\n" + self.log()[-4000:])

    def _wait_ready(self, workers: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if " exited with status " in self.log():  # the endpoint restarts it: fail now instead
                break
            if "worker(s) ready" in self.log():
                if not self.load_balancer:  # there, every path is a worker's
                    assert self.http.get("/health").json()["workers"]["ready"] == workers
                return time.monotonic() - self.started
            time.sleep(0.5)
        self.stop()
        pytest.fail("endpoint did not become ready:\n" + self.log()[-4000:])

    def openai_client(self) -> openai.OpenAI:
        """The official openai client on this endpoint's OpenAI face."""
        return openai.OpenAI(base_url=self.openai_base, api_key=API_KEY, max_retries=0)

    @property
    def openai_base(self) -> str:
        return self.base + ("/v1" if self.load_balancer else "/openai/v1")

    def model(self) -> str:
        """The served model's name, as /v1/models lists it first."""
        return self.http.get(self.openai_base.removeprefix(self.base) + "/models").json()["data"][0]["id"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=90)


def failed_start_answers(endpoint: LocalEndpoint) -> list[str]:
    """A load-balancing endpoint whose worker could not start: once ``/ping`` says 200 (the worker
    answers with the cause), the error messages of a chat request and a ``/runsync`` job, each a 503."""
    endpoint._wait_ready(1, 120)
    chat = {"model": "any", "messages": [{"role": "user", "content": "x"}]}
    messages = []
    for path, body in (("/v1/chat/completions", chat), ("/runsync", {"input": {"prompt": "x"}})):
        response = endpoint.http.post(path, json=body)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        messages.append(error if isinstance(error, str) else error["message"])
    return messages


class HealthSampler:
    """The endpoint's ``/health`` answer every 20 ms, in a thread, until ``stop()``; with ``path``
    another one's, as ``read`` takes it from the response."""

    def __init__(self, endpoint: LocalEndpoint, path: str = "/health", read=httpx.Response.json) -> None:
        self.endpoint, self.samples, self._stop = endpoint, [], threading.Event()
        self.path, self.read = path, read
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.samples.append(self.read(self.endpoint.http.get(self.path, timeout=5)))
            except httpx.TransportError as exc:  # not listening yet
                self.samples.append(type(exc).__name__)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


def openai_fixtures():
    """A module's ``endpoint`` fixture as the official openai client sees it:
    ``client, model = openai_fixtures()``."""

    @pytest.fixture(scope="module")
    def client(endpoint) -> openai.OpenAI:
        return endpoint.openai_client()

    @pytest.fixture(scope="module")
    def model(endpoint) -> str:
        return endpoint.model()

    return client, model


def worker_pids(endpoint: LocalEndpoint) -> dict[str, int]:
    """Worker id → pid of the endpoint's direct children (the workers), from their environment."""
    pids = {}
    for pid in descendants(endpoint.proc.pid):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as env:
                variables = dict(v.split(b"=", 1) for v in env.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if parent == endpoint.proc.pid and b"RUNPOD_POD_ID" in variables:
            pids[variables[b"RUNPOD_POD_ID"].decode()] = pid
    return pids
