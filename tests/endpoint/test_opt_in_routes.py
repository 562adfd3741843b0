"""Routes vLLM serves only when asked, through the local endpoint to the official openai client:
stored responses (retrieve, replay with a query string, cancel, an unknown id), tokenizer_info
and the batch route, on one tiny-model worker with the opt-in flags and vLLM's store env var; and
the endpoint's execution timeout, which stops a job that runs too long."""

from __future__ import annotations

import re

import openai
import pytest
from conftest import opt_in_env, wait_for
from local_endpoint import LocalEndpoint, openai_fixtures

EXECUTION_TIMEOUT = 4  # seconds: far above this module's short requests, far below the long one


@pytest.fixture(scope="module")
def endpoint(tiny_env, tmp_path_factory):
    local = LocalEndpoint({**tiny_env, **opt_in_env(), "ENABLE_LOG_REQUESTS": "true"}, 1,
                          tmp_path_factory.mktemp("endpoint") / "opt-in.log",
                          args=("--execution-timeout", str(EXECUTION_TIMEOUT)))
    yield local
    local.stop()


client, model = openai_fixtures()


def test_a_stored_response_is_retrieved_replayed_and_not_cancelled_once_done(client, model):
    # vLLM keeps the events for replay of a response run in the background, streamed.
    events = list(client.responses.create(model=model, input="Hello", max_output_tokens=6, stream=True,
                                          background=True, extra_body={"ignore_eos": True}))
    response_id = events[0].response.id
    retrieved = client.responses.retrieve(response_id)
    assert retrieved.id == response_id and retrieved.usage.output_tokens == 6 and retrieved.output_text
    replayed = list(client.responses.retrieve(response_id, stream=True))
    assert [e.type for e in replayed] == [e.type for e in events]
    later = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.type for e in later] == [e.type for e in events][3:]
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(response_id)


def test_an_unknown_stored_response_is_a_404_naming_the_one_worker_store(client):
    for call in (client.responses.retrieve, client.responses.cancel):
        with pytest.raises(openai.NotFoundError) as raised:
            call("resp_elsewhere")
        assert "resp_elsewhere" in str(raised.value) and "another" in str(raised.value)


def test_tokenizer_info_and_the_batch_route(endpoint, model):
    info = endpoint.http.get("/openai/v1/tokenizer_info")
    assert info.status_code == 200 and info.json()["tokenizer_class"]
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    batch = endpoint.http.post("/openai/v1/chat/completions/batch", json={
        "model": model, "messages": conversations, "max_tokens": 3, "ignore_eos": True})
    assert batch.status_code == 200
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1]
    assert batch.json()["usage"]["completion_tokens"] == 6


def test_a_request_past_the_execution_timeout_gets_a_504_and_its_job_is_stopped(client, model, endpoint):
    # 100 × 1800 tokens take the tiny model several times the timeout (4 × 1800 once finished about
    # when the timeout came, leaving nothing to abort); they fit its KV cache (250,000 tokens).
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1800, n=100, extra_body={"ignore_eos": True})
    assert raised.value.status_code == 504 and "execution timeout" in str(raised.value)
    assert wait_for(lambda: re.search(r"Aborted request\(s\) chatcmpl-", endpoint.log()), 30) < 30
    after = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2  # the worker serves on
