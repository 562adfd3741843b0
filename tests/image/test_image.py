"""The image tier: the CPU image built from this checkout with buildah (scripts/image.py reads
docker-bake.hcl as `docker buildx bake worker-cpu-baked` does), a model baked in from a local hub,
and the image's own command serving offline behind the local endpoint. Every check looks at the
image, not at the checkout: its files, its config, its layers and what its command answers.

The baked model is a gated copy of SmolLM2-135M-Instruct on the local hub, under its real repo id,
at a tag whose files differ from ``main``, with its tokenizer from another repo; the token reaches
the build only as the BuildKit secret.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema
import pytest
from build_models import build_lora
from conftest import CPU_ENV, REPO
from doc_pages import README, section
from image import Built, build, buildah, copy_context, image_config
from starts import timed
from worker.config.worker_config import VOLUME_CACHE_DIR

from tests.endpoint.local_endpoint import LocalEndpoint
from tests.hub_cache import add_cached_repo
from tests.image.layers import find_secret
from tests.image.local_hub import LocalHub

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # .runpod/tests.json's model
TOKENIZER = "local/smollm2-tokenizer"
REVISION = "v1.0"
TOKEN = "hf_imagetier_0c7d5e1b9a"  # the gated repo's token: must not be anywhere in the image
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# The worker's CPU settings, passed to each container as a user sets an endpoint's variables;
# DTYPE: the dequantised SmolLM2 answers "Paris" in float32 (see conftest.SMOLLM2_DTYPE).
COMMITS: dict[str, str] = {}  # the hub's commits by tag
OTHER_TOKEN = "hf_not_the_token"
# LoRA adapters of SmolLM2 on the hub (repo → the folder that holds the adapter), baked in as
# LORA_ADAPTERS names them: one under its repo id, one from a sub-folder under a name of its own.
ADAPTER_REPOS = {"local/smollm2-adapter": "", "local/smollm2-adapters": "customers/x/"}
LORA_ADAPTERS = "local/smollm2-adapter,customer-x=local/smollm2-adapters/customers/x"
# The endpoint gives its workers a network-check target of its own.
CONTAINER_ENV = {k: v for k, v in CPU_ENV.items()
                 if k not in ("VLLM_RPC_BASE_PATH", "NETWORK_CHECK_TARGET")} | {"DTYPE": "float32"}


@pytest.fixture(scope="module")
def hub(models, tmp_path_factory) -> Iterator[LocalHub]:
    smollm2 = models["smollm2-135m-instruct"]
    files = {p.name: p for p in smollm2.iterdir() if p.is_file()}
    model_files = {name: path for name, path in files.items() if name not in TOKENIZER_FILES}
    with LocalHub() as hub:
        # `main` has moved on to a config vLLM cannot load: only the tag's files serve.
        COMMITS[REVISION] = hub.add_repo(MODEL, model_files, tags=[REVISION], token=TOKEN)
        hub.add_repo(MODEL, {**model_files, "config.json": b'{"architectures": ["Moved"]}'}, token=TOKEN)
        hub.add_repo(TOKENIZER, {name: files[name] for name in TOKENIZER_FILES})
        hub.add_repo("local/tiny-llama", {p.name: p for p in models["tiny-llama"].iterdir() if p.is_file()})
        adapters = tmp_path_factory.mktemp("adapters")
        for repo, folder in ADAPTER_REPOS.items():
            adapter = build_lora(smollm2, adapters / repo, seed=len(folder))
            hub.add_repo(repo, {f"{folder}{p.name}": p for p in adapter.iterdir()})
        hub.add_token(OTHER_TOKEN)  # valid, of an account without access to the gated repo
        yield hub


def bake(hub: LocalHub, tag: str, token: str | None = TOKEN, context: Path = REPO, **args: str) -> Built:
    overrides = {"MODEL_NAME": MODEL, "MODEL_REVISION": REVISION, "TOKENIZER_NAME": TOKENIZER,
                 "LORA_ADAPTERS": LORA_ADAPTERS, "HF_ENDPOINT": hub.url} | args
    env = {"HF_TOKEN": token} if token else {}
    with timed("images"):
        return build("worker-cpu-baked", overrides, tag=f"localhost/worker-vllm-test:{tag}", context=context,
                     env=env)


@pytest.fixture(scope="module")
def baked(hub) -> Built:
    return bake(hub, "baked")


@contextmanager
def image_root(image: str) -> Iterator[Path]:
    """The image's file system, mounted read-only in a working container."""
    container = buildah("from", "--pull=never", image, capture_output=True).stdout.strip()
    try:
        yield Path(buildah("mount", container, capture_output=True).stdout.strip())
    finally:
        buildah("rm", container, capture_output=True)


