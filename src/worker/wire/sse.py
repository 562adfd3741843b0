"""Server-sent events (``text/event-stream``) as vLLM's server writes them: events that each end in
a blank line, made of ``event:`` and ``data:`` lines, the stream ending with ``data: [DONE]`` on
OpenAI's routes. The worker reads vLLM's events and re-frames parsed ones, and the local endpoint
writes them, through here. Plain: no vLLM.
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any

import msgspec

__all__ = ["DONE", "EventSplitter", "data_json", "event_ends", "frame"]

EVENT_END = "\n\n"  # the blank line that ends an event
_EVENT_END_BYTES = EVENT_END.encode()
DONE = "[DONE]"
_DATA_LINE = re.compile(r"^data:(.*)$", re.MULTILINE)


def event_ends(chunk: bytes, previous: bytes) -> int:
    """Event ends in ``chunk``, with one that straddles from ``previous``, the last byte before it."""
    return chunk.count(_EVENT_END_BYTES) + (previous + chunk[:1] == _EVENT_END_BYTES)


def _split(buffer: str) -> tuple[list[str], str]:
    """Complete events and the unfinished rest."""
    *events, rest = buffer.split(EVENT_END)
    return [event + EVENT_END for event in events], rest


class EventSplitter:
    """Events from a byte stream whose chunks may end mid-event or mid-character."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._rest = ""

    def feed(self, data: bytes) -> list[str]:
        events, self._rest = _split(self._rest + self._decoder.decode(data))
        return events

    def close(self) -> list[str]:
        """An unterminated last event, if any."""
        return [self._rest] if self._rest.strip() else []


def data_json(events: list[str]) -> list[Any]:
    """The JSON of each event's first ``data:`` line, without ``[DONE]``, comments and nulls.

    One parse for the whole batch, with msgspec: about a quarter of the cost of ``json.loads`` on
    each event, which would be most of the worker's cost per token where it parses.
    """
    payloads = [data for event in events if (match := _DATA_LINE.search(event))
                and (data := match[1].strip()) != DONE]
    return [obj for obj in msgspec.json.decode(f"[{','.join(payloads)}]") if obj is not None]


def frame(obj: Any) -> str:
    """One event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}{EVENT_END}"

