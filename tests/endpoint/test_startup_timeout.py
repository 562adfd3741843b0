"""VLLM_STARTUP_TIMEOUT on real workers under the local endpoint: a download that progresses is not
counted and one that stalls is (SmolLM2's 269 MB from the local hub, paced, then held), answered on
the jobs of the openai, anthropic and raw clients (503) naming the setting, the phase and the seconds,
after which the worker exits 1 and is restarted; a start that hangs in vLLM's load (its weights a
FIFO nobody writes: a read that never returns) answered the same on a load-balancing endpoint."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
from conftest import engine_env, wait_for
from local_endpoint import LocalEndpoint, failed_start_answers
from test_startup_failures import answered, online

from tests.image.local_hub import LocalHub

TIMEOUT = 10  # far above the imports and hub checks before the download, which take about a second
PACE = 12.5e6  # bytes a second: a 10 MiB piece of the weights lands every 0.8 s
PROGRESSED = 100e6  # the download is held once this much of the weights has gone out (8 s)
ANSWER_WINDOW = 15  # seconds the worker answers with its failure: far more than answering takes
TIMED_OUT = re.compile(rf"the worker did not become ready within VLLM_STARTUP_TIMEOUT={TIMEOUT} s: "
                       r"(\d+) s after its start \((\d+) s of download progress not counted\), "
                       r"the last (\d+) s in phase '(\S+)'")


@pytest.fixture
def hub(models):
    files = {p.name: p for p in models["smollm2-135m-instruct"].iterdir() if p.is_file()}
    with LocalHub() as hub:
        hub.add_repo("org/smol", files)
        yield hub


def test_a_download_is_counted_only_once_it_stalls(hub, tmp_path):
    hub.bytes_per_second = PACE
    env = online(hub, tmp_path, MODEL_NAME="org/smol", VLLM_STARTUP_TIMEOUT=str(TIMEOUT),
                 STARTUP_FAILURE_ANSWER_SECONDS=str(ANSWER_WINDOW))
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log", ready_timeout=None)
    try:
        weights = lambda: next((d for d in hub.downloads if d.path == "model.safetensors"), None)  # noqa: E731
        wait_for(lambda: (d := weights()) is not None and d.sent >= PROGRESSED, 120)
        hub.bytes_per_second = 0  # held: no byte more
        stalled = time.monotonic()
        endpoint._wait_ready(1, 120)  # the worker answers jobs with the cause from now on
        message = answered(endpoint, f"VLLM_STARTUP_TIMEOUT={TIMEOUT} s")
        after, uncounted, last, phase = TIMED_OUT.search(message).groups()
        assert phase == "download" and "with no progress of the model's download" in message
        assert int(uncounted) >= PROGRESSED / PACE - 3  # the download's progress was not counted ...
        assert TIMEOUT - 2 <= int(after) - int(uncounted) <= TIMEOUT + 3  # ... its stall was, in full
        assert int(last) <= time.monotonic() - stalled + 2
        assert not weights().complete
        # as any failed start, once its answer window has passed
        wait_for(lambda: "local-worker-0 exited with status 1" in endpoint.log(), ANSWER_WINDOW + 30)
    finally:
        endpoint.stop()


@pytest.fixture
def unreadable_weights(models, tmp_path):
    """tiny-llama with its weights a FIFO: reading them waits for a writer that never comes."""
    folder = tmp_path / "tiny-fifo"
    shutil.copytree(models["tiny-llama"], folder)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    return folder


def test_a_start_that_hangs_while_loading_is_answered_on_a_load_balancing_endpoint(unreadable_weights,
                                                                                   tmp_path):
    env = engine_env(unreadable_weights, VLLM_STARTUP_TIMEOUT="8", STARTUP_FAILURE_ANSWER_SECONDS="60")
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log", ready_timeout=None, args=("--load-balancer",))
    try:
        for text in failed_start_answers(endpoint):
            assert "VLLM_STARTUP_TIMEOUT=8 s" in text
            assert "in phase 'load', reading the configuration and loading the weights" in text
    finally:
        endpoint.stop()
