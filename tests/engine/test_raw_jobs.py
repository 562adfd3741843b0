"""Raw jobs through the real ``handler`` on the real vLLM engine (CPU)."""

from __future__ import annotations

import json

import pytest

from worker.jobs.batching import BatchSize

CAPITAL = "What is the capital of France?"


def texts(items: list[dict]) -> list[str]:
    """The full text of each choice across all items."""
    assert items and all("choices" in i for i in items), items
    n = len(items[0]["choices"])
    return ["".join(tok for item in items for tok in item["choices"][i]["tokens"]) for i in range(n)]


def batch_sizes(items: list[dict]) -> list[int]:
    outputs = [0] + [i["usage"]["output"] for i in items]
    return [b - a for a, b in zip(outputs, outputs[1:], strict=False)]


def assert_schedule(items: list[dict], size: BatchSize, total: int) -> None:
    """Each batch reaches the schedule's current size; only the last may fall short.

    vLLM merges two steps' tokens into one output when the consumer is a step behind, and a
    batch never splits an output, so a batch may overshoot its target by a token or two.
    """
    sizes = batch_sizes(items)
    assert sum(sizes) == total, sizes
    for i, got in enumerate(sizes):
        target = size.current_batch_size
        low = target if i < len(sizes) - 1 else 1
        assert low <= got <= target + 2, (i, sizes)
        size.update()


# --- answers (SmolLM2) ------------------------------------------------------------------------

def test_prompt_with_chat_template_answers_paris(smol_engine, run_job):
    items = run_job(smol_engine, {"prompt": CAPITAL, "apply_chat_template": True,
                                  "sampling_params": {"temperature": 0, "max_tokens": 30}})
    assert len(items) == 1 and "Paris" in texts(items)[0]


def test_messages_answer_paris_streaming(smol_engine, run_job):
    items = run_job(smol_engine, {"messages": [{"role": "user", "content": CAPITAL}], "stream": True,
                                  "sampling_params": {"temperature": 0, "max_tokens": 30}})
    assert len(items) > 1 and "Paris" in texts(items)[0]


def test_structured_output_is_valid_json_for_the_schema(smol_engine, run_job):
    schema = {"type": "object", "additionalProperties": False, "required": ["capital"],
              "properties": {"capital": {"type": "string", "maxLength": 20}}}
    for key, value in (("structured_outputs", {"json": schema}), ("guided_json", schema)):
        items = run_job(smol_engine, {"prompt": CAPITAL + " Answer in JSON.", "apply_chat_template": True,
                                      "sampling_params": {"temperature": 0, "max_tokens": 60, key: value}})
        answer = json.loads(texts(items)[0])
        assert list(answer) == ["capital"] and isinstance(answer["capital"], str)


def test_usage_counts_real_tokens(smol_engine, run_job):
    tokenizer = smol_engine.tokenizer
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CAPITAL), add_special_tokens=False)
    items = run_job(smol_engine, {"prompt": CAPITAL, "apply_chat_template": True,
                                  "sampling_params": {"temperature": 0, "max_tokens": 30}})
    answer_ids = tokenizer.encode(texts(items)[0], add_special_tokens=False)
    assert items[-1]["usage"]["input"] == len(prompt_ids)
    # The answer ends with <|im_end|> (a special token the text leaves out) unless cut at 30.
    assert items[-1]["usage"]["output"] - len(answer_ids) in (0, 1)


# --- shapes and batching (tiny model) -------------------------------------------------------

def long_job(**extra):
    return {"prompt": "Once upon a time", "stream": True,
            "sampling_params": {"max_tokens": 60, "ignore_eos": True, "temperature": 0}, **extra}


def test_stream_batches_grow_with_worker_defaults(tiny_engine, run_job):
    items = run_job(tiny_engine, long_job())
    assert_schedule(items, BatchSize(50, 1, 3), 60)  # ideally 1, 3, 9, 27, 20
    assert items[-1]["usage"] == {"input": items[0]["usage"]["input"], "output": 60}
    assert all(len(i["choices"][0]["tokens"]) <= s for i, s in zip(items, batch_sizes(items), strict=True))


def test_stream_batches_follow_per_job_overrides(tiny_engine, run_job):
    items = run_job(tiny_engine, long_job(max_batch_size=8, min_batch_size=2, batch_size_growth_factor=2))
    assert_schedule(items, BatchSize(8, 2, 2), 60)  # ideally 2, 4, 8, 8, 8, 8, 8, 8, 6


