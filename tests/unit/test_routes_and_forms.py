"""The route table's lookups (aliases, templates, methods) and form bodies from JSON (no engine)."""

from __future__ import annotations

import base64
import email.parser
import email.policy

import pytest
from fastapi import FastAPI

from worker.wire.errors import RequestError
from worker.routes.forms import form_body
from worker.routes.route_table import Route, RouteTable

TABLE = RouteTable([
    Route("/v1/chat/completions", frozenset({"POST"})),
    Route("/tokenize", frozenset({"POST"})),
    Route("/v2/rerank", frozenset({"POST"})),
    Route("/score", frozenset({"POST"})),
    Route("/v1/score", frozenset({"POST"})),
    Route("/v1/responses/{response_id}", frozenset({"GET"})),
    Route("/v1/responses/{response_id}/cancel", frozenset({"POST"})),
    Route("/v1/models", frozenset({"GET"})),
    Route("/v1/audio/transcriptions", frozenset({"POST"}), form=True),
    Route("/v1/messages/count_tokens", frozenset({"POST"})),
])


@pytest.mark.parametrize(("job_route", "path", "vllm_path"), [
    ("/v1/chat/completions", "/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/tokenize", "/tokenize", "/tokenize"),  # a root route under /v1, as RunPod relays it
    ("/v1/v2/rerank", "/v2/rerank", "/v2/rerank"),
    ("/v1/score", "/v1/score", "/v1/score"),  # vLLM's own /v1/ form wins over the alias
    ("/v1/responses/resp_123", "/v1/responses/{response_id}", "/v1/responses/resp_123"),
    ("/v1/responses/resp_123/cancel", "/v1/responses/{response_id}/cancel", "/v1/responses/resp_123/cancel"),
])
def test_a_job_route_finds_vllms_route(job_route, path, vllm_path):
    assert TABLE.find(job_route).path == path and TABLE.vllm_path(job_route) == vllm_path


@pytest.mark.parametrize("job_route", ["/v1/nope", "/v1/responses/a/b", "/v1/responses/", "tokenize", ""])
def test_other_routes_are_not_found(job_route):
    assert TABLE.find(job_route) is None


def test_facts_of_a_route():
    chat, messages = TABLE.find("/v1/chat/completions"), TABLE.find("/v1/messages/count_tokens")
    assert chat.preamble({"n": 3}) == 3 and chat.preamble({}) == 1 and not chat.anthropic
    assert messages.anthropic and messages.preamble({}) == 0
    assert TABLE.find("/v1/models").method_for(None) == "GET"
    assert TABLE.find("/v1/audio/transcriptions").form
    assert "/v1/tokenize" in TABLE.names() and "/tokenize" in TABLE.names()


def test_a_path_registered_for_several_methods_keeps_them_all():
    app = FastAPI()
    app.get("/v1/things")(lambda: None)
    app.post("/v1/things")(lambda: None)
    app.get("/health")(lambda: None)
    table = RouteTable.from_app(app)
    assert table.find("/v1/things").methods == {"GET", "POST"} and table.find("/health") is None
    assert table.find("/v1/things").method_for({"x": 1}) == "POST"
    assert table.find("/v1/things").method_for(None) == "GET"


@pytest.mark.parametrize(("methods", "body", "method"), [
    ({"GET", "DELETE"}, None, "GET"),  # never DELETE by default: min() chose it
    ({"GET", "DELETE"}, {"x": 1}, "GET"),
    ({"POST", "DELETE"}, None, "POST"),
    ({"GET", "HEAD"}, None, "GET"),
    ({"GET", "POST", "DELETE", "PUT"}, {}, "POST"),
    ({"DELETE"}, None, "DELETE"),  # the route's one method
])
def test_a_job_naming_no_method_gets_post_for_a_body_else_get(methods, body, method):
    assert Route("/v1/things/{id}", frozenset(methods)).method_for(body) == method


def test_a_route_without_get_or_post_needs_the_job_to_name_its_method():
    with pytest.raises(RequestError, match="DELETE, PUT") as caught:
        Route("/v1/things/{id}", frozenset({"PUT", "DELETE"})).method_for({"x": 1})
    assert caught.value.param == "method"


def parse_form(body: bytes, content_type: str) -> dict[str, list]:
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    fields: dict[str, list] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        value = (part.get_filename(), part.get_content_type(), part.get_payload(decode=True)) \
            if part.get_filename() else part.get_payload(decode=True).decode()
        fields.setdefault(name, []).append(value)
    return fields


AUDIO = b"RIFF\x00\x01binary\xff"


@pytest.mark.parametrize("file", [base64.b64encode(AUDIO).decode(),
                                  "data:audio/wav;base64," + base64.b64encode(AUDIO).decode()])
def test_a_form_from_json_carries_the_file_and_the_fields(file):
    body, content_type = form_body({"file": file, "filename": "a.wav", "model": "m", "temperature": 0.5,
                                    "stream": True, "timestamp_granularities[]": ["word", "segment"],
                                    "language": None})
    fields = parse_form(body, content_type)
    (filename, mime, data), = fields["file"]
    assert (filename, data) == ("a.wav", AUDIO)
    assert mime == ("audio/wav" if file.startswith("data:") else "application/octet-stream")
    assert fields["model"] == ["m"] and fields["temperature"] == ["0.5"] and fields["stream"] == ["true"]
    assert fields["timestamp_granularities[]"] == ["word", "segment"] and "language" not in fields


def test_vllms_batch_spelling_file_url_is_accepted():
    body, content_type = form_body({"file_url": "data:audio/wav;base64," + base64.b64encode(AUDIO).decode()})
    assert parse_form(body, content_type)["file"][0][2] == AUDIO


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"model": "m"}, "file", "needs 'file'"),
    ({"file_url": ""}, "file_url", "needs 'file'"),
    ({"file": "not base64!"}, "file", "not valid base64"),
    ({"file": "https://example.com/a.wav"}, "file", "not a link"),
    ({"file": 12}, "file", "needs 'file'"),
])
def test_bad_uploads_are_clear_errors(fields, param, fragment):
    with pytest.raises(RequestError, match=fragment) as raised:
        form_body(fields)
    assert raised.value.param == param


def test_a_form_must_be_an_object():
    with pytest.raises(RequestError, match="JSON object"):
        form_body(["file"])
