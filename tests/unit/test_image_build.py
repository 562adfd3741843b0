"""The pure parts of building and running the image here: docker-bake.hcl read as bake reads it
(scripts/image.py), the secret handed to buildah, and what a worker's container gets of the
endpoint's environment (endpoint/container.py). The builds themselves are the image tier's."""

from __future__ import annotations

import stat
from pathlib import Path

import image

from endpoint.container import container_env


def test_a_variable_comes_from_set_then_the_environment_then_its_default(monkeypatch):
    monkeypatch.delenv("MODEL_NAME", raising=False)
    monkeypatch.setenv("RELEASE_VERSION", "v9")
    variables = image.bake_variables({"MODEL_NAME": "org/m"})
    assert (variables["MODEL_NAME"], variables["RELEASE_VERSION"], variables["BASE_PATH"]) == (
        "org/m", "v9", "/runpod-volume")
    assert image.bake_variables({"RELEASE_VERSION": "v10"})["RELEASE_VERSION"] == "v10"


def test_targets_inherit_args_and_contexts_and_resolve_their_values(monkeypatch):
    monkeypatch.delenv("MODEL_NAME", raising=False)
    target = image.bake_target("worker-cpu-baked", {"MODEL_NAME": "org/m", "HF_ENDPOINT": "http://hub"})
    assert target.args["MODEL_NAME"] == "org/m" and target.args["HF_ENDPOINT"] == "http://hub"
    assert target.args["BASE_IMAGE"] == "vllm-cpu-base"
    assert target.contexts == {"vllm-cpu-base": "target:cpu-base"}
    assert target.secrets == ("id=HF_TOKEN,env=HF_TOKEN",)
    assert image.bake_target("worker-next").args["VLLM_VERSION"] == image.bake_variables()["NEXT_VLLM_VERSION"]


def test_the_token_reaches_buildah_as_a_private_file_and_only_when_set():
    with image._secret_files(["id=HF_TOKEN,env=HF_TOKEN"], {"HF_TOKEN": "hf_x"}) as options:
        assert options[0] == "--secret" and options[1].startswith("id=HF_TOKEN,src=")
        path = Path(options[1].split("src=")[1])
        assert path.read_text() == "hf_x" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not path.exists()
    with image._secret_files(["id=HF_TOKEN,env=HF_TOKEN"], {}) as options:
        assert options == []


def test_a_container_gets_runpods_variables_and_those_named():
    env = {"RUNPOD_POD_ID": "w0", "RUNPOD_WEBHOOK_GET_JOB": "http://x", "PYTHONUNBUFFERED": "1",
           "PATH": "/host/bin", "VIRTUAL_ENV": "/host/.venv", "HF_TOKEN": "hf_host", "DTYPE": "float32"}
    assert container_env(env, ["DTYPE", "MAX_MODEL_LEN=512", "ABSENT"]) == {
        "RUNPOD_POD_ID": "w0", "RUNPOD_WEBHOOK_GET_JOB": "http://x", "PYTHONUNBUFFERED": "1",
        "DTYPE": "float32", "MAX_MODEL_LEN": "512"}


def test_the_debian_mirror_is_the_one_apt_uses():
    assert image.debian_mirror().startswith(("http://", "https://")) and image.debian_mirror().endswith("/debian")


def test_a_copied_context_holds_all_that_the_dockerignore_admits():
    admitted = [line[1:].rstrip("/") for line in (image.REPO / ".dockerignore").read_text().splitlines()
                if line.startswith("!")]
    assert admitted and all(any(path == name or path.startswith(f"{name}/") for name in image.CONTEXT_FILES)
                            for path in admitted)
