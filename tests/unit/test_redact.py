"""Text fit to leave the worker (``wire/redact``): a URL's credentials masked in answers, log records
(their tracebacks too) and what the process writes to its streams; local paths kept out of answers.
A real worker's log and answers: tests/endpoint/test_startup_failures.py."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from worker.wire.errors import StartupError
from worker.wire.redact import answer_text, mask_log_records, mask_streams, mask_urls

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