def test_fixed_batches_when_growth_is_off(tiny_engine, run_job):
    items = run_job(tiny_engine, long_job(max_batch_size=25, batch_size_growth_factor=1))
    assert_schedule(items, BatchSize(25, 1, 1), 60)  # ideally 25, 25, 10


def test_non_stream_is_one_item_with_the_whole_text(tiny_engine, run_job):
    job = long_job(stream=False)
    streamed = texts(run_job(tiny_engine, long_job()))
    items = run_job(tiny_engine, job)
    assert len(items) == 1 and len(items[0]["choices"][0]["tokens"]) == 1
    assert texts(items) == streamed  # temperature 0: the same text either way
    assert items[0]["usage"]["output"] == 60


@pytest.mark.parametrize("stream", [False, True])
def test_n_returns_that_many_choices(tiny_engine, run_job, stream):
    items = run_job(tiny_engine, {"prompt": "Hello", "stream": stream,
                                  "sampling_params": {"n": 2, "max_tokens": 8, "ignore_eos": True,
                                                      "seed": 7, "temperature": 1.0}})
    choices = texts(items)
    assert len(choices) == 2 and all(choices)
    assert items[-1]["usage"]["output"] == 16


def test_logprobs_per_token(tiny_engine, run_job):
    items = run_job(tiny_engine, {"prompt": "Hello", "sampling_params": {
        "max_tokens": 5, "ignore_eos": True, "logprobs": 2}})
    logprobs = items[0]["choices"][0]["logprobs"]
    assert len(logprobs) == 5
    assert all(e["logprob"] <= 0 and 1 <= len(e["top_logprobs"]) <= 3 for e in logprobs)


def test_token_ids_answer_as_the_text_they_encode(tiny_engine, run_job):
    params = {"max_tokens": 8, "temperature": 0}
    ids = tiny_engine.tokenizer.encode("Once upon a time", add_special_tokens=True)
    by_ids = run_job(tiny_engine, {"prompt": ids, "sampling_params": params})
    by_text = run_job(tiny_engine, {"prompt": "Once upon a time", "sampling_params": params})
    assert texts(by_ids) == texts(by_text) and by_ids[0]["usage"] == by_text[0]["usage"]
    assert by_ids[0]["usage"]["input"] == len(ids)


def test_stop_and_seed(tiny_engine, run_job):
    job = {"prompt": "Hello", "sampling_params": {"max_tokens": 20, "seed": 11, "temperature": 1.0,
                                                  "ignore_eos": True}}  # no early EOS: text to stop in
    assert texts(run_job(tiny_engine, job)) == texts(run_job(tiny_engine, job))
    first = texts(run_job(tiny_engine, job))[0]
    stop = first[len(first) // 2:][:2]
    with_stop = {**job, "sampling_params": {**job["sampling_params"], "stop": [stop]}}
    stopped = texts(run_job(tiny_engine, with_stop))
    assert stop not in stopped[0] and first.startswith(stopped[0])


# --- bad input: one structured error, then the worker keeps serving ------------------------

BAD_INPUTS = [
    ({"messages": "hi"}, "messages"),
    ({"prompt": "x", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ({"prompt": "x", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"prompt": "x", "sampling_params": {"max_tokens": -10}}, "sampling_params.max_tokens"),
    ({"prompt": "x", "sampling_params": {"foo": 1}}, "sampling_params.foo"),
    ("not an object", "input"),
    ({"prompt": "word " * 3000}, "input_tokens"),
    ({"prompt": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"prompt": "x", "sampling_params": {"max_tokens": 1e30}}, "sampling_params.max_tokens"),
    # a list of prompts: the openai format's (RAW_JOB_FORMAT=openai); a bad prompt: neither
    ({"prompt": ["Hello", "Bye"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [1, 2], "apply_chat_template": True}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
]


@pytest.mark.parametrize(("job_input", "param"), BAD_INPUTS)
def test_bad_input_gives_one_structured_error_then_serving_continues(tiny_engine, run_job, job_input, param):
    items = run_job(tiny_engine, job_input)
    assert len(items) == 1 and set(items[0]) == {"error"}, items
    error = items[0]["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert error["param"] == param
    assert json.loads(str(error)) == error  # runpod fails the job with str(error): JSON
    ok = run_job(tiny_engine, {"prompt": "Hello", "sampling_params": {"max_tokens": 3, "ignore_eos": True}})
    assert ok[0]["usage"]["output"] == 3


def test_custom_chat_template_on_the_real_tokenizer(tiny_engine, run_job):
    from worker.engine.tokenizer import TokenizerWrapper

    wrapper = TokenizerWrapper(tiny_engine.tokenizer.tokenizer,
                               "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}")
    assert wrapper.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user:hi]"
