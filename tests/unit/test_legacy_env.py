"""worker-vllm's environment names: each honoured, mapped to vLLM 0.32's, or warned about; the
speculative variables' meaning; the default parallelism; prompt-free request logs."""

from __future__ import annotations

import json
import re

import hcl2
import pytest
from conftest import REPO

from worker.config import engine_args
from worker.config.engine_args import known_env_names, resolve_args
from worker.wire.errors import ConfigError
from worker.config.legacy_env import REMOVED_ENV, RENAMED_ENV, ROPE_ENV, SPECULATIVE_ENV, SUBPROCESS_ENV, MergedRope
from worker.config.settings import WorkerSettings, env_names
from worker.config.worker_config import load_config

pytestmark = pytest.mark.usefixtures("capture_info", "hub_lookups_off")

NAMES_FILE = REPO / "tests" / "data" / "worker_vllm_env_names.txt"
REFERENCE = REPO.parent / "shared" / "reference"

# Names in worker-vllm's docs that are not variables of the worker, each with its reason.
NOT_WORKER_ENV = {
    # code identifiers and placeholders, not variables
    **dict.fromkeys(["DEFAULT_ARGS", "ENV_ALIASES", "REMOVED_FLAGS", "RENAME_ARGS_MAP", "UPPER_SNAKE",
                     "FIELD_NAME", "BAD_REQUEST", "BASE_DIR", "DEFAULT_MAX_CONCURRENCY",
                     "ADA_80_PRO", "AMPERE_80", "VLLM_RUNPOD_"], "not a variable"),
    # read by the libraries and tools themselves
    **dict.fromkeys(["HF_TOKEN", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE",
                     "HF_HUB_ENABLE_HF_TRANSFER", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                     "TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS", "RAY_DISABLE_USAGE_STATS",
                     "RAY_METRICS_EXPORT_ENABLED", "PYTORCH_ALLOC_CONF", "VLLM_USE_DEEP_GEMM",
                     "LD_LIBRARY_PATH"], "read by huggingface_hub, transformers, ray, torch or vLLM"),
    # the client's side of RunPod's API
    **dict.fromkeys(["RUNPOD_API_KEY", "ENDPOINT_ID", "API_KEY"], "a client's setting"),
    # RunPod's and its SDK's: the job protocol and the SDK's fitness checks
    **dict.fromkeys(["RUNPOD_WEBHOOK_GET_JOB", "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS", "RUNPOD_SKIP_GPU_CHECK",
                     "RUNPOD_MIN_MEMORY_GB", "RUNPOD_MIN_DISK_PERCENT", "RUNPOD_NETWORK_CHECK_TIMEOUT",
                     "RUNPOD_MIN_CUDA_VERSION", "RUNPOD_GPU_BENCHMARK_TIMEOUT", "RUNPOD_GPU_TEST_TIMEOUT",
                     "RUNPOD_DEFER_FITNESS_CHECKS", "RUNPOD_FITNESS_CHECKS_DONE"], "read by the runpod SDK"),
    # worker-vllm's own build and test scaffolding
    **dict.fromkeys(["DOCKER_BUILDKIT", "HUGGINGFACE_ACCESS_TOKEN", "WORKER_CUDA_VERSION",
                     "TESTING_DOWNLOAD", "TENSORIZER_NUM_GPUS"],
                    "worker-vllm's build scaffolding (the HF token is a BuildKit secret here)"),
}


def documented_names() -> set[str]:
    return {line.strip() for line in NAMES_FILE.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def image_names() -> set[str]:
    """Build args and image variables: the Dockerfile's ARG/ENV and the bake file's variables."""
    dockerfile = (REPO / "Dockerfile").read_text()
    names = set(re.findall(r"^ARG (\w+)", dockerfile, re.M))
    names |= set(re.findall(r"(?:^ENV|\\\n)\s+(\w+)=", dockerfile, re.M))
    bake = hcl2.loads((REPO / "docker-bake.hcl").read_text())
    return names | {name.strip('"') for variable in bake["variable"] for name in variable}


def resolve(**env):
    return resolve_args({"MODEL_NAME": "m", "VLLM_CONFIG_FILE": "/nonexistent",
                         "LOCAL_MODEL_ARGS_FILE": "/nonexistent", **env})


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="shared/reference is not beside this clone")
def test_the_name_list_covers_the_reference_docs():
    text = "".join(path.read_text() for path in
                   (REFERENCE / "worker_vllm_spec.md", REFERENCE / "runpod-today.md", *REFERENCE.glob("000_*.txt")))
    assert set(re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*[A-Z0-9]\b", text)) <= documented_names()


def test_every_documented_name_is_honoured_mapped_warned_or_not_ours():
    honoured = known_env_names() | env_names(WorkerSettings) | image_names() | {"LOG_LEVEL"}
    unclassified = documented_names() - honoured - set(NOT_WORKER_ENV)
    assert unclassified == set()
    # Legacy names are read only to be mapped or warned about (the tests below check each).
    assert {*REMOVED_ENV, *RENAMED_ENV, *ROPE_ENV, *SPECULATIVE_ENV} <= known_env_names()


@pytest.mark.parametrize("name", sorted(REMOVED_ENV))
def test_removed_knobs_warn_once_naming_the_replacement(name, caplog):
    args = resolve(**{name: "1"})
    assert args.flags.keys() == resolve().flags.keys()  # nothing else changed
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warnings) == 1 and "ignored: " + REMOVED_ENV[name] in warnings[0]


