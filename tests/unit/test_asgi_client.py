"""The in-process ASGI client: streaming, failures and disconnects, with small ASGI apps."""

import asyncio
import json

import pytest

from worker.routes.asgi_client import request


def streaming_app(chunks, *, fail_after=None, seen=None):
    async def app(scope, receive, send):
        body = await receive()
        seen.append(json.loads(body["body"])) if seen is not None else None
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i, chunk in enumerate(chunks):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("engine failed mid-stream")
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


async def read(app, body=None):
    async with request(app, "POST", "/x", body) as response:
        return response.status, response.is_event_stream, [c async for c in response.body]


def test_streams_the_body_chunk_by_chunk_and_sends_the_request_body():
    seen = []
    status, is_stream, chunks = asyncio.run(read(streaming_app([b"a", b"b"], seen=seen), {"q": 1}))
    assert (status, is_stream, chunks, seen) == (200, True, [b"a", b"b"], [{"q": 1}])


def test_an_app_failing_mid_stream_raises_after_the_partial_body():
    received = []

    async def consume():
        async with request(streaming_app([b"a", b"b", b"c"], fail_after=2), "POST", "/x") as response:
            async for chunk in response.body:
                received.append(chunk)

    with pytest.raises(RuntimeError, match="mid-stream"):
        asyncio.run(consume())
    assert received == [b"a", b"b"]


def test_leaving_early_tells_the_app_the_client_disconnected():
    events = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        events.append((await receive())["type"])  # vLLM's handlers wait for this to abort

    async def consume():
        async with request(app, "GET", "/x") as response:
            async for _ in response.body:
                break

    asyncio.run(consume())
    assert events == ["http.disconnect"]


def test_sse_events_survive_chunks_split_inside_a_character():
    from worker.wire.sse import EventSplitter

    data = 'data: {"t": "é"}\n\ndata: [DONE]\n\n'.encode()
    splitter = EventSplitter()
    events = [event for i in range(len(data)) for event in splitter.feed(data[i:i + 1])]
    assert events + splitter.close() == ['data: {"t": "é"}\n\n', "data: [DONE]\n\n"]
