"""worker-vllm behaviours users rely on, on the real engine: VLLM_API_KEY does not lock the
in-process routes, a message list under ``prompt`` is chat, request logs keep prompts out, the
speculative variables make a configuration vLLM accepts (or a configuration error), and errors the
handler makes on ``/v1/messages`` are Anthropic's."""

from __future__ import annotations

import contextlib
import logging

import pytest
from conftest import engine_env

from worker.config.engine_args import resolve_args
from worker.wire.errors import ConfigError
from worker.routes.serving import OpenAIvLLMEngine

CAPITAL = "What is the capital of France?"
SECRET = "zebra-violet-7731"


def test_vllm_api_key_in_the_environment_does_not_lock_the_routes(tiny_engine, run_openai, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-not-for-jobs")
    served = OpenAIvLLMEngine(tiny_engine)
    (models,) = run_openai(served, "/v1/models")
    assert models["data"][0]["id"] == served.served_model_name
    (chat,) = run_openai(served, "/v1/chat/completions", {
        "model": served.served_model_name, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3, "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 3


def test_a_message_list_under_prompt_is_chat(smol_engine, run_job):
    sampling = {"temperature": 0, "max_tokens": 30}
    messages = [{"role": "user", "content": CAPITAL}]
    (as_prompt,) = run_job(smol_engine, {"prompt": messages, "sampling_params": sampling})
    (as_messages,) = run_job(smol_engine, {"messages": messages, "sampling_params": sampling})
    assert "Paris" in as_prompt["choices"][0]["tokens"][0] and as_prompt == as_messages


@contextlib.contextmanager
def vllm_log(level: int = logging.DEBUG):
    """Everything vLLM's loggers write meanwhile (vLLM's root logger does not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    vllm = logging.getLogger("vllm")
    saved = vllm.level
    vllm.addHandler(handler)
    vllm.setLevel(level)
    try:
        yield records
    finally:
        vllm.removeHandler(handler)
        vllm.setLevel(saved)


@pytest.mark.parametrize("legacy", [{"DISABLE_LOG_REQUESTS": "false"}, {"ENABLE_LOG_REQUESTS": "true"}])
def test_request_logs_keep_prompts_and_outputs_out_unless_max_log_len_is_set(
        tiny_engine, tiny_env, run_openai, legacy):
    namespace = resolve_args({**tiny_env, **legacy, "ENABLE_LOG_OUTPUTS": "true"}).namespace
    served = OpenAIvLLMEngine(tiny_engine, namespace)
    body = {"model": served.served_model_name, "messages": [{"role": "user", "content": SECRET}],
            "max_tokens": 4, "ignore_eos": True}
    with vllm_log() as records:  # DEBUG: vLLM logs whole prompts there when max_log_len is None
        (chat,) = run_openai(served, "/v1/chat/completions", body)
    logged = "\n".join(record.getMessage() for record in records)
    assert "Received request" in logged and "Generated response" in logged  # logging is on
    assert SECRET not in logged and chat["choices"][0]["message"]["content"] not in logged


def test_max_log_len_opts_in_to_prompt_logging(tiny_engine, tiny_env, run_openai):
    namespace = resolve_args({**tiny_env, "ENABLE_LOG_REQUESTS": "true", "MAX_LOG_LEN": "4096"}).namespace
    served = OpenAIvLLMEngine(tiny_engine, namespace)
    body = {"model": served.served_model_name, "messages": [{"role": "user", "content": SECRET}],
            "max_tokens": 2}
    with vllm_log() as records:
        run_openai(served, "/v1/chat/completions", body)
    assert SECRET in "\n".join(record.getMessage() for record in records)


# --- speculative decoding: vLLM's own engine configuration -------------------------------------

def test_ngram_variables_make_a_configuration_vllm_accepts(models):
    resolved = resolve_args(engine_env(models["tiny-llama"], NGRAM_PROMPT_LOOKUP_MAX="4",
                                       NGRAM_PROMPT_LOOKUP_MIN="0", NUM_SPECULATIVE_TOKENS="3"))
    speculative = resolved.engine_config().speculative_config
    assert (speculative.method, speculative.num_speculative_tokens) == ("ngram", 3)
    assert speculative.prompt_lookup_max == 4


@pytest.mark.parametrize(("env", "named"), [
    ({"NGRAM_PROMPT_LOOKUP_MAX": "2", "NGRAM_PROMPT_LOOKUP_MIN": "5", "NUM_SPECULATIVE_TOKENS": "3"},
     "env NUM_SPECULATIVE_TOKENS, NGRAM_PROMPT_LOOKUP_MAX, NGRAM_PROMPT_LOOKUP_MIN"),
    ({"SPECULATIVE_CONFIG": '{"num_speculative_tokens": 3}'}, "env SPECULATIVE_CONFIG"),
])
def test_speculative_combinations_vllm_rejects_are_configuration_errors(models, env, named):
    resolved = resolve_args(engine_env(models["tiny-llama"], **env))
    with pytest.raises(ConfigError) as raised:
        resolved.engine_config()
    assert f"{named}: " in str(raised.value) and "validation error" not in str(raised.value)
    assert resolved.engine_args.speculative_config == resolve_args(
        engine_env(models["tiny-llama"], **env)).engine_args.speculative_config  # not mutated


# --- errors the handler makes, in the route's dialect -------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_timed_out_messages_job_gets_anthropics_timeout_error(tiny_openai, run_openai, stream):
    # Greedy: the tiny model does not stop before 1,900 tokens (seconds, against a 0.3 s limit).
    body = {"model": tiny_openai.served_model_name, "max_tokens": 1900, "temperature": 0,
            "stream": stream, "messages": [{"role": "user", "content": "Tell me a long story."}]}
    items = run_openai(tiny_openai, "/v1/messages", body, timeout=0.3)
    error = items[-1]
    assert error["type"] == "error" and error["error"]["type"] == "timeout_error"
    assert "timeout of 0.3 s" in error["error"]["message"] and set(error["error"]) == {"type", "message"}


def test_the_tiny_model_writes_a_long_story_greedily(tiny_openai, run_openai):
    """The premise of the timeout test above."""
    body = {"model": tiny_openai.served_model_name, "max_tokens": 1900, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    (message,) = run_openai(tiny_openai, "/v1/messages", body)
    assert message["usage"]["output_tokens"] == 1900