@pytest.mark.parametrize("name", sorted(SUBPROCESS_ENV))
def test_worker_vllm_subprocess_settings_warn_once_saying_why(name, caplog):
    args = resolve(**{name: "8000"})
    assert args.flags.keys() == resolve().flags.keys()
    warnings = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert warnings == [f"{name} is ignored: {SUBPROCESS_ENV[name]}"]


@pytest.mark.parametrize("name", ["DISABLE_LOG_REQUESTS", "DISABLE_LOGGING_REQUEST"])
@pytest.mark.parametrize(("text", "enabled"), [("false", True), ("true", False)])
def test_disable_log_requests_names_are_mapped(name, text, enabled, caplog):
    args = resolve(**{name: text})
    assert args.engine_args.enable_log_requests is enabled
    assert args.flags["enable_log_requests"].source == f"env {name}"
    assert f"{name} is deprecated, use ENABLE_LOG_REQUESTS" in caplog.text


def test_rope_settings_become_hf_overrides_rope_parameters(caplog):
    args = resolve(ROPE_SCALING='{"rope_type": "yarn", "factor": 4.0}', ROPE_THETA="500000")
    assert isinstance(args.engine_args.hf_overrides, MergedRope)
    assert args.engine_args.hf_overrides.overrides == {
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0}}
    assert "ROPE_SCALING, ROPE_THETA are deprecated" in caplog.text


def test_explicit_hf_overrides_win_and_keep_their_other_keys():
    args = resolve(ROPE_THETA="500000", ROPE_SCALING='{"factor": 4.0}',
                   HF_OVERRIDES='{"rope_parameters": {"factor": 8.0}, "architectures": ["X"]}')
    assert args.engine_args.hf_overrides.overrides == {
        "rope_parameters": {"factor": 8.0, "rope_theta": 500000.0}, "architectures": ["X"]}
    assert args.flags["hf_overrides"].source == "env ROPE_SCALING, ROPE_THETA, HF_OVERRIDES"


def test_hf_overrides_alone_reach_vllm_as_given():
    overrides = {"rope_parameters": {"rope_theta": 1.0, "rope_type": "default"}}
    assert resolve(HF_OVERRIDES=json.dumps(overrides)).engine_args.hf_overrides == overrides


@pytest.mark.parametrize(("env", "expected"), [
    ({"ROPE_THETA": "10000"}, {"rope_theta": 10000.0, "rope_type": "default"}),
    ({"ROPE_SCALING": '{"rope_type": "linear", "factor": 2.0}'},
     {"rope_theta": 100000.0, "rope_type": "linear", "factor": 2.0}),
    ({"ROPE_SCALING": '{"factor": 2.0}'}, {"rope_theta": 100000.0, "rope_type": "default", "factor": 2.0}),
])
def test_each_rope_knob_alone_merges_into_the_models_rope_parameters(smol_env, env, expected):
    """SmolLM2's config has rope_parameters {rope_theta: 100000, rope_type: default}: a knob set
    alone changes its own key and keeps the others (vLLM's dict override would replace them all,
    and then fail with KeyError 'rope_type' while building its configuration)."""
    config = load_config({**smol_env, **env}).args.engine_config()
    assert config.model_config.hf_config.rope_parameters == expected


def test_a_rejected_engine_configuration_names_the_variables_that_caused_it(smol_env):
    bad = {"HF_OVERRIDES": '{"rope_parameters": {"rope_theta": 10000.0}}', "MAX_NUM_SEQS": "8"}
    with pytest.raises(ConfigError) as raised:
        load_config({**smol_env, **bad}).args.engine_config()
    assert str(raised.value).startswith("invalid configuration:\n  env HF_OVERRIDES: ")
    assert "rope_type" in str(raised.value)
    assert raised.value.variables == ("HF_OVERRIDES",)


@pytest.mark.parametrize(("env", "fragment"), [
    ({"ROPE_SCALING": "[1]"}, "expected a JSON object"),
    ({"ROPE_THETA": "big"}, "could not convert"),
])
def test_bad_rope_values_are_configuration_errors(env, fragment):
    with pytest.raises(Exception, match=fragment) as raised:
        resolve(**env)
    assert "ROPE_SCALING/ROPE_THETA" in str(raised.value)


