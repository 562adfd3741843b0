"""Start-up failures, each started for real: one worker process under the local endpoint (against
the local hub for the hub's failures), its cause seen by clients through ``/runsync``, the openai
client and the anthropic client (503, naming what to change), while the worker stays up answering.
Then the two ends of the answer window: a worker that exits when it ends (and is restarted by the
endpoint), and one that exits at once (STARTUP_FAILURE_ANSWER_SECONDS=0). Out-of-memory retries:
the engine's own KV-cache error, once with a length the user chose (answered), once without
(tried again with vLLM fitting the length, and served); and memory short at start, with half of it
held by another process (tried again with a lower GPU_MEMORY_UTILIZATION, then answered with both
values: tests/endpoint/test_memory_held_start.py). Last, what callers are told and what only the log
has: a mirror's address with credentials (masked in the log too), the cache's path, vLLM's own text
(the KV-cache case above)."""

from __future__ import annotations

import json
import shutil
import subprocess

import anthropic
import openai
import pytest
from conftest import engine_env, wait_for
from dev_env import free_port
from local_endpoint import API_KEY, LocalEndpoint, failed_start_answers

from tests.image.local_hub import LocalHub

GATED_TOKEN, PRIVATE_TOKEN, OTHER_TOKEN = "hf_gated_reader_1", "hf_private_reader_2", "hf_no_access_3"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hub(models):
    """org/smol (SmolLM2's files), a gated and a private copy, and tokens for each."""
    files = {p.name: p for p in models["smollm2-135m-instruct"].iterdir() if p.is_file()}
    with LocalHub() as hub:
        hub.add_repo("org/smol", files)
        hub.add_repo("org/gated", files, token=GATED_TOKEN)
        hub.add_repo("org/private", files, private=True, readers=[PRIVATE_TOKEN])
        hub.add_token(OTHER_TOKEN)
        yield hub


def online(hub: LocalHub, tmp_path, **env: str) -> dict[str, str]:
    """A worker on the local hub with an empty Hugging Face cache in ``tmp_path``."""
    return {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
            "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": "",
            "VLLM_CONFIG_FILE": "/nonexistent/vllm_config.yaml",
            "LOCAL_MODEL_ARGS_FILE": "/nonexistent/local_model_args.json", **env}


