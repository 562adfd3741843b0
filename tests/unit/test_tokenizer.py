"""TokenizerWrapper on real tokenizers: vLLM's MistralTokenizer (mistral_common's packaged test
tokenizer files, offline) and the tiny Llama's Hugging Face tokenizer. No engine."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import mistral_common
import pytest
from mistral_common.protocol.instruct.chunk import TextChunk
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as MistralCommonTokenizer

from worker.engine.vllm_engine import _INLINE_TOKENIZE_CHARS, vLLMEngine
from worker.wire.errors import RequestError
from worker.jobs.job_input import JobInput
from worker.engine.tokenizer import MISTRAL_IGNORES_TEMPLATE, NO_TEMPLATE, TokenizerWrapper, prompt_chars

DATA = Path(mistral_common.__file__).parent / "data"
# (packaged file, name in a model repository): a Tekken v3 (Nemo-style) and a SentencePiece v7
# tokenizer, whose v7 encodes system prompts with their own control tokens.
MISTRAL_FILES = {"tekken": ("tekken_240911.json", "tekken.json"),
                 "spm-v7": ("mistral_instruct_tokenizer_241114.model.v7", "tokenizer.model.v7")}

USER = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is the capital of France?"},
]
TEXT_PARTS = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                           {"type": "text", "text": "of France?"}]}]
CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"


def _repo(root: Path, kind: str) -> Path:
    """A Mistral-format model folder holding only the tokenizer file (and, so that vLLM's
    tokenizer mode "auto" takes it for a Mistral repository, an empty consolidated weights file)."""
    packaged, name = MISTRAL_FILES[kind]
    repo = root / kind
    repo.mkdir()
    shutil.copy(DATA / packaged, repo / name)
    (repo / "consolidated.safetensors").touch()
    return repo


@pytest.fixture(scope="module", params=list(MISTRAL_FILES))
def mistral(request, tmp_path_factory):
    """(vLLM's MistralTokenizer as the engine loads it, mistral_common's own tokenizer)."""
    from vllm.tokenizers import get_tokenizer  # as the engine does: tokenizer mode "auto"

    repo = _repo(tmp_path_factory.mktemp("mistral"), request.param)
    tokenizer = get_tokenizer(str(repo), tokenizer_mode="auto")
    reference = MistralCommonTokenizer.from_file(str(repo / MISTRAL_FILES[request.param][1]))
    return tokenizer, reference


def expected_ids(reference: MistralCommonTokenizer, messages: list) -> list[int]:
    """mistral_common's own chat encoding, from its own message classes."""
    classes = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}

    def content(value):
        return value if isinstance(value, str) else [TextChunk(text=p["text"]) for p in value]

    request = ChatCompletionRequest(messages=[classes[m["role"]](content=content(m["content"]))
                                              for m in messages])
    return reference.encode_chat_completion(request).tokens


def prompt_tokens(wrapper: TokenizerWrapper, payload: dict) -> list[int]:
    """The raw job path's prompt ids (vLLMEngine._prompt_tokens) with this tokenizer."""
    job = JobInput.from_job({"id": "job", "input": payload})
    return asyncio.run(vLLMEngine._prompt_tokens(SimpleNamespace(tokenizer=wrapper), job))


# --- Mistral tokenizers ------------------------------------------------------------------------

def test_auto_mode_loads_the_mistral_tokenizer_which_has_no_jinja_template(mistral):
    tokenizer, _ = mistral
    assert type(tokenizer).__name__ == "MistralTokenizer" and tokenizer.IS_MISTRAL_TOKENIZER
    assert getattr(tokenizer, "chat_template", None) is None  # what used to refuse every chat
    assert TokenizerWrapper(tokenizer).has_chat_template


@pytest.mark.parametrize("messages", [USER, CONVERSATION], ids=["user", "system-user-assistant-user"])
def test_mistral_prompt_ids_are_mistral_commons_chat_encoding(mistral, messages):
    tokenizer, reference = mistral
    wrapper = TokenizerWrapper(tokenizer)
    expected = expected_ids(reference, messages)
    assert wrapper.chat_prompt_ids(messages) == expected
    assert prompt_tokens(wrapper, {"messages": messages}) == expected
    # Rendering to text and re-encoding it would not give these ids (control tokens as text).
    text = wrapper.apply_chat_template(messages)
    assert text.startswith("<s>") and text.endswith("[/INST]")
    assert wrapper.encode(text, add_special_tokens=False) != expected


def test_mistral_string_prompt_with_apply_chat_template_is_one_user_message(mistral):
    tokenizer, reference = mistral
    wrapper = TokenizerWrapper(tokenizer)
    expected = expected_ids(reference, USER)
    prompt = USER[0]["content"]
    assert wrapper.chat_prompt_ids(prompt) == expected
    assert prompt_tokens(wrapper, {"prompt": prompt, "apply_chat_template": True}) == expected
    assert wrapper.apply_chat_template(prompt) == tokenizer.decode(expected)
    # Without apply_chat_template a string prompt is plain text after BOS.
    assert prompt_tokens(wrapper, {"prompt": prompt}) == tokenizer.encode(prompt)
    assert prompt_tokens(wrapper, {"prompt": prompt})[0] == tokenizer.bos_token_id