# --- speculative decoding, as worker-vllm read the variables ------------------------------------

@pytest.mark.parametrize(("env", "config"), [
    ({"NGRAM_PROMPT_LOOKUP_MAX": "4", "NUM_SPECULATIVE_TOKENS": "3"},
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}),
    ({"NGRAM_PROMPT_LOOKUP_MAX": "4", "NGRAM_PROMPT_LOOKUP_MIN": "0", "NUM_SPECULATIVE_TOKENS": "0"},
     {"method": "ngram", "prompt_lookup_max": 4}),
    ({"SPECULATIVE_MODEL": "org/draft", "NGRAM_PROMPT_LOOKUP_MAX": "4"},
     {"model": "org/draft", "prompt_lookup_max": 4}),  # vLLM infers the method from the model
    ({"SPECULATIVE_METHOD": "suffix", "NUM_SPECULATIVE_TOKENS": "5"},
     {"method": "suffix", "num_speculative_tokens": 5}),
    ({"SPECULATIVE_MODEL": "org/draft", "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE": "0"},
     {"model": "org/draft", "draft_tensor_parallel_size": 0}),  # 0 is kept where worker-vllm kept it
])
def test_speculative_variables_keep_worker_vllms_meaning(env, config):
    args = resolve(**env)
    assert args.engine_args.speculative_config == config
    named = [name for name, value in env.items() if value != "0" or name.startswith("SPECULATIVE_")]
    assert args.flags["speculative_config"].source == "env " + ", ".join(
        name for name in SPECULATIVE_ENV if name in named)


@pytest.mark.parametrize("env", [{"NUM_SPECULATIVE_TOKENS": "3"},
                                 {"NGRAM_PROMPT_LOOKUP_MAX": "0", "NUM_SPECULATIVE_TOKENS": "3"}])
def test_speculative_counts_alone_are_ignored_with_a_warning(env, caplog):
    assert resolve(**env).engine_args.speculative_config is None
    assert "NUM_SPECULATIVE_TOKENS ignored: speculative decoding needs" in caplog.text


# --- parallelism over the visible GPUs -----------------------------------------------------------

@pytest.mark.parametrize(("gpus", "env", "expected"), [
    (4, {}, {"tensor_parallel_size": 4, "pipeline_parallel_size": 1}),
    (4, {"TENSOR_PARALLEL_SIZE": "2"}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}),
    (4, {"PIPELINE_PARALLEL_SIZE": "2"}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 2}),
    (4, {"DATA_PARALLEL_SIZE": "4"}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}),
    (1, {}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}),
    (0, {}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}),
])
def test_all_visible_gpus_are_used_unless_parallelism_is_set(monkeypatch, caplog, gpus, env, expected):
    monkeypatch.setattr(engine_args, "visible_gpu_count", lambda: gpus)
    args = resolve(**env).engine_args
    assert {dest: getattr(args, dest) for dest in expected} == expected
    if gpus > 1:  # the decision is logged
        assert f"{gpus} GPUs visible" in caplog.text
        if not env:
            assert resolve().flags["tensor_parallel_size"].source == "4 visible GPUs"
    else:
        assert "GPUs visible" not in caplog.text


# --- logs ------------------------------------------------------------------------------------------

def test_request_logs_carry_no_prompt_text_unless_max_log_len_is_set():
    assert resolve(ENABLE_LOG_REQUESTS="true").namespace.max_log_len == 0
    assert resolve(ENABLE_LOG_REQUESTS="true", MAX_LOG_LEN="500").namespace.max_log_len == 500


def test_vllm_api_key_is_reported_as_ignored_unless_blank(caplog):
    env = {"MODEL_NAME": "m", "VLLM_CONFIG_FILE": "/nonexistent", "LOCAL_MODEL_ARGS_FILE": "/nonexistent"}
    load_config({**env, "VLLM_API_KEY": " "})
    assert "VLLM_API_KEY" not in caplog.text
    load_config({**env, "VLLM_API_KEY": "sk-secret"})
    assert "VLLM_API_KEY is ignored" in caplog.text and "sk-secret" not in caplog.text


def test_legacy_settings_show_in_the_summary_under_their_own_names():
    summary = resolve(NGRAM_PROMPT_LOOKUP_MAX="4").summary()
    assert "speculative_config=" in summary and "(env NGRAM_PROMPT_LOOKUP_MAX)" in summary
    assert json.loads(resolve(NGRAM_PROMPT_LOOKUP_MAX="4").flags["speculative_config"].value) == {
        "method": "ngram", "prompt_lookup_max": 4}
