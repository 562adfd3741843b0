"""JobInput validation and sampling-parameter building (no engine)."""

import json

import pytest

from worker.wire.errors import RequestError
from worker.wire.nesting import MAX_DEPTH, Raw
from worker.jobs.job_input import JobInput
from worker.engine.sampling import DEFAULT_MAX_TOKENS, build_sampling_params
from worker.vllm_adapter.raw_jobs import RequestOutputKind


def parse(payload, job_id="job-1"):
    return JobInput.from_job({"id": job_id, "input": payload})


def test_defaults_and_llm_input():
    job = parse({"prompt": "hi"})
    assert (job.llm_input, job.stream, job.apply_chat_template) == ("hi", False, False)
    assert job.sampling_params == {}
    assert job.max_batch_size is None and job.openai_route is None
    assert job.request_id.startswith("job-1-")


@pytest.mark.parametrize(("prompt", "form"), [
    ("hi", "text"), ([{"role": "user", "content": "hi"}], "messages"), ([], "messages"),
    (["hi", "there"], "texts"), ([5, 6], "token_ids"), ([[5, 6], [7]], "token_id_lists")])
def test_a_prompt_is_any_form_v1_completions_takes_or_chat_messages(prompt, form):
    assert parse({"prompt": prompt}).input_form == form


def test_messages_win_but_null_messages_do_not_hide_prompt():
    messages = [{"role": "user", "content": "x"}]
    assert parse({"prompt": "p", "messages": messages}).llm_input == messages
    assert parse({"prompt": "p", "messages": None}).llm_input == "p"


def test_request_ids_are_unique_and_not_client_chosen():
    a, b = parse({"prompt": "x", "request_id": "mine"}), parse({"prompt": "x", "request_id": "mine"})
    assert a.request_id != b.request_id and "mine" not in a.request_id


def test_batch_overrides_coerced_and_zero_means_default():
    job = parse({"prompt": "x", "max_batch_size": "7", "min_batch_size": 0, "batch_size_growth_factor": 2})
    assert (job.max_batch_size, job.min_batch_size, job.batch_size_growth_factor) == (7, None, 2.0)


@pytest.mark.parametrize(("payload", "param", "fragment"), [
    ({"messages": "hi"}, "messages", "valid list"),
    ({"prompt": 12}, "prompt", "expected a string, a list of chat messages"),
    ({"prompt": ["hi", 3]}, "prompt", "a list of strings, token ids or lists of token ids"),
    ({"prompt": [1, True]}, "prompt", "expected a string, a list of chat messages"),
    ({"prompt": [[1], []]}, "prompt", "expected a string, a list of chat messages"),
    ({}, None, "needs 'prompt', 'messages' or 'openai_route'"),
    ({"prompt": "x", "max_batch_size": -1}, "max_batch_size", "greater than or equal to 1"),
    ({"prompt": "x", "stream": "often"}, "stream", "valid boolean"),
    ({"prompt": "x", "sampling_params": [1]}, "sampling_params", "valid dictionary"),
])
def test_invalid_inputs_name_the_field(payload, param, fragment):
    with pytest.raises(RequestError) as raised:
        parse(payload)
    assert raised.value.param == param and fragment in str(raised.value)


@pytest.mark.parametrize("job", [None, [], {"input": "text"}, {"input": None}, {"id": 1}])
def test_non_object_inputs(job):
    with pytest.raises(RequestError, match="must be a JSON object"):
        JobInput.from_job(job)


def test_an_input_nested_deeper_than_the_limit_is_refused_before_it_is_validated():
    def nested(levels):  # the input itself is the first level
        return json.loads('{"prompt": "x", "note": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}")

    assert parse(nested(MAX_DEPTH)).unread_keys == ["note"]
    for payload in (nested(MAX_DEPTH + 1), Raw("[[]]")):  # Raw: too deep for Python's parser
        with pytest.raises(RequestError, match=f"job input is nested more than {MAX_DEPTH} levels") as caught:
            parse(payload)
        assert caught.value.param == "input" and caught.value.status == 400


def test_sampling_params_defaults_and_kind():
    fields = {"temperature": 0}
    params = build_sampling_params(fields, stream=True)
    assert params.max_tokens == DEFAULT_MAX_TOKENS and params.output_kind == RequestOutputKind.DELTA
    assert fields == {"temperature": 0}  # the job's dict is left alone
    assert build_sampling_params({}, stream=False).output_kind == RequestOutputKind.FINAL_ONLY


def test_sampling_params_full_surface():
    params = build_sampling_params({"n": 2, "seed": 3, "stop": ["x"], "logprobs": 2, "top_k": 5,
                                    "structured_outputs": {"json": {"type": "object"}}}, stream=False)
    assert (params.n, params.seed, params.stop, params.logprobs, params.top_k) == (2, 3, ["x"], 2, 5)
    assert params.structured_outputs.json == {"type": "object"}


def test_guided_spellings_map_to_structured_outputs():
    params = build_sampling_params({"guided_choice": ["a", "b"]}, stream=False)
    assert params.structured_outputs.choice == ["a", "b"]


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"temperature": -0.5}, "sampling_params.temperature", "non-negative"),
    ({"top_p": 1.5}, "sampling_params.top_p", "top_p must be in (0, 1]"),
    ({"max_tokens": -10}, "sampling_params.max_tokens", "at least 1"),
    ({"temperature": "hot"}, "sampling_params.temperature", "Expected `float`, got `str`"),
    ({"max_token": 5}, "sampling_params.max_token", "did you mean 'max_tokens'"),
    ({"output_kind": 1}, "sampling_params.output_kind", "unknown field"),
])
def test_bad_sampling_params_name_the_field(fields, param, fragment):
    with pytest.raises(RequestError) as raised:
        build_sampling_params(fields, stream=False)
    assert raised.value.param == param and fragment in str(raised.value)
