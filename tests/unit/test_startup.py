"""The start-up failure logic, without an engine: which engine failures are tried again and with
what, the GPU memory estimate's decisions, the error a job gets from a worker that could not start,
and the answer window's setting."""

from __future__ import annotations

import json

import pytest
from conftest import engine_env

from worker.config import engine_args
from worker.startup import failed_start
from worker.wire.errors import ConfigError, StartupError
from worker.config.early_settings import failure_answer_seconds
from worker.config.settings import DEFAULT_FAILURE_ANSWER_SECONDS
from worker.config.worker_config import load_config
from worker.startup.steps import engine_failure
from worker.vllm_adapter.engine_config import MemoryEstimate
from worker.vllm_adapter.engine_notes import failure_note

KV_NOTE = {"type": "ValueError", "message": "To serve at least one request ...", "out_of_memory": False,
           "kv_cache_too_small": True}
OOM_NOTE = {"type": "OutOfMemoryError", "message": "CUDA out of memory", "out_of_memory": True,
            "kv_cache_too_small": False}


@pytest.fixture
def tiny(models):
    return lambda **env: load_config(engine_env(models["tiny-llama"], **env)).args


def test_a_kv_cache_too_small_for_a_length_nobody_chose_is_tried_with_vllm_fitting_it(tiny):
    failure = engine_failure(RuntimeError("Engine core initialization failed"), KV_NOTE, tiny(MAX_MODEL_LEN=""))
    assert failure.transient and failure.retry == {"max_model_len": -1}
    assert str(failure).startswith("the KV cache cannot hold one request of max_model_len (vLLM's figures")
    assert failure.detail == "ValueError: To serve at least one request ..."  # vLLM's text: the log's
    chosen = engine_failure(RuntimeError(), KV_NOTE, tiny(MAX_MODEL_LEN="2048"))
    assert not chosen.transient and "MAX_MODEL_LEN" in chosen.variables


def test_out_of_memory_is_tried_with_less_memory_unless_the_user_chose_it(tiny):
    failure = engine_failure(RuntimeError(), OOM_NOTE, tiny())
    assert failure.transient and failure.retry == {"gpu_memory_utilization": 0.85}  # the worker's 0.95
    assert failure.change == LOWERED
    assert str(failure).startswith("out of memory while the engine started; set GPU_MEMORY_UTILIZATION")
    assert failure.detail == "OutOfMemoryError: CUDA out of memory"
    assert not engine_failure(RuntimeError(), OOM_NOTE, tiny(GPU_MEMORY_UTILIZATION="0.9")).transient


def test_any_other_engine_failure_is_answered_with_its_kind_and_logged_with_what_the_engine_raised(tiny):
    note = {**OOM_NOTE, "out_of_memory": False, "type": "KeyError", "message": "'/models/x'"}
    failure = engine_failure(RuntimeError("init failed"), note, tiny())
    assert str(failure) == "the engine failed to start (KeyError; the worker's log has vLLM's error)"
    assert failure.detail == "KeyError: '/models/x'" and not failure.transient
    failure = engine_failure(RuntimeError("init failed"), None, tiny())
    answer = "the engine failed to start (RuntimeError; the worker's log has vLLM's error)"
    assert (failure.answer, failure.logged) == (answer, f"{answer} [RuntimeError: init failed]")


LOWERED = "GPU_MEMORY_UTILIZATION lowered from 0.95 to 0.85"  # from the worker's default


@pytest.fixture
def retried(models, monkeypatch):
    """``steps.start_engine`` on tiny-llama whose first build runs out of memory and whose second
    ends as ``second`` says; returns its result (or the StartupError it raised), and each build's
    gpu_memory_utilization. The builds are stand-ins: this is start_engine's own logic."""
    from worker.startup import steps
    from worker.vllm_adapter.engine_notes import ENGINE_FAILURE_FILE_ENV, ENGINE_PHASE_FILE_ENV

    for name in (ENGINE_FAILURE_FILE_ENV, ENGINE_PHASE_FILE_ENV):  # start_engine sets them
        monkeypatch.delenv(name, raising=False)

    def run(second: Exception | None) -> tuple[object, list[float]]:
        utilizations = []

        def build(config):
            utilizations.append(config.args.engine_args.gpu_memory_utilization)
            if len(utilizations) == 1:
                raise engine_failure(RuntimeError(), OOM_NOTE, config.args)
            if second:
                raise second
            return "engine"

        try:
            return steps.start_engine(load_config(engine_env(models["tiny-llama"])), build), utilizations
        except StartupError as failure:
            return failure, utilizations

    return run


