"""Text fit to leave the worker: a URL's credentials masked in every log line and answer, and local
paths kept to the log.

A Hugging Face mirror is often given as ``HF_ENDPOINT=https://user:password@mirror``, and that URL
reaches text in many ways: the worker's own messages, huggingface_hub's errors, an exception's
traceback, vLLM's engine processes logging why they failed. ``mask_urls`` is the one rule, and it is
applied where all of them pass: each log record as it is made (``mask_log_records``, the message and
its traceback, in this process and in the processes it forks), and what the process writes to its
standard streams (``mask_streams``: a child's traceback that ``multiprocessing`` prints itself). An
answer to a caller goes through ``answer_text``, which also shows a local path as ``<path>``: the
log has it. vLLM's errors at run time go through ``served_text``, which shows as ``<path>`` only the
paths that are this machine's (their first folder exists here) but for the served models' names: a
route such as ``/v1/models`` in vLLM's text is kept, and so is a model served as its folder's path.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import TextIO

__all__ = ["PATH_SHOWN", "answer_text", "mask_log_records", "mask_streams", "mask_urls", "served_text",
           "show_as_is"]

MASK = "***"
PATH_SHOWN = "<path>"  # a local path, in an answer
# scheme://userinfo@: the userinfo runs to the authority's last "@" (a password may hold one unencoded).
_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#]*@")
# An absolute (or ~, ./, ../) path of one or more segments, not a URL's path (after its host) nor a
# repo id's (org/name): the character before it may be none of those.
_SEGMENT = r"[^\s'\"`,;:()<>\[\]{}/]*[^\s'\"`,;:()<>\[\]{}/.]"  # not ending in ".": a sentence's
_PATH = re.compile(rf"(?<![\w/.:~@*-])(?:~|\.\.?)?(?:/{_SEGMENT})+/?")


def mask_urls(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@host``) shown as
    ``***``: ``scheme://***@host``."""
    if "@" not in text or "://" not in text:
        return text
    return _CREDENTIALS.sub(rf"\1{MASK}@", text)


def answer_text(text: str) -> str:
    """``text`` as a caller may see it: URL credentials masked, local paths shown as ``<path>``."""
    return _PATH.sub(PATH_SHOWN, mask_urls(text))


_AS_IS: set[str] = set()  # the served models' names: a folder's path when no other name is given


def show_as_is(names) -> None:
    """Keeps ``names`` in ``served_text``: the names a model is served as (``/v1/models`` lists them,
    vLLM's "Valid aliases" name them), a folder's path when the model is served from one."""
    _AS_IS.update(name.rstrip("/") for name in names if name)


def _shown_unless_local(match: re.Match) -> str:
    path = match.group(0)
    top = path.split("/")[1] if path.startswith("/") else ""
    local = top and os.path.isdir("/" + top) and path.rstrip("/") not in _AS_IS
    return PATH_SHOWN if local else path


def served_text(text: str) -> str:
    """vLLM's error ``text`` as a caller may see it: URL credentials masked, and each absolute path
    whose first folder exists on this machine shown as ``<path>`` (vLLM quotes its flags' folders,
    ``--allowed-local-media-path /models``, and files it failed to read)."""
    return _PATH.sub(_shown_unless_local, mask_urls(text))


def _masked(record: logging.LogRecord) -> logging.LogRecord:
    """The record with its message's and its traceback's URL credentials masked (the traceback is
    formatted now, as a formatter would, only when it needs masking)."""
    try:
        message = record.getMessage()
        if (masked := mask_urls(message)) != message:
            record.msg, record.args = masked, ()
        if record.exc_info and not record.exc_text:
            trace = logging.Formatter().formatException(record.exc_info)
            if (masked := mask_urls(trace)) != trace:
                record.exc_text = masked
    except Exception:  # noqa: BLE001, S110 - a record that cannot format: logging reports it, not this
        pass
    return record


def mask_log_records() -> None:
    """Masks URL credentials in every log record this process makes from now on, whatever logger and
    handler: through the record factory, which vLLM's logging configuration (applied again in each
    engine process) leaves in place, and which a forked process inherits."""
    make_record = logging.getLogRecordFactory()
    if getattr(make_record, "masks_urls", False):
        return

    def masking(*args, **kwargs) -> logging.LogRecord:
        return _masked(make_record(*args, **kwargs))

    masking.masks_urls = True
    logging.setLogRecordFactory(masking)


class _MaskingStream:
    """A text stream that masks URL credentials in what is written to it (whole lines, in practice:
    print and traceback write a line or more at once)."""

    masks_urls = True

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(mask_urls(text) if isinstance(text, str) else text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def mask_streams() -> None:
    """Masks URL credentials in what this process (and a process it forks) writes to ``sys.stdout``
    and ``sys.stderr`` from Python: ``multiprocessing`` prints a failed child's traceback there, not
    through logging."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "masks_urls", False):
            setattr(sys, name, _MaskingStream(stream))
