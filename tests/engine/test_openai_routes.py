"""OpenAI and Anthropic routes through the real ``handler`` and vLLM's own serving code."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import sse_events
from conftest import cosine
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion

from worker.config.worker_config import load_config
from worker.jobs.batching import BatchSize
from worker.jobs.job_input import JobInput
from worker.routes.serving import OpenAIvLLMEngine

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def model_of(engine: OpenAIvLLMEngine) -> str:
    return engine.served_model_name


def chunks(items: list[str]) -> list[dict]:
    """Parsed chunks of a raw-mode stream; the stream must end with [DONE]."""
    events = sse_events.parse("".join(items))
    assert events[-1] == (None, "[DONE]")
    return [json.loads(data) for _, data in events[:-1]]


# --- answers (SmolLM2) ------------------------------------------------------------------------

def test_chat_answers_paris(smol_openai, run_openai):
    body = {"model": model_of(smol_openai), "messages": CAPITAL, "temperature": 0, "max_tokens": 30}
    (item,) = run_openai(smol_openai, "/v1/chat/completions", body)
    completion = ChatCompletion.model_validate(item)
    assert "Paris" in completion.choices[0].message.content
    assert completion.usage.completion_tokens > 0


def test_chat_stream_answers_paris(smol_openai, run_openai):
    body = {"model": model_of(smol_openai), "messages": CAPITAL, "temperature": 0, "max_tokens": 30,
            "stream": True, "stream_options": {"include_usage": True}}
    parsed = [ChatCompletionChunk.model_validate(c)
              for c in chunks(run_openai(smol_openai, "/v1/chat/completions", body))]
    text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
    assert "Paris" in text and parsed[-1].usage.completion_tokens > 0


def test_messages_answer_paris(smol_openai, run_openai):
    body = {"model": model_of(smol_openai), "messages": CAPITAL, "max_tokens": 30, "temperature": 0}
    (item,) = run_openai(smol_openai, "/v1/messages", body)
    assert item["type"] == "message" and "Paris" in item["content"][0]["text"]


def test_messages_stream_answers_paris(smol_openai, run_openai):
    body = {"model": model_of(smol_openai), "messages": CAPITAL, "max_tokens": 30, "temperature": 0,
            "stream": True}
    events = sse_events.parse("".join(run_openai(smol_openai, "/v1/messages", body)))
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    text = "".join(json.loads(d)["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    assert "Paris" in text


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>{{ tools | tojson }}</tools>\n"
    "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_with_the_hermes_parser(smol_engine, run_openai):
    namespace = copy.copy(smol_engine.config.args.namespace)
    namespace.enable_auto_tool_choice, namespace.tool_call_parser = True, "hermes"
    namespace.chat_template = TOOL_TEMPLATE
    tools_engine = OpenAIvLLMEngine(smol_engine, namespace)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = {"model": model_of(tools_engine), "temperature": 0, "max_tokens": 40, "tools": [WEATHER_TOOL],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            # The 135M model cannot be relied on to choose the format: constrain it to a call,
            # so that what is tested is the parser path of the route.
            "structured_outputs": {"regex": call.replace("{", "\\{").replace("}", "\\}")}}
    (item,) = run_openai(tools_engine, "/v1/chat/completions", body)
    message = ChatCompletion.model_validate(item).choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}


# A TOOL_PARSER_PLUGIN: its parser answers one call of get_weather for Paris, whatever the model says.
FIXED_CALL_PLUGIN = """
from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.tool_parsers import ToolParser, ToolParserManager


