"""handler(): error classification with stand-in engines (the real engine is in tests/engine)."""

import asyncio
import subprocess
import sys
from http import HTTPStatus

import pytest
from conftest import REPO, alive, wait_for
from vllm.exceptions import (GracefulHTTPError, QueueOverflowError, RetryableRequestError, VLLMNotFoundError,
                             VLLMUnprocessableEntityError, VLLMValidationError)

import handler
from worker.wire.errors import RequestError
from worker.config.settings import WorkerSettings
from worker.engine.background_loop import BackgroundLoop
from worker.engine.tokenizer import NO_TEMPLATE, TokenizerWrapper
from worker.engine.vllm_engine import vLLMEngine
from worker.vllm_adapter.errors import EngineDeadError, is_fatal


class FailingEngine:
    settings = WorkerSettings()

    def __init__(self, exc):
        self.exc = exc

    async def generate(self, job_input):
        yield {"choices": [{"tokens": ["partial"]}], "usage": {"input": 1, "output": 1}}
        raise self.exc


def run(job, engine, monkeypatch):
    monkeypatch.setattr(handler, "vllm_engine", engine)

    async def collect():
        return [item async for item in handler.handler(job)]

    return asyncio.run(collect())


def test_dead_engine_reports_the_job_then_exits_nonzero(monkeypatch):
    exits = []
    monkeypatch.setattr(handler, "_exit_soon", exits.append)
    items = run({"id": "j", "input": {"prompt": "x"}}, FailingEngine(EngineDeadError()), monkeypatch)
    assert items[1]["error"]["code"] == 500 and "EngineCore" in items[1]["error"]["message"]
    assert exits == [1]


@pytest.mark.parametrize(("exc", "code"), [(RuntimeError("odd"), 500), (ValueError("bad"), 400)])
def test_other_errors_keep_the_worker(monkeypatch, exc, code):
    exits = []
    monkeypatch.setattr(handler, "_exit_soon", exits.append)
    items = run({"id": "j", "input": {"prompt": "x"}}, FailingEngine(exc), monkeypatch)
    assert [i.get("error", {}).get("code") for i in items] == [None, code] and exits == []
    assert not is_fatal(exc)


class RefusingLLM:
    """An AsyncLLM stand-in whose requests fail with ``exc``, as ``AsyncLLM.generate`` raises."""

    exc: Exception

    async def generate(self, prompt, params, request_id, *, lora_request=None):
        raise self.exc
        yield


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(char) for char in text]


@pytest.fixture
def refusing_engine():
    """The raw-job engine (vLLMEngine) around RefusingLLM."""
    loop = BackgroundLoop("test-engine")
    yield vLLMEngine.from_parts(WorkerSettings(), RefusingLLM(), loop, tokenizer=CharTokenizer())
    loop.close()


@pytest.mark.parametrize(("exc", "code", "error_type"), [
    (QueueOverflowError(), 503, "ServiceUnavailableError"),  # a GracefulHTTPError: its own status
    (GracefulHTTPError("slow down", HTTPStatus.TOO_MANY_REQUESTS), 429, "RateLimitError"),
    (RetryableRequestError(), 503, "ServiceUnavailableError"),
    (VLLMUnprocessableEntityError("image URL not found", parameter="image_url"), 422,
     "UnprocessableEntityError"),
    (NotImplementedError("not on this platform"), 501, "NotImplementedError"),
    (VLLMNotFoundError("no such adapter"), 404, "NotFoundError"),
    (VLLMValidationError("too long", parameter="max_tokens"), 400, "BadRequestError"),
    (OverflowError("int too large"), 400, "BadRequestError"),
])
def test_a_raw_job_answers_vllms_own_status(monkeypatch, refusing_engine, exc, code, error_type):
    """As `vllm serve`'s exception handlers answer each of vLLM's exceptions."""
    refusing_engine.llm.exc = exc
    [item] = run({"id": "j", "input": {"prompt": "x"}}, refusing_engine, monkeypatch)
    error = item["error"]
    assert (error["code"], error["type"]) == (code, error_type) and error["message"] == str(exc)
    assert error["param"] == getattr(exc, "parameter", None)


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/chat/completions"])
def test_a_job_failing_validation_is_answered_in_its_routes_dialect(monkeypatch, route):
    job = {"id": "j", "input": {"openai_route": route, "openai_input": {}, "max_batch_size": "many"}}
    [item] = run(job, None, monkeypatch)
    if route == "/v1/messages":
        assert item["type"] == "error" and item["error"]["type"] == "invalid_request_error"
    else:
        assert item["error"]["code"] == 400 and item["error"]["param"] == "max_batch_size"
    assert "max_batch_size" in item["error"]["message"]


