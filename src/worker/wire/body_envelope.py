"""A non-JSON HTTP answer carried faithfully in a job's JSON output.

A job's output is JSON, but some of vLLM's answers are not: ``/v1/embeddings`` with
``encoding_format: "bytes"`` answers raw little-endian floats with their layout in a ``metadata``
header; a speech route may answer plain text. Such an answer becomes one item::

    {"http_response": {"status": 200, "content_type": "application/octet-stream",
                       "headers": {"metadata": "..."}, "body_base64": "..."}}

(``"body"`` with the text instead of ``"body_base64"`` for a UTF-8 text type). A client decodes it
back; the local endpoint answers it as the HTTP response vLLM would have sent. Headers about the
transfer itself (length, encoding, connection, date, server) are not carried: they describe one
HTTP message, not the answer. Pure: no vLLM here.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KEY", "Envelope", "is_json"]

KEY = "http_response"

_TRANSFER = frozenset({"content-length", "transfer-encoding", "connection", "date", "server",
                       "content-type", "keep-alive"})


def _media_type(content_type: str) -> str:
    """``text/plain`` of ``text/plain; charset=utf-8``."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    """Whether a content type is JSON (``application/json``, ``application/problem+json``, ...)."""
    kind = _media_type(content_type)
    return kind == "application/json" or kind.endswith("+json")


def _is_text(content_type: str) -> bool:
    kind = _media_type(content_type)
    return kind.startswith("text/") and kind != "text/event-stream"


@dataclass(frozen=True)
class Envelope:
    status: int
    content_type: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)  # the ones that carry meaning

    @classmethod
    def of(cls, status: int, headers: Mapping[str, str], body: bytes) -> Envelope:
        """From an HTTP answer (header names in lower case, as the ASGI client gives them)."""
        kept = {name: value for name, value in headers.items() if name.lower() not in _TRANSFER}
        return cls(status, headers.get("content-type", "application/octet-stream"), body, kept)

    def output(self) -> dict[str, Any]:
        """The job's output item."""
        answer: dict[str, Any] = {"status": self.status, "content_type": self.content_type,
                                  "headers": dict(self.headers)}
        if (text := self._text()) is not None:
            answer["body"] = text
        else:
            answer["body_base64"] = base64.b64encode(self.body).decode()
        return {KEY: answer}

    def _text(self) -> str | None:
        if not _is_text(self.content_type):
            return None
        try:
            return self.body.decode()
        except UnicodeDecodeError:
            return None

    @classmethod
    def from_output(cls, output: Any) -> Envelope | None:
        """The answer an output item carries, or None when the item is ordinary JSON."""
        if not (isinstance(output, dict) and len(output) == 1 and isinstance(output.get(KEY), dict)):
            return None
        answer = output[KEY]
        if "body_base64" in answer:
            body = base64.b64decode(answer["body_base64"])
        else:
            body = str(answer.get("body", "")).encode()
        return cls(int(answer.get("status", 200)), str(answer.get("content_type", "")), body,
                   dict(answer.get("headers") or {}))
