"""Property-based fuzzing of ``handler`` on the real engine (tiny model): any job input ends in
normal output or exactly one structured error, in bounded time, and the worker keeps serving.

CI runs 120 derandomised examples. The long run (random, counts printed at the end)::

    FUZZ_EXAMPLES=10000 scripts/test.sh tests/engine/test_fuzz_handler.py -n 0 -s --timeout=0
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import handler

JSON_SCALARS = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=20) | \
    st.floats(allow_nan=True, allow_infinity=True)
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
SMALL = st.integers(-3, 6) | st.floats(-2, 3) | st.just(math.nan) | st.text(max_size=5) | st.none()
TEXT = st.text(max_size=200) | st.sampled_from(["", "\ud800 lone surrogate", "word " * 4000])
SAMPLING = st.dictionaries(
    st.sampled_from(["temperature", "top_p", "top_k", "n", "seed", "stop", "logprobs", "max_tokens",
                     "min_tokens", "presence_penalty", "guided_choice", "structured_outputs", "bogus"]),
    SMALL | st.lists(st.text(max_size=3), max_size=2), max_size=4)
NEAR_VALID = st.fixed_dictionaries({}, optional={
    "prompt": TEXT | JSON, "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bogus"]), "content": TEXT | SMALL}),
        max_size=3) | JSON,
    "sampling_params": SAMPLING | JSON, "stream": st.booleans() | SMALL,
    "apply_chat_template": st.booleans() | SMALL, "max_batch_size": SMALL,
    "min_batch_size": SMALL, "batch_size_growth_factor": SMALL, "timeout": SMALL,
    "openai_route": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                     "/v1/models", "/v1/nope"]) | SMALL,
    "openai_input": JSON | st.fixed_dictionaries({}, optional={
        "messages": JSON, "prompt": TEXT, "max_tokens": SMALL, "stream": st.booleans(),
        "model": st.text(max_size=5)}),
})
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                            "content": TEXT}), min_size=1, max_size=3)
OPENAI_EXTRAS = st.dictionaries(
    st.sampled_from(["temperature", "top_p", "n", "stop", "logprobs", "top_logprobs", "seed", "echo",
                     "response_format", "tools", "tool_choice", "stream_options", "presence_penalty",
                     "max_completion_tokens", "system", "stop_sequences", "bogus"]),
    SMALL | st.booleans() | JSON, max_size=3)
# Well-formed jobs with a few odd parameters: these reach the engine, where the rest stop early.
MOSTLY_VALID = st.one_of(
    st.fixed_dictionaries({"prompt": TEXT, "sampling_params": SAMPLING},
                          optional={"stream": st.booleans(), "max_batch_size": SMALL,
                                    "apply_chat_template": st.booleans()}),
    st.fixed_dictionaries({"messages": MESSAGES, "sampling_params": SAMPLING},
                          optional={"stream": st.booleans()}),
    *(st.fixed_dictionaries({"openai_route": st.just(route), "openai_input": st.fixed_dictionaries(
        {key: value, "stream": st.booleans()}).flatmap(
        lambda body: OPENAI_EXTRAS.map(lambda extras, body=body: {**extras, **body}))})
      for route, key, value in [("/v1/chat/completions", "messages", MESSAGES),
                                ("/v1/messages", "messages", MESSAGES),
                                ("/v1/completions", "prompt", TEXT),
                                ("/v1/responses", "input", TEXT)]),
)
# Keep each job short on two cores: bound generation wherever the input leaves it open.
BOUNDED = {"max_tokens": 8}
SERVED = {}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "120"))
SERVES_EVERY = 50  # a valid job after every this many inputs must still succeed
OUTCOMES: Counter = Counter()
DURATIONS: list[float] = []


@pytest.fixture(scope="module")
def fuzz_engines(tiny_engine, tiny_openai):
    saved = handler.vllm_engine, handler.openai_engine
    handler.vllm_engine, handler.openai_engine = tiny_engine, tiny_openai
    SERVED["model"] = tiny_openai.served_model_name
    yield
    handler.vllm_engine, handler.openai_engine = saved


def bounded(job_input):
    if isinstance(job_input, dict) and isinstance(job_input.get("sampling_params"), dict):
        params = job_input["sampling_params"]
        if not isinstance(params.get("max_tokens"), int) or params["max_tokens"] > 8:
            params["max_tokens"] = 8
        if isinstance(params.get("n"), int) and params["n"] > 4:
            params["n"] = 4
    elif isinstance(job_input, dict) and "sampling_params" not in job_input:
        job_input["sampling_params"] = dict(BOUNDED)
    if isinstance(job_input, dict) and isinstance(job_input.get("openai_input"), dict):
        body = job_input["openai_input"]
        body["max_tokens"] = body["max_output_tokens"] = 8
        body.pop("max_completion_tokens", None)
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = 4
        body.setdefault("model", SERVED["model"])
    return job_input


def check(items: list) -> None:
    errors = [i for i in items if isinstance(i, dict) and "error" in i]
    assert len(errors) <= 1, items
    if errors:
        assert items[-1] is errors[0]
        error = errors[0]["error"]
        assert isinstance(error, dict) and error.get("message") and isinstance(error["message"], str)
        OUTCOMES[f"error {error.get('code') or error.get('type')}"] += 1
    else:
        OUTCOMES["output"] += 1


def serves() -> None:
    items = run({"prompt": "Hello", "sampling_params": {"max_tokens": 3, "ignore_eos": True}})
    assert items[0]["usage"]["output"] == 3 and not math.isnan(items[0]["usage"]["input"])


def run(job_input) -> list:
    async def collect():
        return [item async for item in handler.handler({"id": "fuzz", "input": job_input})]

    started = time.monotonic()
    items = asyncio.run(collect())
    DURATIONS.append(time.monotonic() - started)
    assert DURATIONS[-1] < 30
    return items


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=EXAMPLES <= 120, database=None)
@given(st.one_of(JSON, NEAR_VALID, MOSTLY_VALID))
def test_any_input_ends_in_output_or_one_structured_error(fuzz_engines, job_input):
    check(run(bounded(job_input)))
    if OUTCOMES.total() % SERVES_EVERY == 0:
        serves()


def test_the_worker_still_serves_after_the_fuzzing(fuzz_engines):
    serves()
    print("fuzz outcomes:", json.dumps({"inputs": OUTCOMES.total(), "slowest_s": round(max(DURATIONS), 2),
                                        **dict(OUTCOMES.most_common())}))


MEGABYTE = "word " * (2**20 // 5)
HUGE_INPUTS = {
    "raw prompt": {"prompt": MEGABYTE},
    "raw messages": {"messages": [{"role": "user", "content": MEGABYTE}]},
    "chat": {"openai_route": "/v1/chat/completions",
             "openai_input": {"messages": [{"role": "user", "content": MEGABYTE}]}},
    "completions": {"openai_route": "/v1/completions", "openai_input": {"prompt": MEGABYTE}},
    "messages": {"openai_route": "/v1/messages",
                 "openai_input": {"messages": [{"role": "user", "content": MEGABYTE}]}},
}


@pytest.mark.parametrize("name", HUGE_INPUTS)
def test_a_one_megabyte_prompt_is_one_error_naming_the_context_limit(fuzz_engines, name):
    (item,) = run(bounded(dict(HUGE_INPUTS[name])))
    error = item["error"]
    assert error.get("code") == 400 or error.get("type") == "invalid_request_error"
    assert "2048" in error["message"], error["message"]
