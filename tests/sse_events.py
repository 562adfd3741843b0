"""Server-sent events read back in the tests: (event name, data) of each event in a stream's text."""

from __future__ import annotations

from worker.wire.sse import EVENT_END


def parse(text: str) -> list[tuple[str | None, str | None]]:
    """(event name, data) of each event in ``text``."""
    events = []
    for block in filter(str.strip, text.split(EVENT_END)):
        name = data = None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        events.append((name, data))
    return events