def layers(image: str) -> list[str]:
    return image_config(image)["rootfs"]["diff_ids"]


# --- build and bake -----------------------------------------------------------------------------

def test_the_cpu_image_runs_the_worker_with_the_model_baked_in(baked, models):
    config = image_config(baked.tag)["config"]
    assert config["Cmd"] == ["python3", "/src/handler.py"] and not config.get("Entrypoint")
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["HF_HUB_OFFLINE"] == "1" and env["BASE_PATH"] == "/runpod-volume"
    assert "HF_ENDPOINT" not in env and "HF_TOKEN" not in env
    with image_root(baked.tag) as root:
        args = json.loads((root / "local_model_args.json").read_text())
        assert args["BAKED_MODEL_NAME"] == MODEL and args["BAKED_TOKENIZER_NAME"] == TOKENIZER
        model_dir = root / args["MODEL_NAME"].lstrip("/")
        tokenizer_dir = root / args["TOKENIZER_NAME"].lstrip("/")
        assert args["MODEL_NAME"].startswith("/models/") and args["TOKENIZER_NAME"].startswith("/models/")
        # The tag's files, not main's; the weights whole; the tokenizer from its own repo.
        smollm2 = models["smollm2-135m-instruct"]
        assert (model_dir / "config.json").read_bytes() == (smollm2 / "config.json").read_bytes()
        assert (model_dir / "model.safetensors").stat().st_size == (smollm2 / "model.safetensors").stat().st_size
        assert sorted(p.name for p in tokenizer_dir.iterdir()) == sorted(TOKENIZER_FILES)
        assert not (model_dir / "tokenizer.json").exists()
        assert (root / "src" / "handler.py").read_bytes() == (REPO / "src" / "handler.py").read_bytes()
        assert not (root / "tmp" / "hf-home").exists()  # the bake step's hub cache is not kept
        assert args["ENABLE_LORA"] == "true" and args["BAKED_LORA_DIR"] == "/models/loras"
        for name in ("local/smollm2-adapter", "customer-x"):
            assert sorted(p.name for p in (root / "models/loras" / name).iterdir()) == [
                "adapter_config.json", "adapter_model.safetensors"]
        assert not (root / "run" / "secrets").exists() or not list((root / "run" / "secrets").iterdir())


def test_quantization_is_recorded_for_the_worker(hub):
    built = bake(hub, "tiny", token=None, MODEL_NAME="local/tiny-llama", MODEL_REVISION="",
                 TOKENIZER_NAME="", QUANTIZATION="fp8")
    with image_root(built.tag) as root:
        args = json.loads((root / "local_model_args.json").read_text())
    assert args["QUANTIZATION"] == "fp8" and args["BAKED_MODEL_NAME"] == "local/tiny-llama"
    assert "TOKENIZER_NAME" not in args


@pytest.mark.parametrize("token", [None, OTHER_TOKEN], ids=["no token", "wrong token"])
def test_a_gated_repo_without_its_token_fails_the_build_saying_why(hub, baked, token):
    # The tag's commit by its sha: build args unlike the baked build's, whose model layer would
    # otherwise be reused (a secret is not part of a layer's cache key, with BuildKit either).
    with pytest.raises(subprocess.CalledProcessError) as failed:
        bake(hub, "gated", token=token, MODEL_REVISION=COMMITS[REVISION])
    assert f"{MODEL} (revision {COMMITS[REVISION]}) is gated" in failed.value.output
    assert "download_model.py" in failed.value.output  # the step that failed, as buildah names it


def test_a_code_change_rebuilds_only_the_code_layer(hub, baked, tmp_path):
    """A change under src/ re-runs neither the dependency step nor the model download: every layer
    but the last (COPY src/) is the same one."""
    context = copy_context(tmp_path)
    with (context / "src" / "handler.py").open("a") as f:
        f.write("# a change\n")
    rebuilt = bake(hub, "rebuilt", context=context)
    before, after = layers(baked.tag), layers(rebuilt.tag)
    assert len(before) == len(after) and before[:-1] == after[:-1] and before[-1] != after[-1]
    steps = re.split(r"^STEP \d+/\d+: ", rebuilt.output, flags=re.M)[2:]  # after FROM
    before_code = steps[:next(i for i, step in enumerate(steps) if step.startswith("COPY src/ /src/"))]
    assert any("download_model.py" in step for step in before_code)
    assert all("--> Using cache" in step for step in before_code), rebuilt.output
    print(f"rebuild after a src/ change: {rebuilt.seconds:.1f} s (first build {baked.seconds:.1f} s)")


