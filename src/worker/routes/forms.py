"""Form uploads carried by JSON jobs.

vLLM's speech-to-text routes (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take a
multipart form: the audio file and the request's fields. A job is JSON, so it carries the form as
an object whose ``file`` is the file base64-encoded, or a ``data:`` URL as vLLM's batch runner
takes it (``file_url`` is accepted too); ``filename`` optionally names it; every other key is a
form field (lists repeat the field, booleans are ``true``/``false``, objects are JSON)::

    {"file": "UklGRi...", "filename": "speech.wav", "model": "...", "language": "en"}

``form_body`` turns that into the multipart body the route expects, built in-process.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from urllib3 import encode_multipart_formdata

from worker.wire.errors import RequestError

__all__ = ["form_body"]

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[^,]*)?;base64,(?P<data>.*)", re.S)


def _file(fields: dict[str, Any]) -> tuple[str, bytes, str]:
    """(filename, bytes, content type) of the upload."""
    key = "file_url" if "file_url" in fields and "file" not in fields else "file"
    given = fields.get(key)
    if not isinstance(given, str) or not given:
        raise RequestError("the form needs 'file': the file's bytes base64-encoded, or a data: URL",
                           param=key)
    mime = "application/octet-stream"
    if match := _DATA_URL.fullmatch(given.strip()):
        given, mime = match["data"], match["mime"] or mime
    elif given.startswith(("http://", "https://", "data:")):
        raise RequestError(f"'{key}' must carry the file itself (base64, or a base64 data: URL), "
                           "not a link", param=key)
    try:
        data = base64.b64decode(given, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"'{key}' is not valid base64: {exc}", param=key) from None
    return str(fields.get("filename") or "file"), data, mime


def _field_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else json.dumps(value)


def form_body(fields: Any) -> tuple[bytes, str]:
    """The multipart body and its content type for a form given as a JSON object."""
    if not isinstance(fields, dict):
        raise RequestError("the form must be a JSON object", param="openai_input")
    parts: list[tuple[str, Any]] = [("file", _file(fields))]
    for name, value in fields.items():
        if name in ("file", "file_url", "filename") or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            parts.append((name, _field_text(item)))
    return encode_multipart_formdata(parts)