def test_openai_route_without_openai_engine(monkeypatch):
    monkeypatch.setattr(handler, "openai_engine", None)
    items = run({"id": "j", "input": {"openai_route": "/v1/models"}}, None, monkeypatch)
    assert items[0]["error"]["code"] == 400 and "/v1/models" in items[0]["error"]["message"]


class PlainTokenizer:
    chat_template = None

    def apply_chat_template(self, messages, chat_template=None, **_):
        return chat_template.replace("{{ content }}", messages[-1]["content"])


def test_missing_chat_template_is_a_clear_error():
    with pytest.raises(RequestError, match="Chat template does not exist") as raised:
        TokenizerWrapper(PlainTokenizer()).apply_chat_template([{"role": "user", "content": "x"}])
    assert str(raised.value) == NO_TEMPLATE


def test_custom_chat_template_is_used_and_strings_become_user_messages():
    wrapper = TokenizerWrapper(PlainTokenizer(), "<u>{{ content }}</u>")
    assert wrapper.has_chat_template and wrapper.apply_chat_template("hi") == "<u>hi</u>"


class SlowEngine:
    def __init__(self, job_timeout=None):
        self.settings = WorkerSettings(JOB_TIMEOUT=job_timeout) if job_timeout else WorkerSettings()
        self.closed = False

    async def generate(self, job_input):
        try:
            while True:
                yield {"choices": [{"tokens": ["x"]}], "usage": {"input": 1, "output": 1}}
                await asyncio.sleep(0.05)
        finally:
            self.closed = True


@pytest.mark.parametrize(("job_timeout", "job_keys", "limit", "name"), [
    (None, {"timeout": 0.3}, 0.3, "timeout"), (0.2, {}, 0.2, "JOB_TIMEOUT"),
    (5, {"timeout": 0.2}, 0.2, "timeout"), (0.2, {"timeout": 5}, 0.2, "JOB_TIMEOUT")])
def test_jobs_past_their_timeout_are_aborted(monkeypatch, job_timeout, job_keys, limit, name):
    """The smallest limit set applies (a job's own ``timeout`` cannot exceed JOB_TIMEOUT), and is named."""
    engine = SlowEngine(job_timeout)
    items = run({"id": "j", "input": {"prompt": "x", **job_keys}}, engine, monkeypatch)
    assert items[-1]["error"]["code"] == 408 and f"{limit:g} s ({name})" in items[-1]["error"]["message"]
    assert 2 <= len(items) - 1 <= limit / 0.05 + 2 and engine.closed  # the source was closed


def test_jobs_still_running_after_the_grace_period_are_aborted_with_503(monkeypatch):
    shutting_down = handler.Deadlines()
    monkeypatch.setattr(handler, "deadlines", shutting_down)
    engine = SlowEngine()

    async def begin_then_run():
        shutting_down.begin_shutdown(0.2)
        return [item async for item in handler.handler({"id": "j", "input": {"prompt": "x"}})]

    monkeypatch.setattr(handler, "vllm_engine", engine)
    items = asyncio.run(begin_then_run())
    error = items[-1]["error"]
    assert error["code"] == 503 and "SHUTDOWN_GRACE_PERIOD" in error["message"] and engine.closed


CHILD_LEFT_BEHIND = """
import multiprocessing, sys, time
sys.path.insert(0, "src")
from worker.startup import process_exit
if __name__ == "__main__":
    child = multiprocessing.Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    print(child.pid, flush=True)
    process_exit.exit_now(3)
"""


def test_an_immediate_exit_takes_the_child_processes_along(tmp_path):
    script = tmp_path / "exit_now.py"
    script.write_text(CHILD_LEFT_BEHIND)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    child = int(done.stdout.split()[0])
    wait_for(lambda: not alive(child), 10)  # killed (a zombie, or reaped); else it sleeps 60 s


@pytest.mark.parametrize(("resizes_busy", "held", "expected"), [
    (True, 5, 24),  # JobLoop applies a new number to a busy worker
    (False, 5, 16),  # the SDK's loop would wait for the worker to drain: kept until it is empty
    (False, 0, 24),
])
def test_the_concurrency_modifier_hands_the_sdk_loop_a_new_number_only_when_idle(monkeypatch, resizes_busy,
                                                                                  held, expected):
    from worker.scheduling.concurrency import Concurrency

    monkeypatch.setattr(handler, "_add_grace_period", lambda _seconds: None)
    monkeypatch.setattr(handler.deadlines, "running", held)
    jobs = Concurrency(1, 256, held=lambda: held, start=24)
    assert handler._concurrency(WorkerSettings(), jobs, resizes_busy)(16) == expected