@ToolParserManager.register_module("fixed-call")
class FixedCallParser(ToolParser):
    def extract_tool_calls(self, model_output, request):
        call = ToolCall(function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
        return ExtractedToolCallInformation(tools_called=True, tool_calls=[call], content=None)
"""


def test_a_tool_parser_plugin_is_loaded_and_its_parser_used(tiny_engine, tiny_env, run_openai, tmp_path):
    """TOOL_PARSER_PLUGIN, as `vllm serve --tool-parser-plugin`: a parser it registers can be named."""
    plugin = tmp_path / "fixed_call_plugin.py"
    plugin.write_text(FIXED_CALL_PLUGIN)
    config = load_config({**tiny_env, "TOOL_PARSER_PLUGIN": str(plugin), "TOOL_CALL_PARSER": "fixed-call",
                          "ENABLE_AUTO_TOOL_CHOICE": "true"})
    tools_engine = OpenAIvLLMEngine(tiny_engine, config.args.namespace)
    body = {"model": model_of(tools_engine), "max_tokens": 4, "tools": [WEATHER_TOOL],
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
    (item,) = run_openai(tools_engine, "/v1/chat/completions", body)
    calls = ChatCompletion.model_validate(item).choices[0].message.tool_calls
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})]


# --- routes and shapes (tiny model) ---------------------------------------------------------

def test_models_lists_the_served_name_and_lora_adapters(tiny_openai, run_openai):
    (item,) = run_openai(tiny_openai, "/v1/models")
    assert [m["id"] for m in item["data"]] == [model_of(tiny_openai), "tiny-lora"]
    assert item["data"][0]["owned_by"] == "vllm"


def test_served_model_name_override(tiny_engine, run_openai):
    settings = tiny_engine.settings.model_copy(update={"openai_served_model_name_override": "my-model"})
    engine = OpenAIvLLMEngine(tiny_engine, settings=settings)
    (models,) = run_openai(engine, "/v1/models")
    assert models["data"][0]["id"] == "my-model"
    body = {"model": "my-model", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    (item,) = run_openai(engine, "/v1/completions", body)
    assert item["model"] == "my-model" and item["usage"]["completion_tokens"] == 2


def test_lora_adapter_by_model_name_changes_the_output(tiny_openai, run_openai):
    def complete(model):
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        (item,) = run_openai(tiny_openai, "/v1/completions", body)
        return Completion.model_validate(item).choices[0].text

    base, adapted = complete(model_of(tiny_openai)), complete("tiny-lora")
    assert base and adapted and base != adapted


def test_completions_with_n_logprobs_stop_seed_and_extra_params(tiny_openai, run_openai):
    body = {"model": model_of(tiny_openai), "prompt": "Hello", "max_tokens": 6, "n": 2, "logprobs": 2,
            "seed": 3, "temperature": 1.0, "top_k": 5, "ignore_eos": True}
    (item,) = run_openai(tiny_openai, "/v1/completions", body)
    completion = Completion.model_validate(item)
    assert len(completion.choices) == 2 and completion.usage.completion_tokens == 12
    assert all(len(c.logprobs.tokens) == 6 for c in completion.choices)
    assert run_openai(tiny_openai, "/v1/completions", body)[0]["choices"] == item["choices"]


def test_structured_output_response_format(tiny_openai, run_openai):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    body = {"model": model_of(tiny_openai), "messages": [{"role": "user", "content": "a number"}],
            "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    (item,) = run_openai(tiny_openai, "/v1/chat/completions", body)
    content = item["choices"][0]["message"]["content"]
    if item["choices"][0]["finish_reason"] == "stop":  # a random model may run out of tokens
        assert isinstance(json.loads(content)["n"], int)
    else:
        assert content.startswith("{")


def test_responses_route(tiny_openai, run_openai):
    body = {"model": model_of(tiny_openai), "input": "Hello", "max_output_tokens": 8, "temperature": 0}
    (item,) = run_openai(tiny_openai, "/v1/responses", body)
    assert item["object"] == "response" and item["status"] in ("completed", "incomplete")
    events = sse_events.parse("".join(run_openai(tiny_openai, "/v1/responses", {**body, "stream": True})))
    names = [name for name, _ in events]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert all(json.loads(data)["type"] == name for name, data in events)


@pytest.mark.parametrize("route", ["/tokenize", "/v1/tokenize"])
def test_tokenize_and_detokenize(tiny_openai, run_openai, route):
    (tokens,) = run_openai(tiny_openai, route, {"model": model_of(tiny_openai), "prompt": "Hello world"})
    assert tokens["count"] == len(tokens["tokens"]) > 0
    detokenize = route.replace("tokenize", "detokenize")
    body = {"model": model_of(tiny_openai), "tokens": tokens["tokens"]}
    (text,) = run_openai(tiny_openai, detokenize, body)
    assert "Hello world" in text["prompt"]


# --- stream batching and output modes -------------------------------------------------------

def events_per_item(items: list[str]) -> list[int]:
    return [len(sse_events.parse(item)) for item in items]


def long_stream(engine, **extra):
    return {"model": model_of(engine), "prompt": "Once upon a time", "max_tokens": 40,
            "ignore_eos": True, "stream": True, **extra}


def schedule(size: BatchSize, total: int) -> list[int]:
    """Batch sizes for ``total`` events: the growth schedule, the last batch holding the rest."""
    sizes: list[int] = []
    while sum(sizes) < total:
        sizes.append(min(int(size.current_batch_size), total - sum(sizes)))
        size.update()
    return sizes


def assert_stream_schedule(items: list[str], size: BatchSize) -> None:
    sizes = events_per_item(items)
    # One event per engine output (40 tokens, fewer events when vLLM merged two steps) + [DONE].
    assert 30 <= sum(sizes) <= 41 and sse_events.parse(items[-1])[-1] == (None, "[DONE]")
    assert sizes == schedule(size, sum(sizes))


def test_stream_batches_follow_the_growth_schedule(tiny_openai, run_openai):
    items = run_openai(tiny_openai, "/v1/completions", long_stream(tiny_openai))
    assert_stream_schedule(items, BatchSize(50, 1, 3))  # 1, 3, 9, 27, then the rest


def test_stream_batches_follow_per_job_overrides(tiny_openai, run_openai):
    items = run_openai(tiny_openai, "/v1/completions", long_stream(tiny_openai),
                       max_batch_size=10, min_batch_size=2, batch_size_growth_factor=2)
    assert_stream_schedule(items, BatchSize(10, 2, 2))  # 2, 4, 8, 10, 10, ...


def test_raw_output_off_yields_lists_of_chunk_objects(tiny_engine, run_openai):
    settings = tiny_engine.settings.model_copy(update={"raw_openai_output": False})
    engine = OpenAIvLLMEngine(tiny_engine, settings=settings)
    body = {"model": model_of(engine), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    items = run_openai(engine, "/v1/chat/completions", body)
    assert all(isinstance(item, list) and all(isinstance(obj, dict) for obj in item) for item in items)
    assert [len(item) for item in items[:2]] == [2, 3]
    parsed = [ChatCompletionChunk.model_validate(obj) for item in items for obj in item]
    # The role chunk (which does not count), one chunk per engine output (12 tokens, fewer chunks
    # when vLLM merged two steps), the usage chunk; no [DONE] in this mode. A token's text may be
    # empty (a random model's byte token), so the outputs are told by shape, not by their text.
    role, *outputs, usage = parsed
    assert role.choices[0].delta.role == "assistant"
    assert len(outputs) <= 12 and all(len(c.choices) == 1 and c.choices[0].delta.role is None
                                      and isinstance(c.choices[0].delta.content, str) for c in outputs)
    assert [c.choices[0].finish_reason for c in outputs] == [None] * (len(outputs) - 1) + ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 12


FIRST_OUTPUT = {  # route → (body beyond model and stream, test for an event carrying output)
    # A token's text may be empty (a random model's byte token): these two routes still send its
    # event, so it is told by the token ids it carries (the role chunks carry none), not its text.
    "/v1/completions": ({"prompt": "x", "return_token_ids": True},
                        lambda name, data: json.loads(data)["choices"][0].get("token_ids")),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                              "return_token_ids": True},
                             lambda name, data: json.loads(data)["choices"][0].get("token_ids")),
    # No ignore_eos on this route (vLLM drops the field): greedy, so no early end of the text.
    "/v1/messages": ({"messages": [{"role": "user", "content": "Hi"}], "temperature": 0},
                     lambda name, data: name == "content_block_delta"),
    "/v1/responses": ({"input": "Hi"}, lambda name, data: name == "response.output_text.delta"),
}


@pytest.mark.parametrize("route", FIRST_OUTPUT)
def test_the_first_stream_batch_carries_the_first_token(tiny_openai, run_openai, route):
    """vLLM's preamble events (role chunks, message_start, response.created...) do not fill the
    first batch of MIN_BATCH_SIZE=1 on their own: it holds the first token, as on the raw path."""
    extra, carries_output = FIRST_OUTPUT[route]
    limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
    body = {"model": model_of(tiny_openai), "stream": True, limit: 40, **extra}
    if route != "/v1/messages":
        body["ignore_eos"] = True
    items = run_openai(tiny_openai, route, body)
    first = sse_events.parse(items[0])
    assert any(carries_output(name, data) for name, data in first), first
    assert len(items) > 3 and len(sse_events.parse(items[1])) == 3  # then the schedule: 3, 9, ...


def test_raw_output_on_is_vllms_sse_text(tiny_openai, run_openai):
    body = {"model": model_of(tiny_openai), "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5, "ignore_eos": True, "stream": True}
    items = run_openai(tiny_openai, "/v1/chat/completions", body)
    assert all(isinstance(item, str) and item.startswith("data: ") for item in items)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks(items)]
    assert parsed[0].choices[0].delta.role == "assistant"


# --- embeddings (all-MiniLM-L6-v2) ----------------------------------------------------------

@pytest.fixture(scope="module")
def offline_embeddings(models):
    from vllm import LLM

    llm = LLM(model=str(models["all-minilm-l6-v2"]), runner="pooling", dtype="float32",
              enforce_eager=True, kv_cache_memory_bytes=256 * 2**20)
    texts = ["The capital of France is Paris.", "A cat sat on the mat."]
    vectors = [o.outputs.embedding for o in llm.embed(texts)]
    llm.llm_engine.engine_core.shutdown()
    return texts, vectors


def test_embeddings_match_vllm_offline(minilm_openai, run_openai, offline_embeddings):
    texts, expected = offline_embeddings
    (item,) = run_openai(minilm_openai, "/v1/embeddings", {"model": model_of(minilm_openai), "input": texts})
    vectors = [d["embedding"] for d in item["data"]]
    assert [len(v) for v in vectors] == [384, 384]
    assert all(cosine(v, e) > 0.999 for v, e in zip(vectors, expected, strict=True))


def test_embeddings_on_a_generative_model_is_a_clear_error(tiny_openai, run_openai):
    (item,) = run_openai(tiny_openai, "/v1/embeddings", {"model": model_of(tiny_openai), "input": "x"})
    assert item["error"]["code"] == 404 and "not served for model" in item["error"]["message"]


def test_generation_on_a_pooling_model_is_a_clear_error(minilm_openai, run_openai):
    (item,) = run_openai(minilm_openai, "/v1/chat/completions", {"messages": CAPITAL})
    assert item["error"]["code"] == 404 and "/v1/embeddings" in item["error"]["message"]


# --- errors, then the worker keeps serving --------------------------------------------------

def assert_still_serving(engine, run_openai):
    body = {"model": model_of(engine), "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    (item,) = run_openai(engine, "/v1/completions", body)
    assert item["usage"]["completion_tokens"] == 2


def test_malformed_body_gives_vllms_validation_message(tiny_openai, run_openai):
    body = {"model": model_of(tiny_openai), "messages": "x"}
    (item,) = run_openai(tiny_openai, "/v1/chat/completions", body)
    assert item["error"]["code"] == 400 and item["error"]["param"] == "body.messages"
    assert "Input should be a valid list" in item["error"]["message"]
    assert json.loads(str(item["error"])) == item["error"]  # runpod reports str(error): JSON
    assert_still_serving(tiny_openai, run_openai)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(tiny_openai, run_openai, stream):
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    (item,) = run_openai(tiny_openai, "/v1/chat/completions", body)
    assert item["error"]["code"] == 404 and item["error"]["type"] == "NotFoundError"
    assert "no-such-model" in item["error"]["message"]
    assert_still_serving(tiny_openai, run_openai)


@pytest.mark.parametrize(("body", "kind"), [
    ({"messages": "bad", "max_tokens": 5}, "invalid_request_error"),
    ({"model": "no-such-model", "messages": CAPITAL, "max_tokens": 5}, "not_found_error"),
])
def test_anthropic_route_errors_are_anthropic_objects(tiny_openai, run_openai, body, kind):
    (item,) = run_openai(tiny_openai, "/v1/messages", {"model": model_of(tiny_openai), **body})
    assert item["type"] == "error" and item["error"]["type"] == kind
    assert item["error"]["message"] and item["error"]["message"] != "Unknown error"
    assert_still_serving(tiny_openai, run_openai)


def test_prompt_beyond_the_context_is_a_400(tiny_openai, run_openai):
    body = {"model": model_of(tiny_openai), "prompt": "word " * 3000, "max_tokens": 5, "stream": True}
    (item,) = run_openai(tiny_openai, "/v1/completions", body)
    assert item["error"]["code"] == 400 and "maximum context length" in item["error"]["message"]
    assert_still_serving(tiny_openai, run_openai)


def test_unknown_route_is_a_404_listing_the_routes(tiny_openai, run_openai):
    (item,) = run_openai(tiny_openai, "/v1/fine_tuning/jobs", {})
    assert item["error"]["code"] == 404 and "'/v1/fine_tuning/jobs'" in item["error"]["message"]
    assert "/v1/chat/completions" in item["error"]["message"]


# --- unseeded sampling, as a fresh `vllm serve` samples ------------------------------------------

# The body of a batch-route test of vLLM's own (test_batched_chat_completions.py), which sets no
# temperature or seed (nor max_tokens: 16 keeps this test short). One conversation: which draws
# two get depends on whether the engine schedules them in the same step.
UNSEEDED_BATCH = {"messages": [[{"role": "user", "content": "Reply with exactly the word: alpha"}]],
                  "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True,
                  "max_tokens": 16}


def as_started(engine) -> None:
    """The engine's sampler as start-up leaves it: vLLM's last start-up step on its workers
    (``compile_or_warm_up_model``) seeds it again with the configured seed (and, the KV cache being
    there, does nothing else)."""
    engine.loop.run(engine.llm.collective_rpc("compile_or_warm_up_model"))


def sampled_tokens(answer: dict) -> list[str]:
    (choice,) = answer["choices"]
    assert choice["finish_reason"] in ("stop", "length")
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert len(tokens) == answer["usage"]["completion_tokens"] > 0
    return tokens


def test_the_warm_up_leaves_the_seeded_sampler_as_vllm_serve_starts_with_it(tiny_openai, run_openai):
    """A fresh `vllm serve` answers unseeded requests with the draws of its freshly seeded sampler.
    A warm-up that drew from it made a fresh worker answer them otherwise (issue 29: where
    `vllm serve` answered vLLM's batch-route tests with a few words, the worker's answers ran to
    the end of the context, minutes on the CPU)."""
    body = {"model": tiny_openai.served_model_name, **UNSEEDED_BATCH}
    as_started(tiny_openai.engine)
    (fresh,) = run_openai(tiny_openai, "/v1/chat/completions/batch", body)
    as_started(tiny_openai.engine)
    tiny_openai.engine.warm_up().result()
    (warmed,) = run_openai(tiny_openai, "/v1/chat/completions/batch", body)
    assert sampled_tokens(warmed) == sampled_tokens(fresh)


def test_serving_state_exists_before_the_first_job_and_is_built_once(tiny_engine):
    engine = OpenAIvLLMEngine(tiny_engine)
    chat = engine.app.state.openai_serving_chat
    assert chat is not None

    async def collect_all():
        return await asyncio.gather(*(_items(engine, {"openai_route": "/v1/models"}) for _ in range(16)))

    results = asyncio.run(collect_all())
    assert all(r[0]["data"][0]["id"] == model_of(engine) for r in results)
    assert engine.app.state.openai_serving_chat is chat


async def _items(engine, job_input):
    return [item async for item in engine.generate(JobInput.from_job({"input": job_input}))]

