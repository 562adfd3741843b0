"""Jobs past their timeout are aborted in vLLM, on the raw and the OpenAI paths."""

import time

import pytest


def running_requests(engine) -> int:
    return engine.llm.output_processor.get_num_unfinished_requests()


def wait_idle(engine, timeout: float = 1.0) -> float:
    started = time.monotonic()
    while running_requests(engine):
        assert time.monotonic() - started < timeout, "the vLLM request was not aborted"
        time.sleep(0.01)
    return time.monotonic() - started


LONG = {"max_tokens": 1900, "ignore_eos": True}


@pytest.mark.parametrize("stream", [False, True])
def test_raw_job_timeout_aborts_the_request(tiny_engine, run_job, stream):
    items = run_job(tiny_engine, {"prompt": "x", "stream": stream, "timeout": 0.5, "sampling_params": LONG})
    assert items[-1]["error"]["code"] == 408 and items[-1]["error"]["param"] == "timeout"
    wait_idle(tiny_engine)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_job_timeout_aborts_the_request(tiny_engine, tiny_openai, run_openai, stream):
    body = {"model": tiny_openai.served_model_name, "prompt": "x", "stream": stream, **LONG}
    items = run_openai(tiny_openai, "/v1/completions", body, timeout=0.5)
    assert items[-1]["error"]["code"] == 408
    wait_idle(tiny_engine)
