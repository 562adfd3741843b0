"""``TokenizerWrapper``: the engine's tokenizer plus the chat encoding of the raw path.

Two kinds of tokenizer reach it:

* Hugging Face tokenizers render the messages to text with a Jinja chat template
  (``CUSTOM_CHAT_TEMPLATE``, else the tokenizer's own); the text is then encoded without special
  tokens, since the template already placed BOS and friends.
* vLLM's ``MistralTokenizer`` (repositories shipping ``tekken.json`` or ``tokenizer.model.v*``,
  picked by tokenizer mode "auto" or "mistral") has no Jinja template: mistral_common encodes the
  conversation straight to token ids. Its text rendering does not survive re-encoding (``[INST]``
  and the other control tokens would come back as plain text), so the prompt ids come from its
  own chat encoding. As in vLLM, whose ``MistralTokenizer.apply_chat_template`` drops the
  ``chat_template`` argument, ``CUSTOM_CHAT_TEMPLATE`` is ignored for it (with a warning).
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2

from worker.wire.errors import RequestError

__all__ = ["TokenizerWrapper", "prompt_chars"]

log = logging.getLogger(__name__)

NO_TEMPLATE = ("Chat template does not exist for this model, you must provide a single string "
               "input instead of a list of messages")
MISTRAL_IGNORES_TEMPLATE = ("CUSTOM_CHAT_TEMPLATE is ignored: this model uses a Mistral tokenizer, "
                            "which encodes chats with mistral_common, not a Jinja template "
                            "(as vLLM does)")


def _is_mistral(tokenizer: Any) -> bool:
    # vLLM's own marker on its MistralTokenizer class (what vllm.utils.mistral checks first).
    return bool(getattr(type(tokenizer), "IS_MISTRAL_TOKENIZER", False))


def _as_messages(llm_input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": llm_input}] if isinstance(llm_input, str) else llm_input


def prompt_chars(llm_input: str | list[dict[str, Any]]) -> int:
    """About how many characters a prompt or chat holds (to decide whether to tokenize inline)."""
    if isinstance(llm_input, str):
        return len(llm_input)
    total = 0
    for message in llm_input:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def _check_text_only(messages: list[dict[str, Any]]) -> None:
    """The raw path carries no media: mistral_common would fetch image URLs itself."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise RequestError(
                    f"messages[{i}].content: only text parts are accepted on the raw path, got "
                    f"{kind!r}; send images through the OpenAI route", param="messages")


class TokenizerWrapper:
    """Encodes chat messages with the tokenizer's chat template (or ``CUSTOM_CHAT_TEMPLATE``),
    or, for a Mistral tokenizer, with mistral_common's chat encoding."""

    def __init__(self, tokenizer: Any, custom_chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.is_mistral = _is_mistral(tokenizer)
        if self.is_mistral and custom_chat_template:
            log.warning(MISTRAL_IGNORES_TEMPLATE)
            custom_chat_template = None
        self.custom_chat_template = custom_chat_template
        self.has_chat_template = self.is_mistral or bool(
            custom_chat_template or getattr(tokenizer, "chat_template", None))

    def chat_prompt_ids(self, llm_input: str | list[dict[str, Any]]) -> list[int]:
        """The prompt token ids of a chat (a string is one user message), generation prompt
        included. Raises RequestError (param "messages") for messages that cannot be encoded."""
        if self.is_mistral:
            return self._mistral_ids(_as_messages(llm_input))
        return self.encode(self.apply_chat_template(llm_input), add_special_tokens=False)

    def apply_chat_template(self, llm_input: str | list[dict[str, Any]]) -> str:
        """The chat as text. For a Mistral tokenizer this is the decoded prompt, special tokens
        shown, for reading only: its ids come from ``chat_prompt_ids``, not from encoding it."""
        if self.is_mistral:
            return self.tokenizer.decode(self.chat_prompt_ids(llm_input))
        if not self.has_chat_template:
            raise RequestError(NO_TEMPLATE, param="messages")
        try:
            return self.tokenizer.apply_chat_template(
                _as_messages(llm_input), chat_template=self.custom_chat_template, tokenize=False,
                add_generation_prompt=True)
        except (jinja2.TemplateError, LookupError, AttributeError, TypeError, ValueError) as exc:
            raise RequestError(f"messages: the chat template cannot render them: {exc}",
                               param="messages") from None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _mistral_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        _check_text_only(messages)
        try:
            # add_generation_prompt only validates (a last assistant message is refused, as on
            # vLLM's chat route): a Mistral prompt always ends ready for the answer.
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - as vLLM's safe_apply_chat_template for Mistral:
            # mistral_common rejects input with asserts, KeyErrors, pydantic and its own errors.
            raise RequestError(f"messages: the Mistral tokenizer cannot encode them: {exc}",
                               param="messages") from None
        return list(ids)