def test_mistral_text_parts_and_long_chats(mistral):
    tokenizer, reference = mistral
    wrapper = TokenizerWrapper(tokenizer)
    assert wrapper.chat_prompt_ids(TEXT_PARTS) == expected_ids(reference, TEXT_PARTS)
    long = [{"role": "user", "content": "word " * 1000}]
    assert prompt_chars(long) >= _INLINE_TOKENIZE_CHARS  # encoded in a thread
    assert prompt_tokens(wrapper, {"messages": long}) == expected_ids(reference, long)


def test_custom_chat_template_is_ignored_for_mistral_tokenizers_as_vllm_does(mistral, caplog):
    tokenizer, reference = mistral
    with caplog.at_level(logging.WARNING, logger="worker.engine.tokenizer"):
        wrapper = TokenizerWrapper(tokenizer, CUSTOM_TEMPLATE)
    assert MISTRAL_IGNORES_TEMPLATE in caplog.text
    assert wrapper.custom_chat_template is None
    assert wrapper.chat_prompt_ids(CONVERSATION) == expected_ids(reference, CONVERSATION)
    # vLLM itself: its MistralTokenizer drops a chat_template argument.
    assert tokenizer.apply_chat_template(USER, chat_template=CUSTOM_TEMPLATE,
                                         add_generation_prompt=True) == expected_ids(reference, USER)


BAD_MESSAGES = {
    "empty": [],
    "no-content": [{"role": "user"}],
    "no-role": [{"content": "x"}],
    "unknown-role": [{"role": "bogus", "content": "x"}],
    "content-not-text": [{"role": "user", "content": 5}],
    "ends-with-assistant": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    # mistral_common would fetch the URL itself: refused before it sees it.
    "image-part": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}],
    "odd-part": [{"role": "user", "content": ["x"]}],
}


@pytest.mark.parametrize("messages", BAD_MESSAGES.values(), ids=BAD_MESSAGES)
def test_mistral_invalid_messages_are_request_errors(mistral, messages):
    wrapper = TokenizerWrapper(mistral[0])
    for call in (wrapper.chat_prompt_ids, wrapper.apply_chat_template,
                 lambda m: prompt_tokens(wrapper, {"messages": m})):
        with pytest.raises(RequestError) as raised:
            call(messages)
        assert raised.value.param == "messages" and str(raised.value)


# --- Hugging Face tokenizers: unchanged ---------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(models["tiny-llama"]))


def test_hf_chat_is_rendered_by_the_template_then_encoded_without_special_tokens(hf_tokenizer):
    wrapper = TokenizerWrapper(hf_tokenizer)
    assert not wrapper.is_mistral and wrapper.has_chat_template
    for messages in (USER, CONVERSATION):
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert wrapper.apply_chat_template(messages) == text
        assert text.endswith("<|im_start|>assistant\n")
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert wrapper.chat_prompt_ids(messages) == ids
        assert prompt_tokens(wrapper, {"messages": messages}) == ids
    assert wrapper.apply_chat_template("hi") == wrapper.apply_chat_template(
        [{"role": "user", "content": "hi"}])
    assert prompt_tokens(wrapper, {"prompt": "hi", "apply_chat_template": True}) \
        == wrapper.chat_prompt_ids("hi")
    assert prompt_tokens(wrapper, {"prompt": "hi"}) == hf_tokenizer.encode("hi")
    long = "word " * 1000
    assert prompt_tokens(wrapper, {"prompt": long}) == hf_tokenizer.encode(long)
    assert prompt_tokens(wrapper, {"messages": [{"role": "user", "content": long}]}) \
        == wrapper.chat_prompt_ids(long)


def test_hf_custom_template_missing_template_and_bad_messages(hf_tokenizer):
    custom = TokenizerWrapper(hf_tokenizer, CUSTOM_TEMPLATE)
    assert custom.apply_chat_template(USER) == f"[user:{USER[0]['content']}]"
    assert custom.chat_prompt_ids(USER) == hf_tokenizer.encode(f"[user:{USER[0]['content']}]",
                                                              add_special_tokens=False)
    bare = SimpleNamespace(chat_template=None)
    for call in (TokenizerWrapper(bare).apply_chat_template, TokenizerWrapper(bare).chat_prompt_ids):
        with pytest.raises(RequestError, match="Chat template does not exist") as raised:
            call(USER)
        assert str(raised.value) == NO_TEMPLATE and raised.value.param == "messages"
    for messages in ([{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": 5}]):
        with pytest.raises(RequestError) as raised:
            TokenizerWrapper(hf_tokenizer).chat_prompt_ids(messages)
        assert raised.value.param == "messages"
