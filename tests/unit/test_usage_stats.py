"""What the worker sets in its engine processes' environment (``vllm_adapter/engine_env``): vLLM's
usage statistics off unless the operator turns them on, read as vLLM reads them; on the CPU, the
processes forked unless the user chose. A real worker's engine process: tests/worker/test_process.py."""

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


@pytest.mark.parametrize("users", [None, "spawn", "fork"])
def test_on_the_cpu_the_engine_core_is_forked_and_spawns_its_workers_unless_the_user_chose(users, monkeypatch):
    """vLLM's CPU platform writes "spawn" with every configuration it builds; the method is set again
    as the engine processes start, start after start: the user's, else "fork" for the engine core
    and "spawn" in it, for its model workers. A real worker: tests/worker/test_process.py."""
    from worker.vllm_adapter import engine_env

    name = engine_env.START_METHOD_ENV
    monkeypatch.setattr(engine_env, "_USERS_START_METHOD", users)
    for _ in range(2):
        monkeypatch.setenv(name, "spawn")  # as vLLM's CPU platform writes it
        engine_env._start_method()
        assert os.environ[name] == (users or "fork")
        assert in_a_forked_child(lambda: os.environ[name]) == (users or "spawn")


def in_a_forked_child(read) -> str:
    """What ``read()`` returns in a process forked from this one."""
    readable, writable = os.pipe()
    if (pid := os.fork()) == 0:  # the child: answer, and leave without running anything of the parent's
        os.write(writable, read().encode())
        os._exit(0)
    os.close(writable)
    with os.fdopen(readable) as answer:
        value = answer.read()
    assert os.waitpid(pid, 0)[1] == 0
    return value