# --- secrets ------------------------------------------------------------------------------------

def test_the_token_is_in_no_layer_history_config_or_env(baked):
    assert find_secret(baked.tag, TOKEN) == []


def test_the_search_finds_a_planted_token(tmp_path):
    """The check above can fail: a token in a file of a layer, in the env and in the history."""
    planted = tmp_path / "token"
    planted.write_text(f"token={TOKEN}\n")
    container = buildah("from", "scratch", capture_output=True).stdout.strip()
    try:
        buildah("copy", container, str(planted), "/leaked", capture_output=True)
        buildah("config", "--env", f"LEAK={TOKEN}", "--created-by", f"echo {TOKEN}", container)
        buildah("commit", "--quiet", container, "localhost/worker-vllm-test:leaky", capture_output=True)
        found = find_secret("localhost/worker-vllm-test:leaky", TOKEN)
    finally:
        buildah("rm", container, capture_output=True)
        buildah("rmi", "localhost/worker-vllm-test:leaky", check=False, capture_output=True)
    assert "buildah inspect" in found and "config" in " ".join(found)
    assert any(place.startswith("layer 0 at byte") for place in found), found


# --- the image serving offline ------------------------------------------------------------------

@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> Path:
    """The network volume: an empty folder, mounted at the image's BASE_PATH."""
    return tmp_path_factory.mktemp("runpod-volume")


@pytest.fixture(scope="module")
def endpoint(hub, baked, volume, tmp_path_factory) -> Iterator[LocalEndpoint]:
    """The baked image's own command, with the hub stopped and an empty network volume, configured
    as .runpod/tests.json configures the Hub's test endpoint."""
    hub.stop()
    hub_env = {e["key"]: e["value"] for e in json.loads((REPO / ".runpod/tests.json").read_text())["config"]["env"]}
    passed = [f"--env={k}={v}" for k, v in (CONTAINER_ENV | hub_env).items()]
    endpoint = LocalEndpoint({}, 1, tmp_path_factory.mktemp("image-endpoint") / "endpoint.log",
                             args=("--image", baked.tag, f"--volume={volume}:/runpod-volume", *passed))
    yield endpoint
    endpoint.stop()


def readme_requests() -> tuple[dict, dict]:
    """The README's raw job and OpenAI request bodies (its two curl -d arguments; the model the name
    /v1/models lists, which the README reads into $MODEL)."""
    calling = section(README, "Calling it")
    block = calling[calling.index("```bash\ncurl -s"):]
    bodies = [body.replace("'\"$MODEL\"'", MODEL)
              for body in re.findall(r"-d '(.*?)'\n", block, re.S)[:2]]
    return json.loads(bodies[0]), json.loads(bodies[1])


def test_readme_raw_job_from_the_image(endpoint):
    raw, _ = readme_requests()
    answer = endpoint.http.post("/runsync", json=raw).json()
    assert answer["status"] == "COMPLETED", answer
    assert answer["output"][0]["choices"][0]["tokens"] == ["The capital of France is Paris."]


def test_readme_openai_request_from_the_image(endpoint):
    _, chat = readme_requests()
    assert chat["model"] == MODEL  # served under its repo id, not the image's local path
    answer = endpoint.http.post("/openai/v1/chat/completions", json=chat).json()
    assert "Paris" in answer["choices"][0]["message"]["content"], answer


def test_streamed_chat_through_the_openai_client(endpoint):
    stream = endpoint.openai_client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=20, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 3 and "Paris" in "".join(chunks)


def test_the_baked_adapters_served_by_name_offline(endpoint):
    """One request at a time: on the CPU, vLLM 0.32 applies an adapter to a base-model request batched
    beside it (vllm-project/vllm#48421)."""
    client = endpoint.openai_client()

    def answer(model):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=12).choices[0].message.content

    answers = [answer(model) for model in (MODEL, "local/smollm2-adapter", "customer-x")]
    assert "Paris" in answers[0] and len(set(answers)) == 3
    listed = [card.id for card in client.models.list().data]
    assert listed[0] == MODEL and {"local/smollm2-adapter", "customer-x"} <= set(listed)


