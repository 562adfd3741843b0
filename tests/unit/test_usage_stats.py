"""vLLM's usage statistics are off unless the operator turns them on (``vllm_adapter/engine_env._no_usage_stats``,
set where the worker sets its engine processes' environment), read as vLLM reads them. A real worker's
engine process: tests/worker/test_process.py."""

from __future__ import annotations

import os

import pytest

USAGE = "VLLM_NO_USAGE_STATS"


@pytest.mark.parametrize(("value", "setting", "sent"), [
    (None, "1", False), ("", "1", False),  # unset or blank: the worker's default, none sent
    ("1", "1", False), ("true", "1", False), ("soon", "1", False),  # vLLM reads only "1"
    ("0", "0", True), ("false", "0", True), ("No", "0", True),  # the operator's explicit choice
])
def test_usage_statistics_are_sent_only_when_the_operator_says_so(value, setting, sent, monkeypatch):
    import vllm.envs

    from worker.vllm_adapter import engine_env

    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    monkeypatch.delenv("VLLM_DO_NOT_TRACK", raising=False)
    if value is None:
        monkeypatch.delenv(USAGE, raising=False)
    else:
        monkeypatch.setenv(USAGE, value)
    monkeypatch.setitem(engine_env._SET_HERE, USAGE, "")  # logged again
    engine_env._no_usage_stats()
    assert os.environ[USAGE] == setting
    assert vllm.envs.VLLM_NO_USAGE_STATS is not sent and not vllm.envs.VLLM_DO_NOT_TRACK

