"""Raw jobs as worker-vllm 2.24 sends them (``routes/raw_format``), where a request parameter belongs in
a job (``engine/sampling.check_top_level``), and which limit bounds a job (``timeout_for``): pure logic.
The real worker answering them: tests/endpoint/test_worker_vllm_format.py."""

from __future__ import annotations

import logging

import pytest

from worker.config.settings import WorkerSettings
from worker.engine.sampling import check_top_level
from worker.jobs.job_input import JobInput
from worker.routes.raw_format import CHAT, COMPLETIONS, ONE_EVENT, raw_request
from worker.wire.errors import RequestError

CHAT_MESSAGES = [{"role": "user", "content": "Hi"}]


def job(**job_input) -> JobInput:
    return JobInput.from_job({"id": "j", "input": job_input})


def request(settings: WorkerSettings | None = None, **job_input):
    return raw_request(job(**job_input), "served/model", settings or WorkerSettings())


@pytest.mark.parametrize(("job_input", "route", "llm_input"), [
    ({"prompt": "Once"}, COMPLETIONS, {"prompt": "Once"}),
    ({"messages": CHAT_MESSAGES}, CHAT, {"messages": CHAT_MESSAGES}),
    ({"prompt": CHAT_MESSAGES}, CHAT, {"messages": CHAT_MESSAGES}),
    ({"prompt": "Hi", "apply_chat_template": True}, CHAT, {"messages": CHAT_MESSAGES}),
    ({"prompt": ["Once", "Twice"]}, COMPLETIONS, {"prompt": ["Once", "Twice"]}),
    ({"prompt": [1, 2, 3]}, COMPLETIONS, {"prompt": [1, 2, 3]}),
    ({"prompt": [[1, 2], [3]]}, COMPLETIONS, {"prompt": [[1, 2], [3]]}),
])
def test_a_prompt_goes_to_completions_and_a_chat_to_chat_completions(job_input, route, llm_input):
    raw = request(**job_input, sampling_params={"max_tokens": 5, "stream": True})
    assert (raw.job.openai_route, raw.job.method) == (route, "POST")
    # sampling_params is the body; the job's own stream wins, and the served model is filled in
    assert raw.job.openai_input == {"max_tokens": 5, "stream": False, "model": "served/model", **llm_input}


def test_the_model_is_the_one_sampling_params_or_the_job_names():
    assert request(prompt="x", sampling_params={"model": "a"}, model="b").job.openai_input["model"] == "a"
    assert request(prompt="x", model="b").job.openai_input["model"] == "b"


@pytest.mark.parametrize("prompt", [["Once", "Twice"], [1, 2]])
def test_apply_chat_template_takes_a_string_prompt(prompt):
    with pytest.raises(RequestError, match="apply_chat_template takes a string prompt") as raised:
        request(prompt=prompt, apply_chat_template=True)
    assert raised.value.param == "prompt"


def test_a_job_with_both_prompt_and_messages_is_refused():
    with pytest.raises(RequestError, match="both 'prompt' and 'messages'"):
        request(prompt="x", messages=CHAT_MESSAGES)


def test_a_stream_is_one_event_per_item_unless_the_job_or_the_worker_batches_it():
    assert request(prompt="x", stream=True).per_event is ONE_EVENT
    assert request(prompt="x", stream=True, max_batch_size=4).per_event is None
    assert request(WorkerSettings.model_validate({"DEFAULT_BATCH_SIZE": "8"}), prompt="x").per_event is None


def test_the_route_job_keeps_the_jobs_id_and_timeout():
    original = job(prompt="x", timeout=3)
    kept = raw_request(original, "served/model", WorkerSettings()).job
    assert (kept.request_id, kept.timeout, kept.prompt) == (original.request_id, 3, "x")


@pytest.mark.parametrize(("job_input", "raw_format", "advice"), [
    ({"prompt": "x", "max_tokens": 5}, "tokens", "request parameters go in 'sampling_params'"),
    ({"prompt": "x", "guided_json": {}}, "tokens", "request parameters go in 'sampling_params'"),
    ({"prompt": "x", "response_format": {}}, "openai", "request parameters go in 'sampling_params'"),
    ({"prompt": "x", "response_format": {}}, "tokens", "RAW_JOB_FORMAT=openai"),
    ({"openai_route": "/v1/completions", "openai_input": {}, "temperature": 0}, "tokens",
     "the request body goes in 'openai_input'"),
])
def test_a_request_parameter_at_the_top_level_is_refused_naming_it(job_input, raw_format, advice):
    with pytest.raises(RequestError) as raised:
        check_top_level(job(**job_input), raw_format)
    key = next(iter(set(job_input) - {"prompt", "openai_route", "openai_input"}))
    assert str(raised.value).startswith(f"'{key}' at the input's top level is not read: ")
    assert advice in str(raised.value) and raised.value.param == key and raised.value.status == 400


def test_other_unread_keys_are_ignored_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    check_top_level(job(prompt="x", foo=1, bar=2, sampling_params={"max_tokens": 2}), "tokens", "j-1")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Job j-1: input keys 'bar', 'foo' are not read (ignored)"]
    check_top_level(job(prompt="x", route="/v1/models"), "tokens")  # worker-vllm 2.24's names are read
    assert len(caplog.records) == 1


@pytest.mark.parametrize("raw_format", ["tokens", "openai"])
def test_keys_that_only_label_a_request_are_ignored_with_the_warning(caplog, raw_format):
    caplog.set_level(logging.WARNING)
    check_top_level(job(prompt="x", user="customer-42", request_id="r-1", session_id="s-1"), raw_format, "j-2")
    assert [r.getMessage() for r in caplog.records] == [
        "Job j-2: input keys 'request_id', 'session_id', 'user' are not read (ignored)"]


@pytest.mark.parametrize(("settings", "job_timeout", "limit"), [
    ({}, None, (3600, "REQUEST_TIMEOUT")), ({"REQUEST_TIMEOUT": "0"}, None, (None, "")),
    ({"JOB_TIMEOUT": "60"}, None, (60, "JOB_TIMEOUT")), ({"JOB_TIMEOUT": "60"}, 30, (30, "timeout")),
    ({"JOB_TIMEOUT": "60"}, 90, (60, "JOB_TIMEOUT")), ({"REQUEST_TIMEOUT": "20", "JOB_TIMEOUT": "60"}, 90,
                                                      (20, "REQUEST_TIMEOUT"))])
def test_the_smallest_limit_set_bounds_a_job(settings, job_timeout, limit):
    assert WorkerSettings.model_validate(settings).timeout_for(job_timeout) == limit
