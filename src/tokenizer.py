"""``TokenizerWrapper``: the engine's tokenizer plus the chat template of the raw path."""

from __future__ import annotations

from typing import Any

import jinja2

from errors import RequestError

__all__ = ["TokenizerWrapper"]

NO_TEMPLATE = ("Chat template does not exist for this model, you must provide a single string "
               "input instead of a list of messages")


class TokenizerWrapper:
    """Renders chat messages with ``CUSTOM_CHAT_TEMPLATE`` or the tokenizer's own template."""

    def __init__(self, tokenizer: Any, custom_chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.custom_chat_template = custom_chat_template
        self.has_chat_template = bool(custom_chat_template
                                      or getattr(tokenizer, "chat_template", None))

    def apply_chat_template(self, llm_input: str | list[dict[str, Any]]) -> str:
        messages = [{"role": "user", "content": llm_input}] if isinstance(llm_input, str) else llm_input
        if not self.has_chat_template:
            raise RequestError(NO_TEMPLATE, param="messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.custom_chat_template, tokenize=False,
                add_generation_prompt=True)
        except (jinja2.TemplateError, KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"messages: the chat template cannot render them: {exc}",
                               param="messages") from None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