def answered(endpoint: LocalEndpoint, fragment: str) -> str:
    """The cause a client sees on a raw job, and on the OpenAI and Anthropic routes: all 503."""
    job = endpoint.http.post("/runsync", json={"input": {"prompt": "Hello"}}).json()
    assert job["status"] == "FAILED", job
    error = json.loads(job["error"])
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
    assert error["message"].startswith("the worker could not start: ") and fragment in error["message"]
    assert job["executionTime"] < 5000  # answered at once, not after a timeout
    with pytest.raises(openai.APIStatusError) as raised:
        endpoint.openai_client().chat.completions.create(model="any", messages=CHAT)
    assert raised.value.status_code == 503 and fragment in raised.value.message
    client = anthropic.Anthropic(base_url=endpoint.base + "/openai", api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as raised:
        client.messages.create(model="any", max_tokens=5, messages=CHAT)
    assert raised.value.status_code == 503 and raised.value.body["error"]["type"] == "overloaded_error"
    assert fragment in raised.value.body["error"]["message"]
    return error["message"]


def start(tmp_path, env: dict[str, str]) -> LocalEndpoint:
    return LocalEndpoint(env, 1, tmp_path / "endpoint.log")


HUB_FAILURES = {
    "mistyped model": ({"MODEL_NAME": "no-such-org/no-such-model-7b"},
                       "MODEL_NAME='no-such-org/no-such-model-7b': no such repo on the hub, or it is private: "
                       "check MODEL_NAME, or set HF_TOKEN"),
    "mistyped revision": ({"MODEL_NAME": "org/smol", "MODEL_REVISION": "v9"},
                          "MODEL_REVISION='v9': no such branch, tag or commit in org/smol"),
    "gated, no token": ({"MODEL_NAME": "org/gated"}, "MODEL_NAME='org/gated' is gated: accept its terms"),
    "gated, no access": ({"MODEL_NAME": "org/gated", "HF_TOKEN": OTHER_TOKEN},
                         "is gated, and the account of HF_TOKEN has no access"),
    "private, no access": ({"MODEL_NAME": "org/private", "HF_TOKEN": OTHER_TOKEN},
                           "or it is private and the account of HF_TOKEN cannot read it"),
    "invalid token": ({"MODEL_NAME": "org/smol", "HF_TOKEN": "hf_revoked_0"},
                      "HF_TOKEN: the hub refused the token (invalid or revoked)"),
}


@pytest.mark.parametrize("case", HUB_FAILURES)
def test_a_hub_failure_is_answered_on_every_job_in_seconds(hub, tmp_path, case):
    env, fragment = HUB_FAILURES[case]
    endpoint = start(tmp_path, online(hub, tmp_path, **env))
    try:
        answered(endpoint, fragment)
        log = endpoint.log()
        # Found before vLLM was imported: no engine configuration was logged.
        assert "Worker could not start" in log and "Engine config" not in log
        assert endpoint.http.get("/health").json()["workers"]["ready"] == 1  # still serving answers
        assert not list((tmp_path / "hf-home").rglob("*.safetensors"))  # nothing downloaded
    finally:
        endpoint.stop()


@pytest.fixture
def small_volume(tmp_path):
    """An 8 MB network volume (tmpfs), too small for SmolLM2's 270 MB."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(volume)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield volume
    subprocess.run(["umount", "-l", str(volume)], check=True)


def test_a_volume_too_small_for_the_weights_is_answered_before_downloading(hub, tmp_path, small_volume):
    env = online(hub, tmp_path, MODEL_NAME="org/smol", BASE_PATH=str(small_volume),
                 HF_HOME=str(small_volume / "huggingface-cache"))
    endpoint = start(tmp_path, env)
    try:
        message = answered(endpoint, "MODEL_NAME='org/smol' needs 0.27 GB more in the Hugging Face cache")
        assert "its disk has 0.01 GB free: give the endpoint a larger network volume" in message
        assert not [d for d in hub.downloads if d.repo == "org/smol"]
    finally:
        endpoint.stop()


def unsupported_model(models, tmp_path):
    folder = tmp_path / "unsupported"
    shutil.copytree(models["tiny-llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    return folder


ENGINE_FAILURES = {
    "bad env value": (lambda models, tmp_path: engine_env(models["tiny-llama"], MAX_MODEL_LEN="abc"),
                      "env MAX_MODEL_LEN='abc'"),
    "a flag VLLM_EXTRA_ARGS gives that vLLM rejects": (
        lambda models, tmp_path: engine_env(models["tiny-llama"], VLLM_EXTRA_ARGS="--max-num-seqs 4 --no-such-flag"),
        "env VLLM_EXTRA_ARGS: unrecognized arguments: --no-such-flag"),
    "a flag VLLM_EXTRA_ARGS gives that the worker owns": (
        lambda models, tmp_path: engine_env(models["tiny-llama"], VLLM_EXTRA_ARGS="--port 9000"),
        "env VLLM_EXTRA_ARGS: --port is the worker's own"),
    "unsupported architecture": (
        lambda models, tmp_path: engine_env(unsupported_model(models, tmp_path)),
        "the model's architecture NoSuchForCausalLM is not one that vLLM 0.32.0 serves"),
    # vLLM's own error where the GPU's out-of-memory would be: a KV cache that cannot hold one
    # request of the MAX_MODEL_LEN the user chose (2 MB needed, 1 MB given). Not tried again.
    "KV cache too small": (lambda models, tmp_path: engine_env(models["tiny-llama"], KV_CACHE_MEMORY_BYTES="1m"),
                           "the KV cache cannot hold one request of max_model_len (vLLM's figures are in the "
                           "worker's log); set MAX_MODEL_LEN lower"),
}
# What the log has and callers do not: vLLM's own text.
LOGGED_ONLY = {"KV cache too small": "[ValueError: To serve at least one request with the model's"}


@pytest.mark.parametrize("case", ENGINE_FAILURES)
def test_a_configuration_or_engine_failure_is_answered_on_every_job(models, tmp_path, case):
    make_env, fragment = ENGINE_FAILURES[case]
    endpoint = start(tmp_path, make_env(models, tmp_path))
    try:
        message = answered(endpoint, fragment)
        log = endpoint.log()
        assert "trying once more" not in log
        if logged := LOGGED_ONLY.get(case):
            assert logged in log and logged.strip("[") not in message
    finally:
        endpoint.stop()


# --- what callers are told, and what only the log has ---------------------------------------------

SECRET = "s3cret-pw"


@pytest.mark.parametrize("args", [(), ("--load-balancer",)], ids=["queue", "load-balancer"])
def test_a_mirrors_address_and_credentials_reach_no_caller_and_no_log_line(tmp_path, args):
    """HF_ENDPOINT names a mirror with credentials, on a port nothing listens on: callers learn that
    the hub (HF_ENDPOINT) cannot be reached; the log has the address, its credentials masked."""
    port = free_port()
    env = {"HF_ENDPOINT": f"http://mirror-user:{SECRET}@127.0.0.1:{port}", "HF_HUB_OFFLINE": "0",
           "HF_HOME": str(tmp_path / "hf-home"), "MODEL_NAME": "org/smol", "HF_TOKEN": "",
           "VLLM_CONFIG_FILE": "/nonexistent/vllm_config.yaml",
           "LOCAL_MODEL_ARGS_FILE": "/nonexistent/local_model_args.json"}
    fragment = "MODEL_NAME='org/smol': download failed: cannot reach the hub (HF_ENDPOINT)"
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log", args=args,
                             ready_timeout=None if args else 400)
    try:
        messages = failed_start_answers(endpoint) if args else [answered(endpoint, fragment)]
        for message in messages:
            assert fragment in message and SECRET not in message and f":{port}" not in message
        log = endpoint.log()
        assert "trying once more" in log and f"HF_ENDPOINT=http://***@127.0.0.1:{port}" in log
        assert SECRET not in log and "mirror-user" not in log
    finally:
        endpoint.stop()


def test_the_caches_path_stays_in_the_log(models, tmp_path):
    cache = tmp_path / "hf-home"
    env = engine_env(models["tiny-llama"], MODEL_NAME="org/absent", HF_HOME=str(cache), HF_HUB_OFFLINE="1")
    endpoint = start(tmp_path, env)
    try:
        message = answered(endpoint, "MODEL_NAME='org/absent' is not in the Hugging Face cache (HF_HOME), "
                                     "and HF_HUB_OFFLINE is set")
        assert str(tmp_path) not in message
        assert f"[the cache: {cache / 'hub'}]" in endpoint.log()
    finally:
        endpoint.stop()


def test_a_kv_cache_too_small_for_a_length_nobody_chose_is_fitted_and_served(models, tmp_path):
    env = engine_env(models["tiny-llama"], KV_CACHE_MEMORY_BYTES="1m", MAX_MODEL_LEN="")
    endpoint = start(tmp_path, env)
    try:
        log = endpoint.log()
        fitted = "MAX_MODEL_LEN=-1 (vLLM fitting the length to the memory)"
        assert f"Engine start failed, trying once more with {fitted}: the KV cache cannot hold" in log
        assert f"Engine started on the second try, with {fitted}" in log
        card = endpoint.http.get("/openai/v1/models").json()["data"][0]
        assert 0 < card["max_model_len"] < 2048  # vLLM fitted it to the memory
        job = endpoint.http.post("/runsync", json={"input": {
            "prompt": "Hello", "sampling_params": {"max_tokens": 3, "ignore_eos": True}}}).json()
        assert job["status"] == "COMPLETED" and job["output"][0]["usage"]["output"] == 3
    finally:
        endpoint.stop()


def test_after_the_answer_window_the_worker_exits_and_the_endpoint_restarts_it(hub, tmp_path):
    env = online(hub, tmp_path, MODEL_NAME="no-such-org/x", STARTUP_FAILURE_ANSWER_SECONDS="3")
    endpoint = start(tmp_path, env)
    try:
        answered(endpoint, "MODEL_NAME='no-such-org/x': no such repo")
        wait_for(lambda: "local-worker-0 exited with status 2" in endpoint.log(), 60)
        wait_for(lambda: endpoint.log().count("Worker could not start") >= 2, 60)  # restarted, failed again
        answered(endpoint, "MODEL_NAME='no-such-org/x': no such repo")
        assert endpoint.proc.poll() is None
    finally:
        endpoint.stop()


def test_with_no_answer_window_the_worker_exits_at_once_and_jobs_wait(hub, tmp_path):
    env = online(hub, tmp_path, MODEL_NAME="no-such-org/x", STARTUP_FAILURE_ANSWER_SECONDS="0")
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log", ready_timeout=None)
    try:
        job = endpoint.http.post("/run", json={"input": {"prompt": "Hello"}}).json()
        wait_for(lambda: endpoint.log().count("local-worker-0 exited with status 2") >= 2, 60)  # and again
        assert endpoint.http.get(f"/status/{job['id']}").json()["status"] == "IN_QUEUE"
        assert endpoint.proc.poll() is None
    finally:
        endpoint.stop()