def test_a_second_start_after_running_out_of_memory_is_logged_with_what_the_worker_lowered(retried, caplog,
                                                                                         capture_info):
    assert retried(None) == ("engine", [0.95, 0.85])
    lines = [r.getMessage() for r in caplog.records if r.name == "worker.startup.steps"]
    assert lines[0].startswith(f"Engine start failed, trying once more with {LOWERED}: out of memory ")
    assert lines[1:] == [f"Engine started on the second try, with {LOWERED}"]


@pytest.mark.parametrize(("second", "answer", "variables"), [
    (RuntimeError("boom"), "the engine failed to start (RuntimeError; the worker's log has vLLM's error)",
     ("GPU_MEMORY_UTILIZATION",)),
    (ConfigError("invalid configuration:\n  env MAX_MODEL_LEN: too long", variables=("MAX_MODEL_LEN",)),
     "invalid configuration:\n  env MAX_MODEL_LEN: too long", ("MAX_MODEL_LEN", "GPU_MEMORY_UTILIZATION")),
], ids=["engine failure", "configuration error"])
def test_a_second_start_that_fails_too_is_answered_with_what_the_worker_lowered(retried, second, answer,
                                                                               variables):
    failure, utilizations = retried(second)
    assert utilizations == [0.95, 0.85]
    assert type(failure) is (type(second) if isinstance(second, StartupError) else StartupError)
    assert failure.answer == f"also after a second start with {LOWERED}: {answer}"
    assert failure.variables == variables and not failure.transient


def test_vllms_memory_checks_at_start_and_the_cpu_allocators_failure_are_out_of_memory():
    """Raised by vLLM's and torch's own code: the GPU worker's check of free memory against
    gpu_memory_utilization (its CPU twin fails for real in tests/endpoint/test_startup_failures.py),
    and an allocation the CPU allocator refuses."""
    import types

    import torch
    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    gpu = types.SimpleNamespace(total_memory=16 * 2**30, free_memory=8 * 2**30, device_="cuda:0")
    with pytest.raises(ValueError, match="less than desired GPU memory utilization") as short:
        request_memory(gpu, CacheConfig(gpu_memory_utilization=0.95))
    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**62, dtype=torch.uint8)
    for exc in (short.value, refused.value, MemoryError()):
        assert failure_note(exc)["out_of_memory"], exc
    # The same words raised elsewhere are not the check.
    assert not failure_note(ValueError(str(short.value)))["out_of_memory"]
    note = failure_note(refused.value)
    assert note["type"] == "RuntimeError" and "DefaultCPUAllocator: can't allocate memory" in note["message"]


@pytest.mark.parametrize(("env", "estimate", "expected"), [
    ({"MAX_MODEL_LEN": ""}, MemoryEstimate(1000, 10, 10_000), -1),  # 900 tokens fit: vLLM fits it
    ({}, MemoryEstimate(1000, 10, 10_000), "env MAX_MODEL_LEN: "),  # the user's 2048 cannot fit
    ({"MAX_MODEL_LEN": ""}, MemoryEstimate(20_000, 10, 10_000), "the weights alone do not fit"),
    ({}, MemoryEstimate(1000, 1, 10_000_000), 2048),  # fits: as configured
])
def test_the_gpu_memory_estimate_fits_a_length_nobody_chose_and_names_a_chosen_one(tiny, monkeypatch, env,
                                                                                   estimate, expected):
    monkeypatch.setattr(engine_args, "memory_estimate", lambda config: estimate)
    args = tiny(**env)
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            args.engine_config()
        return
    args.engine_config()
    assert args.engine_args.max_model_len == expected  # -1: vLLM fits it at its KV cache check


def test_memory_estimate_arithmetic():
    estimate = MemoryEstimate(weights=4_000, kv_per_token=3, budget=10_000)
    assert estimate.fits(2000) and not estimate.fits(2001) and estimate.max_tokens == 2000
    assert MemoryEstimate(20_000, 3, 10_000).max_tokens == 0