def test_the_hub_tests_pass_against_the_image(endpoint):
    """.runpod/tests.json as RunPod's Hub runs it: each test's input a job on an endpoint configured
    with the file's env, completed within the test's timeout (ms)."""
    spec = json.loads((REPO / ".runpod/tests.json").read_text())
    jsonschema.validate(spec, json.loads((REPO / "tests/schemas/tests.schema.json").read_text()))
    for test in spec["tests"]:
        job = endpoint.http.post("/run", json={"input": test["input"]}).json()
        deadline = time.monotonic() + test["timeout"] / 1000
        while (status := endpoint.http.get(f"/status/{job['id']}").json())["status"] in ("IN_QUEUE", "IN_PROGRESS"):
            assert time.monotonic() < deadline, (test["name"], status)
            time.sleep(0.2)
        assert status["status"] == "COMPLETED", (test["name"], status)
        assert "Paris" in json.dumps(status["output"]), (test["name"], status["output"])


def test_the_image_served_without_the_hub_and_cached_on_the_volume(endpoint, hub, volume):
    with pytest.raises(httpx.ConnectError):
        httpx.get(hub.url, timeout=5)  # stopped before the worker started
    log = endpoint.log()
    assert f"Compile cache: kept on the network volume, in /runpod-volume/{VOLUME_CACHE_DIR}" in log
    assert (volume / VOLUME_CACHE_DIR).is_dir()
    assert "Traceback" not in log and TOKEN not in log


@pytest.fixture(scope="module")
def balanced(endpoint, baked, volume, tmp_path_factory) -> Iterator[LocalEndpoint]:
    """The same image and settings behind a load-balancing endpoint (after the queue's tests, which
    stopped the hub): the worker serves HTTP in its container."""
    hub_env = {e["key"]: e["value"] for e in json.loads((REPO / ".runpod/tests.json").read_text())["config"]["env"]}
    passed = [f"--env={k}={v}" for k, v in (CONTAINER_ENV | hub_env).items()]
    balanced = LocalEndpoint({}, 1, tmp_path_factory.mktemp("image-balancer") / "endpoint.log",
                             args=("--load-balancer", "--image", baked.tag, f"--volume={volume}:/runpod-volume",
                                   *passed))
    yield balanced
    balanced.stop()


def test_the_same_image_serves_a_load_balancing_endpoint(balanced):
    raw, chat = readme_requests()
    answer = balanced.http.post("/runsync", json=raw).json()
    assert answer["output"][0]["choices"][0]["tokens"] == ["The capital of France is Paris."], answer
    stream = balanced.openai_client().chat.completions.create(**chat, max_tokens=20, stream=True)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert balanced.http.get("/ping").status_code == 200


# --- RunPod's model cache -------------------------------------------------------------------------

def test_the_image_serves_a_model_from_runpods_read_only_model_cache(baked, models, tmp_path):
    """RunPod mounts the cached model read-only at /runpod-volume/huggingface-cache/hub, the image's
    Hugging Face cache: the worker serves it by its repo id, with no hub (none is reachable) and no
    write there."""
    files = {p.name: p for p in models["smollm2-135m-instruct"].iterdir() if p.is_file()}
    cache = tmp_path / "model-cache" / "hub"
    snapshot = add_cached_repo(cache, "org/cached", files)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*"))
    env = CONTAINER_ENV | {"MODEL_NAME": "org/cached", "MODEL_REVISION": "main", "HF_HUB_OFFLINE": "0",
                           "HF_ENDPOINT": "http://127.0.0.1:9"}
    endpoint = LocalEndpoint({}, 1, tmp_path / "endpoint.log", args=(
        "--image", baked.tag, f"--volume={cache}:/runpod-volume/huggingface-cache/hub:ro",
        *[f"--env={k}={v}" for k, v in env.items()]))
    try:
        assert (f"Model org/cached: from RunPod's model cache (the cache is read-only), commit {snapshot.name}, "
                "no download") in endpoint.log()
        answer = endpoint.openai_client().chat.completions.create(
            model="org/cached", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=20)
        assert "Paris" in answer.choices[0].message.content
        assert sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*")) == before
    finally:
        endpoint.stop()
