"""Request-supplied chat templates are refused unless TRUST_REQUEST_CHAT_TEMPLATE is set, and
even then never read a file; LoRA adapters come only from the configured LORA_MODULES."""

from __future__ import annotations

import copy

import pytest

from worker.routes.serving import OpenAIvLLMEngine

MESSAGES = [{"role": "user", "content": "Hi"}]
REFUSED = "--trust-request-chat-template is not set"


@pytest.fixture(scope="module")
def trusting_openai(tiny_engine):
    """The tiny engine's routes with TRUST_REQUEST_CHAT_TEMPLATE on."""
    namespace = copy.copy(tiny_engine.config.args.namespace)
    namespace.trust_request_chat_template = True
    return OpenAIvLLMEngine(tiny_engine, namespace)


@pytest.mark.parametrize(("route", "extra"), [
    ("/v1/chat/completions", {"chat_template": "{{ messages }}", "max_tokens": 2}),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "x"}, "max_tokens": 2}),
    ("/tokenize", {"chat_template": "{{ messages }}"}),
])
def test_a_request_template_is_refused_by_default(tiny_openai, run_openai, route, extra):
    body = {"model": tiny_openai.served_model_name, "messages": MESSAGES, **extra}
    (item,) = run_openai(tiny_openai, route, body)
    assert item["error"]["code"] == 400 and REFUSED in item["error"]["message"]


def test_a_trusted_request_template_is_text_never_a_file_to_read(trusting_openai, run_openai, tmp_path):
    secret = tmp_path / "template.jinja"
    secret.write_text("SECRET FILE CONTENT")
    body = {"model": trusting_openai.served_model_name, "messages": MESSAGES,
            "chat_template": str(secret), "add_generation_prompt": False}
    (tokens,) = run_openai(trusting_openai, "/tokenize", body)
    (text,) = run_openai(trusting_openai, "/detokenize", {"model": body["model"], "tokens": tokens["tokens"]})
    assert "SECRET" not in text["prompt"] and "template.jinja" in text["prompt"]


def test_requests_cannot_load_a_lora_adapter_from_a_path(tiny_openai, run_openai, tiny_lora):
    body = {"model": str(tiny_lora), "prompt": "x", "max_tokens": 2}
    (item,) = run_openai(tiny_openai, "/v1/completions", body)
    assert item["error"]["code"] == 404 and "does not exist" in item["error"]["message"]
    load = {"lora_name": "x", "lora_path": str(tiny_lora)}
    (item,) = run_openai(tiny_openai, "/v1/load_lora_adapter", load)
    assert item["error"]["code"] == 404 and item["error"]["param"] == "openai_route"


def test_raw_jobs_refuse_a_template_in_the_job(tiny_engine, run_job):
    """Raw jobs render messages only with the configured template: a job's own is refused, at the
    input's top level (a request field out of place) as in ``sampling_params``, and never used."""
    job = {"messages": MESSAGES, "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
    (plain,) = run_job(tiny_engine, job)
    assert plain["usage"]["input"] > 0
    template = "{{ 'x' * 500 }}"
    for with_template, where in (({**job, "chat_template": template}, "chat_template"),
                                 ({**job, "sampling_params": {**job["sampling_params"], "chat_template": template}},
                                  "sampling_params.chat_template")):
        (refused,) = run_job(tiny_engine, with_template)
        assert (refused["error"]["code"], refused["error"]["param"]) == (400, where)