@pytest.mark.parametrize(("route", "body"), [
    (None, {"message": "the worker could not start: MODEL_NAME: gone", "type": "ServiceUnavailableError",
            "param": None, "code": 503}),
    ("/v1/chat/completions", {"message": "the worker could not start: MODEL_NAME: gone",
                              "type": "ServiceUnavailableError", "param": None, "code": 503}),
    ("/v1/messages", {"type": "overloaded_error", "message": "the worker could not start: MODEL_NAME: gone"}),
])
def test_a_job_gets_the_failure_in_its_routes_dialect(route, body):
    job = {"id": "j", "input": {"openai_route": route} if route else {"prompt": "hi"}}
    item = failed_start.failure_item(StartupError("MODEL_NAME: gone", variables=("MODEL_NAME",)), job)
    assert json.loads(str(item["error"])) == body


def test_a_job_gets_no_local_path_nor_a_urls_credentials():
    failure = ConfigError("invalid configuration:\n  env MODEL_NAME='/models/x': no such directory\n"
                          "  env SPECULATIVE_MODEL: cannot reach 'http://user:pw@mirror:8080/org/x'")
    message = json.loads(str(failed_start.failure_item(failure, {"input": {}})["error"]))["message"]
    assert message == ("the worker could not start: invalid configuration:\n  env MODEL_NAME='<path>': no "
                       "such directory\n  env SPECULATIVE_MODEL: cannot reach 'http://***@mirror:8080/org/x'")


def test_exit_status_says_whether_settings_must_change():
    assert failed_start.exit_status(ConfigError("invalid configuration: ...")) == 2
    assert failed_start.exit_status(StartupError("MODEL_NAME: no such repo", variables=("MODEL_NAME",))) == 2
    assert failed_start.exit_status(StartupError("engine died")) == 1


@pytest.mark.parametrize(("value", "seconds"), [
    (None, DEFAULT_FAILURE_ANSWER_SECONDS), ("", DEFAULT_FAILURE_ANSWER_SECONDS), ("0", 0.0),
    ("30.5", 30.5), ("soon", DEFAULT_FAILURE_ANSWER_SECONDS), ("-1", DEFAULT_FAILURE_ANSWER_SECONDS)])
def test_the_answer_window_is_read_alone_and_a_bad_value_falls_back(value, seconds):
    env = {} if value is None else {"STARTUP_FAILURE_ANSWER_SECONDS": value}
    assert failure_answer_seconds(env) == seconds


def test_a_transient_download_failure_is_tried_once_more_and_a_permanent_one_is_not(monkeypatch, caplog):
    from worker.model import preflight
    from worker.startup import steps

    calls = []

    def prepare(request, on_phase):
        calls.append(request)
        if len(calls) == 1:
            raise StartupError("download failed: cannot reach the hub", detail="the mirror", transient=True)
        return "snapshots"

    monkeypatch.setattr(steps, "RETRY_PAUSE_SECONDS", 0)
    monkeypatch.setattr(preflight, "prepare", prepare)
    monkeypatch.setattr("worker.config.model_request.model_request", lambda: "org/model")
    assert steps.fetch_model(print) == "snapshots" and len(calls) == 2
    # With its detail: the log's.
    assert "Model download failed, trying once more in 0 s: download failed: cannot reach the hub " \
        "[the mirror]" in caplog.text

    def gone(request, on_phase):
        calls.append(request)
        raise StartupError("MODEL_NAME='org/model': no such repo", variables=("MODEL_NAME",))

    monkeypatch.setattr(preflight, "prepare", gone)
    with pytest.raises(StartupError, match="no such repo"):
        steps.fetch_model(print)
    assert len(calls) == 3


def test_the_memory_estimate_reads_vllms_model_config_on_a_gpu(models, monkeypatch):
    """tiny-llama on a pretend 1 GiB GPU: 2 layers x 2 KV heads x 64 dims x (K, V) x 2 bytes
    (bfloat16) per token; its safetensors are the weights; the budget is memory x utilization, or
    the KV cache's own size when KV_CACHE_MEMORY_BYTES gives one."""
    import types

    from worker.vllm_adapter import engine_config

    gpu = types.SimpleNamespace(is_cuda_alike=lambda: True, get_device_total_memory=lambda: 2**30)
    weights = (models["tiny-llama"] / "model.safetensors").stat().st_size
    config = load_config(engine_env(models["tiny-llama"], KV_CACHE_MEMORY_BYTES="")).args.engine_config()
    monkeypatch.setattr(engine_config, "current_platform", gpu)
    assert engine_config.memory_estimate(config) == MemoryEstimate(weights, 1024, int(2**30 * 0.95))
    config.cache_config.kv_cache_memory_bytes = 5000
    assert engine_config.memory_estimate(config).budget == weights + 5000
