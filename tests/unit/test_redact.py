"""Text fit to leave the worker (``wire/redact``): a URL's credentials masked in answers, log records
(their tracebacks too) and what the process writes to its streams; local paths kept out of answers.
A real worker's log and answers: tests/endpoint/test_startup_failures.py."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from worker.wire.errors import StartupError
from worker.routes.route_table import Route
from worker.wire.errors import error_from_exception
from worker.wire import redact
from worker.wire.redact import answer_text, mask_log_records, mask_streams, mask_urls, served_text

MIRROR = "https://mirror-user:s3cret-pw@hub.example:8443"


@pytest.mark.parametrize(("text", "masked"), [
    (f"cannot reach {MIRROR}/api/org/x", "cannot reach https://***@hub.example:8443/api/org/x"),
    ("url 'http://u:p@ss@h:1/x'", "url 'http://***@h:1/x'"),  # an unencoded @ in the password
    ("a=s3://AKIA:key@bucket and http://token@host", "a=s3://***@bucket and http://***@host"),
    ("https://huggingface.co/org/x, me@example.com", "https://huggingface.co/org/x, me@example.com"),
])
def test_a_urls_credentials_are_masked_and_nothing_else(text, masked):
    assert mask_urls(text) == masked


@pytest.mark.parametrize(("text", "answered"), [
    ("not in the cache at /runpod-volume/huggingface-cache/hub (it holds main).",
     "not in the cache at <path> (it holds main)."),
    ("env MODEL_NAME='/models/x': no such directory", "env MODEL_NAME='<path>': no such directory"),
    ("in ./models/x or ~/.cache/hf", "in <path> or <path>"),
    # Not paths: a URL's, a repo id, the root alone, a fraction.
    (f"at {MIRROR}/org/x for org/x; 9.80 GB free on / (6.5 %); 1/2", "at https://***@hub.example:8443/org/x "
     "for org/x; 9.80 GB free on / (6.5 %); 1/2"),
])
def test_an_answer_shows_no_local_path_and_no_credentials(text, answered):
    assert answer_text(text) == answered


def test_at_run_time_only_this_machines_paths_are_masked(tmp_path):
    """vLLM's text keeps its routes and what is no folder here; a path under a folder this machine
    has is masked (vLLM's own media check quotes its allowed folder)."""
    text = (f"The file path /etc/hostname must be a subpath of `--allowed-local-media-path {tmp_path}`; "
            f"see /v1/models, from {MIRROR}/org/x")
    assert served_text(text) == ("The file path <path> must be a subpath of `--allowed-local-media-path <path>`; "
                                 "see /v1/models, from https://***@hub.example:8443/org/x")


def test_a_model_served_as_its_folders_path_is_named_as_it_is(tmp_path, monkeypatch):
    """A caller must send that name: vLLM's "Valid aliases" list it, /v1/models shows it."""
    monkeypatch.setattr(redact, "_AS_IS", set())
    redact.show_as_is([f"{tmp_path}/model/"])
    assert served_text(f"The model `x` does not exist. Valid aliases: {tmp_path}/model.") == (
        f"The model `x` does not exist. Valid aliases: {tmp_path}/model.")
    assert served_text(f"{tmp_path}/model/config.json") == "<path>"


def test_vllms_errors_reach_a_caller_without_this_machines_paths(tmp_path):
    """Both ways vLLM's errors leave the worker: an exception raised (the handler's catch-all) and
    vLLM's error body from a serving class (its own OpenAI shape, and its bare text)."""
    missing = FileNotFoundError(2, "No such file or directory", str(tmp_path / "template.jinja"))
    assert str(tmp_path) not in str(error_from_exception(missing))
    route = Route("/v1/chat/completions", frozenset({"POST"}))
    body = {"error": {"message": f"cannot read {tmp_path}/x", "type": "BadRequestError", "param": None,
                      "code": 400}}
    for content in (body, {"detail": f"cannot read {tmp_path}/x"}):
        item = route.error_item(400, content)
        assert item["error"]["message"] == "cannot read <path>", item
    assert Route("/v1/messages", frozenset({"POST"})).error_item(400, body)["error"]["message"] == "cannot read <path>"


def test_a_startup_errors_answer_is_its_message_and_its_detail_is_the_logs():
    failure = StartupError("MODEL_NAME='org/x' is not in the cache (HF_HOME)", detail="the cache: /data/hub")
    assert failure.answer == str(failure) and "/data/hub" in failure.logged


@pytest.fixture
def masked_records():
    """Log records masked for the test's duration (the record factory is the process's)."""
    factory = logging.getLogRecordFactory()
    mask_log_records()
    mask_log_records()  # once is enough: a second call adds nothing
    yield
    logging.setLogRecordFactory(factory)


def test_every_log_record_is_masked_its_traceback_too(masked_records):
    stream = io.StringIO()
    logger = logging.getLogger("test-redact")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        logger.warning("Model download failed: %s", f"cannot reach {MIRROR}")
        try:
            raise OSError(f"We couldn't connect to '{MIRROR}' to load the files")
        except OSError:
            logger.exception("EngineCore failed to start.")
        logger.warning("no URL here: %d%%", 50)
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "s3cret-pw" not in text and text.count("https://***@hub.example:8443") == 2
    assert "Traceback" in text and "no URL here: 50%" in text


def test_what_the_process_writes_to_its_streams_is_masked(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    mask_streams()
    mask_streams()
    print(f"Process EngineCore_DP0:\nOSError: {MIRROR}")
    sys.stderr.write(f"{MIRROR}\n")
    assert sys.stderr.getvalue() == "https://***@hub.example:8443\n"  # attributes reach the stream
    assert out.getvalue() == "Process EngineCore_DP0:\nOSError: https://***@hub.example:8443\n"
