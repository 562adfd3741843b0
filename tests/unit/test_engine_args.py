"""Configuration layers, env coercion and start-up errors (vLLM's real parser, no engine)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from conftest import engine_env
from packaging.version import Version
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

from worker.config.arg_parser import REVIEWED_FRONTEND, SERVER_ONLY, env_parser, unclassified_frontend_flags
from worker.config.early_settings import config_file
from worker.config.engine_args import WORKER_DEFAULTS, known_env_names, resolve_args
from worker.config.settings import env_names, load_settings
from worker.config.worker_config import load_config
from worker.env_text import BOOL_SPELLINGS, parse_bool
from worker.startup.fitness import FitnessSettings
from worker.vllm_adapter.cli import frontend_arg_dests
from worker.vllm_adapter.engine_config import VLLM_VERSION
from worker.wire.errors import ConfigError

pytestmark = pytest.mark.usefixtures("capture_info", "hub_lookups_off")


@pytest.fixture
def files(tmp_path):
    """Paths for a YAML config and a baked-args file (absent until written)."""

    class Files:
        config = tmp_path / "vllm_config.yaml"
        baked = tmp_path / "local_model_args.json"

        def env(self, **env: str) -> dict[str, str]:
            return {"VLLM_CONFIG_FILE": str(self.config),
                    "LOCAL_MODEL_ARGS_FILE": str(self.baked), **env}

        def write_yaml(self, text: str) -> None:
            self.config.write_text(text)

        def model(self, name: str) -> str:
            """A (minimal) local model folder."""
            folder = tmp_path / name
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text("{}")
            return str(folder)

        def write_baked(self, **values) -> None:
            self.baked.write_text(json.dumps(values))

    return Files()


def resolve(files, **env):
    return resolve_args(files.env(**env))


# --- precedence: one test per adjacent pair, highest first -----------------------------------

def test_extra_args_beat_aliases(files):
    args = resolve(files, MODEL_NAME="alias/model", VLLM_EXTRA_ARGS="--model extra/model")
    assert args.engine_args.model == "extra/model"
    assert args.flags["model"].source == "env VLLM_EXTRA_ARGS: --model"


def test_alias_beats_env_field(files):
    assert resolve(files, MODEL_NAME="alias/model", MODEL="field/model").engine_args.model == "alias/model"


def test_env_beats_config_file(files):
    files.write_yaml("model: m\nmax-model-len: 1024\n")
    assert resolve(files, MAX_MODEL_LEN="512").engine_args.max_model_len == 512
    assert resolve(files).engine_args.max_model_len == 1024


def test_config_file_beats_baked_args(files):
    baked = files.model("baked")
    files.write_baked(MODEL_NAME=baked, MAX_NUM_SEQS=8)
    files.write_yaml("max_num_seqs: 16\n")
    args = resolve(files).engine_args
    assert (args.model, args.max_num_seqs) == (baked, 16)


def test_baked_args_beat_worker_defaults(files):
    files.write_baked(MODEL_NAME=files.model("baked"), GPU_MEMORY_UTILIZATION=0.5)
    assert resolve(files).engine_args.gpu_memory_utilization == 0.5


def test_worker_defaults_beat_vllm_defaults(files):
    resolved = resolve(files, MODEL_NAME="m")
    assert resolved.engine_args.max_num_seqs == WORKER_DEFAULTS["max_num_seqs"]
    assert resolved.namespace.max_log_len == WORKER_DEFAULTS["max_log_len"] == 0  # vLLM's: None


def test_gpu_memory_utilization_is_the_workers_only_where_vllms_default_is_a_number(files):
    """Before vLLM 0.34 its default is 0.92, and the worker's 0.95; 0.34 resolves an unset value by
    its KV cache's sizing (1.0 for its extensible KV cache), which the worker leaves to it."""
    resolved = resolve(files, MODEL_NAME="m")
    vllm_resolves = Version(VLLM_VERSION) >= Version("0.34")
    assert resolved.engine_args.gpu_memory_utilization == (None if vllm_resolves else 0.95)
    assert ("gpu_memory_utilization" in resolved.flags) is not vllm_resolves


def test_an_out_of_memory_start_is_tried_again_below_the_utilization_vllm_resolves(models):
    """GPU_MEMORY_UTILIZATION unset: 0.1 below the worker's 0.95, or below the 0.92 that vLLM 0.34
    resolves an unset value to here (a CPU has no extensible KV cache)."""
    from worker.startup.steps import engine_failure

    note = {"type": "OutOfMemoryError", "message": "", "out_of_memory": True, "kv_cache_too_small": False}
    failure = engine_failure(RuntimeError(), note, load_config(engine_env(models["tiny-llama"])).args)
    before, after = (0.92, 0.82) if Version(VLLM_VERSION) >= Version("0.34") else (0.95, 0.85)
    assert failure.transient and failure.retry == {"gpu_memory_utilization": after}
    assert failure.change == f"GPU_MEMORY_UTILIZATION lowered from {before} to {after}"


def test_vllm_defaults_fill_the_rest(files):
    args = resolve(files, MODEL_NAME="m").engine_args
    assert (args.max_logprobs, args.enforce_eager, args.tensor_parallel_size) == (20, False, 1)


def test_sources_are_recorded(files):
    files.write_yaml("max-model-len: 1024\n")
    settings = resolve(files, MODEL_NAME="m").flags
    assert settings["model"].source == "env MODEL_NAME"
    assert settings["max_model_len"].source == "config file vllm_config.yaml max-model-len"
    assert settings["max_num_seqs"].source == "worker default"


# --- baked images ------------------------------------------------------------------------------

def test_baked_model_served_when_env_names_its_repo(files):
    snap = files.model("snap")
    files.write_baked(MODEL_NAME=snap, TOKENIZER_NAME="/models/tok",
                      BAKED_MODEL_NAME="org/model", BAKED_TOKENIZER_NAME="org/tok")
    resolved = resolve(files, MODEL_NAME="org/model", TOKENIZER_NAME="org/tok")
    args = resolved.engine_args
    assert (args.model, args.tokenizer) == (snap, "/models/tok")
    assert args.served_model_name == ["org/model"]
    assert resolved.served_repo == "org/model"


def test_env_can_replace_the_baked_model(files):
    files.write_baked(MODEL_NAME=files.model("snap"), BAKED_MODEL_NAME="org/model",
                      TOKENIZER_NAME="/models/tok", QUANTIZATION="awq")
    resolved = resolve(files, MODEL_NAME="other/model")
    args = resolved.engine_args
    assert (args.model, args.tokenizer, args.quantization) == ("other/model", None, None)
    assert resolved.served_repo is None and args.served_model_name is None


def test_explicit_served_name_wins_over_baked_repo_id(files):
    files.write_baked(MODEL_NAME=files.model("snap"), BAKED_MODEL_NAME="org/model")
    assert resolve(files, SERVED_MODEL_NAME="mine").engine_args.served_model_name == ["mine"]


def test_adapters_baked_alone_turn_lora_on_for_the_model_named_at_run_time(files):
    files.write_baked(BAKED_LORA_DIR="/models/loras", ENABLE_LORA="true")
    resolved = resolve(files, MODEL_NAME="org/model")
    assert resolved.engine_args.enable_lora and resolved.engine_args.model == "org/model"
    assert resolved.flags["enable_lora"].source == "baked local_model_args.json ENABLE_LORA"


def test_adapters_baked_with_a_model_go_with_it(files):
    files.write_baked(MODEL_NAME=files.model("snap"), BAKED_MODEL_NAME="org/model",
                      BAKED_LORA_DIR="/models/loras", ENABLE_LORA="true")
    assert resolve(files, MODEL_NAME="org/model").engine_args.enable_lora
    assert not resolve(files, MODEL_NAME="other/model").engine_args.enable_lora


@pytest.mark.parametrize(("env", "first"), [
    ({"LORA_DIRS": "/a:/b"}, ((Path("/a"), "LORA_DIRS"), (Path("/b"), "LORA_DIRS"))),
    ({"BASE_PATH": "/volume"}, ((Path("/volume/loras"), "volume"),)),
])
def test_the_image_adapters_are_searched_after_the_volumes(files, env, first):
    files.write_baked(BAKED_LORA_DIR="/models/loras", ENABLE_LORA="true")
    config = load_config(files.env(MODEL_NAME="org/model", **env))
    assert config.adapters.folders == (*first, (Path("/models/loras"), "image"))


# --- env string coercion, by the type vLLM declares ----------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("true", True), ("1", True), ("YES", True), ("on", True),
    ("false", False), ("0", False), ("No", False), ("off", False),
])
def test_booleans(files, text, expected):
    args = resolve(files, MODEL_NAME="m", ENFORCE_EAGER=text, TRUST_REMOTE_CODE=text).engine_args
    assert args.enforce_eager is expected and args.trust_remote_code is expected


def _read_boolean(read):
    try:
        return read()
    except (ConfigError, ValueError):
        return "rejected"


# Every boolean reads pydantic's spellings, in any case and with blanks around; nothing else.
@pytest.mark.parametrize(("text", "expected"), [
    *[(text, True) for text in ("true", "True", "1", "yes", "YES", "on", "t", "T", "y", " yes ")],
    *[(text, False) for text in ("false", "0", "No", "off", "f", "F", "n")],
    *[(text, "rejected") for text in ("maybe", "2", "yess", "tru", "0.0", "+1", "none", "enabled")],
])
def test_engine_legacy_and_worker_booleans_read_the_same_spellings(files, text, expected):
    engine = _read_boolean(lambda: resolve(files, MODEL_NAME="m", ENFORCE_EAGER=text).engine_args.enforce_eager)
    legacy = _read_boolean(  # DISABLE_LOG_REQUESTS is ENABLE_LOG_REQUESTS negated
        lambda: not resolve(files, MODEL_NAME="m", DISABLE_LOG_REQUESTS=text).namespace.enable_log_requests)
    worker = _read_boolean(lambda: load_settings({"RAW_OPENAI_OUTPUT": text}).raw_openai_output)
    assert engine == legacy == worker == expected


def test_a_rejected_boolean_lists_the_accepted_spellings(files):
    with pytest.raises(ConfigError) as raised:
        resolve(files, MODEL_NAME="m", ENFORCE_EAGER="maybe")
    assert f"not a boolean ({BOOL_SPELLINGS}); expected a boolean" in str(raised.value)
    for spelling in re.split(r"[,/] ?", BOOL_SPELLINGS):
        assert parse_bool(spelling) is (spelling in ("true", "1", "yes", "on", "t", "y")), spelling


def test_store_true_flag(files):
    assert resolve(files, MODEL_NAME="m", DISABLE_LOG_STATS="true").engine_args.disable_log_stats
    assert not resolve(files, MODEL_NAME="m", DISABLE_LOG_STATS="0").engine_args.disable_log_stats


def test_numbers(files):
    args = resolve(files, MODEL_NAME="m", MAX_NUM_SEQS="7", GPU_MEMORY_UTILIZATION="0.5",
                   MAX_MODEL_LEN="4k", KV_CACHE_MEMORY_BYTES="256m").engine_args
    assert (args.max_num_seqs, args.gpu_memory_utilization) == (7, 0.5)
    assert (args.max_model_len, args.kv_cache_memory_bytes) == (4000, 256_000_000)


def test_json_dicts(files):
    args = resolve(files, MODEL_NAME="m", HF_OVERRIDES='{"rope_theta": 5}',
                   SPECULATIVE_CONFIG='{"method": "ngram", "num_speculative_tokens": 2}',
                   COMPILATION_CONFIG='{"cudagraph_mode": "PIECEWISE"}').engine_args
    assert args.hf_overrides == {"rope_theta": 5}
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert str(args.compilation_config.cudagraph_mode).endswith("PIECEWISE")


@pytest.mark.parametrize("text", ["a,b", '["a", "b"]', " a , b "])
def test_lists(files, text):
    assert resolve(files, MODEL_NAME="m", SERVED_MODEL_NAME=text).engine_args.served_model_name == ["a", "b"]


def test_choices_and_optional(files):
    args = resolve(files, MODEL_NAME="m", DTYPE="bfloat16", KV_CACHE_DTYPE="fp8_e5m2",
                   REVISION="None", QUANTIZATION="fp8").engine_args
    assert (args.dtype, args.kv_cache_dtype) == ("bfloat16", "fp8_e5m2")
    assert args.revision is None and args.quantization == "fp8"


def test_empty_value_means_unset(files):
    args = resolve(files, MODEL_NAME="m", MAX_MODEL_LEN="", DTYPE="  ").engine_args
    assert args.max_model_len is None and args.dtype == "auto"


def test_a_blank_config_file_path_means_the_default_path(files):
    assert config_file({"VLLM_CONFIG_FILE": "  "}) == config_file({}) == Path("/vllm_config.yaml")
    assert config_file({"VLLM_CONFIG_FILE": f" {files.config} "}) == files.config


def test_frontend_flags_and_aliases(files):
    ns = resolve(files, MODEL_NAME="m", ENABLE_AUTO_TOOL_CHOICE="true", TOOL_CALL_PARSER="hermes",
                 OPENAI_RESPONSE_ROLE="bot", CUSTOM_CHAT_TEMPLATE="{{ messages }}",
                 RETURN_TOKENS_AS_TOKEN_IDS="1").namespace
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser, ns.response_role) == (True, "hermes", "bot")
    assert ns.chat_template == "{{ messages }}" and ns.return_tokens_as_token_ids is True


# A parser plugin, as `vllm serve --tool-parser-plugin` takes one: a file whose import registers a parser.
PLUGIN = """
from vllm.{package} import {base}, {registry}


@{registry}.register_module("{name}")
class PluginParser({base}):
    pass
"""
# (package, base class, registry), the plugin's variable and the parser's.
TOOL = ("tool_parsers", "ToolParser", "ToolParserManager"), "TOOL_PARSER_PLUGIN", "TOOL_CALL_PARSER"
REASONING = (("reasoning", "ReasoningParser", "ReasoningParserManager"), "REASONING_PARSER_PLUGIN",
             "REASONING_PARSER")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """plugin(kind, name, text=PLUGIN) → the path of a plugin file registering parser ``name``;
    vLLM's registries forget it after the test."""
    for registry in (ToolParserManager, ReasoningParserManager):
        monkeypatch.setattr(registry, "lazy_parsers", dict(registry.lazy_parsers))

    def write(kind, name, text=PLUGIN):
        (package, base, registry), _, _ = kind
        path = tmp_path / f"parser_plugin_{name.replace('-', '_')}.py"
        path.write_text(text.format(package=package, base=base, registry=registry, name=name))
        return str(path)

    return write


@pytest.mark.parametrize(("kind", "registry"), [(TOOL, ToolParserManager), (REASONING, ReasoningParserManager)],
                         ids=["tool", "reasoning"])
def test_a_parser_plugin_is_imported_so_its_parser_can_be_named(files, plugin, kind, registry):
    _, plugin_env, parser_env = kind
    resolve(files, MODEL_NAME="m", **{plugin_env: plugin(kind, "plugin-parser"), parser_env: "plugin-parser"})
    assert "plugin-parser" in registry.list_registered()


@pytest.mark.parametrize(("make", "fragments"), [
    (lambda plugin: "/nonexistent/parser_plugin.py",
     ["TOOL_PARSER_PLUGIN='/nonexistent/parser_plugin.py': no such file", "No module named"]),
    (lambda plugin: plugin(TOOL, "broken", "raise RuntimeError('plugin broke')"),
     ["TOOL_PARSER_PLUGIN=", "importing it failed: RuntimeError: plugin broke"]),
    (lambda plugin: plugin(TOOL, "other-parser"), ["TOOL_CALL_PARSER='mine': expected one of", "other-parser"]),
])
def test_a_tool_parser_plugin_that_fails_or_lacks_the_parser_is_a_config_error(files, plugin, make, fragments):
    with pytest.raises(ConfigError) as raised:
        resolve(files, MODEL_NAME="m", TOOL_PARSER_PLUGIN=make(plugin), TOOL_CALL_PARSER="mine")
    assert all(fragment in str(raised.value) for fragment in fragments), str(raised.value)


def test_frontend_flags_beyond_a_hand_written_list(files):
    resolved = resolve(files, MODEL_NAME="m", ENABLE_TOKENIZER_INFO_ENDPOINT="true",
                       FINGERPRINT_MODE="hash", TRUST_REQUEST_MM_KWARGS="1",
                       ENABLE_FLASH_LATE_INTERACTION="false")
    ns = resolved.namespace
    assert ns.enable_tokenizer_info_endpoint is True and ns.trust_request_mm_kwargs is True
    assert ns.fingerprint_mode == "hash" and ns.enable_flash_late_interaction is False
    # passed on to the engine, as `vllm serve` does
    assert resolved.engine_args.pooler_config.enable_flash_late_interaction is False


def test_every_frontend_flag_is_classified():
    assert unclassified_frontend_flags() == [], "put each in REVIEWED_FRONTEND or SERVER_ONLY"


def test_server_only_flags_are_frontend_flags_with_a_reason():
    assert SERVER_ONLY.keys() <= frontend_arg_dests(), "stale SERVER_ONLY entries"
    assert all(reason.strip() for reason in SERVER_ONLY.values())
    assert not SERVER_ONLY.keys() & REVIEWED_FRONTEND


def test_server_flags_are_not_read_from_env(files):
    ns = resolve(files, MODEL_NAME="m", PORT="1", HOST="evil", API_KEY="k", ROOT_PATH="/x").namespace
    assert (ns.port, ns.host, ns.api_key, ns.root_path) == (8000, None, None, None)
    assert not {dest.upper() for dest in SERVER_ONLY} & known_env_names()


def test_server_flags_in_the_config_file_are_ignored_with_the_reason(files, caplog):
    files.write_yaml("model: m\nport: 1\napi-key: k\n")
    ns = resolve(files).namespace
    assert (ns.port, ns.api_key) == (8000, None)
    assert f"'api-key' ignored: {SERVER_ONLY['api_key']}" in caplog.text


@pytest.mark.parametrize("text", ["a.b,c.d", '["a.b", "c.d"]'])
def test_append_flags_take_one_flag_per_item(files, text):
    assert env_parser().tokens_from_text("middleware", text) == (
        "--middleware", "a.b", "--middleware", "c.d")
    assert resolve(files, MODEL_NAME="m", MIDDLEWARE=text).namespace.middleware == ["a.b", "c.d"]


def test_append_flags_from_the_config_file_leave_the_default_alone(files):
    files.write_yaml("model: m\nmiddleware: [x.y]\n")
    assert resolve(files).namespace.middleware == ["x.y"]
    files.write_yaml("model: m\n")
    assert resolve(files).namespace.middleware == [] == env_parser().actions["middleware"].default


@pytest.mark.parametrize("text", ['[{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}]',
                                  '{"name": "a", "path": "/a"}'])
def test_lora_modules_list_or_object(files, text):
    modules = resolve(files, MODEL_NAME="m", LORA_MODULES=text).namespace.lora_modules
    assert [m.name for m in modules] == ["a", "b"][:len(modules)] and modules[0].path == "/a"


# --- special inputs ------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["image=2,video=1", '{"image": 2, "video": 1}'])
def test_limit_mm_per_prompt(files, text):
    limits = resolve(files, MODEL_NAME="m", LIMIT_MM_PER_PROMPT=text).engine_args.limit_mm_per_prompt
    assert limits == {"image": 2, "video": 1}


def test_speculative_vars_build_a_config(files):
    args = resolve(files, MODEL_NAME="m", SPECULATIVE_MODEL="org/eagle3-draft",
                   NUM_SPECULATIVE_TOKENS="3", SPECULATIVE_ENFORCE_EAGER="true").engine_args
    assert args.speculative_config == {"model": "org/eagle3-draft", "num_speculative_tokens": 3,
                                       "enforce_eager": True}


def test_speculative_config_beats_the_vars(files, caplog):
    args = resolve(files, MODEL_NAME="m", SPECULATIVE_CONFIG='{"method": "ngram"}',
                   NGRAM_PROMPT_LOOKUP_MAX="4").engine_args
    assert args.speculative_config == {"method": "ngram"}
    assert "SPECULATIVE_* variables are ignored" in caplog.text


@pytest.mark.parametrize("name", ["MAX_MODEL_LEN", "MAX_NUM_BATCHED_TOKENS"])
def test_zero_means_unset(files, name):
    args = resolve(files, MODEL_NAME="m", **{name: "0"}).engine_args
    assert getattr(args, name.lower()) is None


def test_deprecated_names_are_mapped_with_a_warning(files, caplog):
    args = resolve(files, MODEL_NAME="m", DISABLE_LOG_REQUESTS="false",
                   VLLM_ATTENTION_BACKEND="CPU_ATTN").engine_args
    assert args.enable_log_requests is True and args.attention_backend == "CPU_ATTN"
    assert "DISABLE_LOG_REQUESTS is deprecated" in caplog.text


def test_removed_knobs_warn_and_are_ignored(files, caplog):
    args = resolve(files, MODEL_NAME="m", SWAP_SPACE="4", MAX_CONTEXT_LEN_TO_CAPTURE="8192",
                   WORKER_USE_RAY="true").engine_args
    assert args.model == "m"
    for name in ("SWAP_SPACE", "MAX_CONTEXT_LEN_TO_CAPTURE", "WORKER_USE_RAY"):
        assert f"{name} is not supported" in caplog.text


def test_yaml_keys_like_vllm_serve_config(files, caplog):
    files.write_yaml("model: m\nenforce-eager: true\nspeculative_config:\n  method: ngram\n"
                     "served-model-name: [x, y]\nvllm-release: 0.32\n")
    args = resolve(files).engine_args
    assert args.enforce_eager and args.speculative_config == {"method": "ngram"}
    assert args.served_model_name == ["x", "y"]
    assert "unknown key 'vllm-release'" in caplog.text


# --- errors before the model loads ---------------------------------------------------------

@pytest.mark.parametrize(("env", "fragments"), [
    ({"MAX_MODEL_LEN": "abc"}, ["MAX_MODEL_LEN='abc'", "expected int"]),
    ({"MAX_NUM_SEQS": "1.5"}, ["MAX_NUM_SEQS='1.5'", "expected int"]),
    ({"GPU_MEMORY_UTILIZATION": "lots"}, ["GPU_MEMORY_UTILIZATION='lots'", "float"]),
    ({"ENFORCE_EAGER": "maybe"}, ["ENFORCE_EAGER='maybe'", "expected a boolean"]),
    ({"DTYPE": "float64"}, ["DTYPE='float64'", "expected one of auto, bfloat16"]),
    ({"SPECULATIVE_CONFIG": "{not json"}, ["SPECULATIVE_CONFIG='{not json'", "expected JSON"]),
    ({"COMPILATION_CONFIG": "{bad"}, ["COMPILATION_CONFIG", "expected JSON"]),
    ({"LIMIT_MM_PER_PROMPT": "image"}, ["LIMIT_MM_PER_PROMPT", "modality=count"]),
    ({"LORA_MODULES": '{"name": "a"}'}, ["LORA_MODULES", "path"]),
    ({"LORA_MODULES": "[{"}, ["LORA_MODULES", "not valid JSON"]),
    ({"NUM_SPECULATIVE_TOKENS": "three", "SPECULATIVE_MODEL": "x"}, ["NUM_SPECULATIVE_TOKENS='three'"]),
    ({"MAX_CONCURRENCY": "many"}, ["MAX_CONCURRENCY='many'", "valid integer"]),
    ({"MIN_CONCURRENCY": "8", "MAX_CONCURRENCY": "4"}, ["MIN_CONCURRENCY=8 is above MAX_CONCURRENCY=4"]),
    ({"MIN_BATCH_SIZE": "0"}, ["MIN_BATCH_SIZE='0'", "greater than or equal to 1"]),
    ({"RAW_OPENAI_OUTPUT": "sometimes"}, ["RAW_OPENAI_OUTPUT='sometimes'", "valid boolean"]),
    ({"TOOL_CALL_PARSER": "nope"}, ["TOOL_CALL_PARSER='nope'", "hermes"]),
    ({"REASONING_PARSER": "nope"}, ["REASONING_PARSER='nope'", "deepseek_r1"]),
    ({"ENABLE_AUTO_TOOL_CHOICE": "true"}, ["--enable-auto-tool-choice requires --tool-call-parser"]),
])
def test_bad_values_name_variable_value_and_expectation(files, env, fragments):
    with pytest.raises(ConfigError) as raised:
        load_config(files.env(MODEL_NAME="m", **env))
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_all_problems_reported_at_once(files):
    with pytest.raises(ConfigError) as raised:
        load_config(files.env(MODEL_NAME="m", MAX_MODEL_LEN="x", DTYPE="y", MAX_CONCURRENCY="z"))
    assert all(n in str(raised.value) for n in ("MAX_MODEL_LEN", "DTYPE", "MAX_CONCURRENCY"))


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda files: "/nonexistent/model", "no such directory"),
    (lambda files: str(files.config.parent), r"not a model folder \(no config.json\)"),
])
def test_a_model_path_that_is_not_a_model_is_an_error(files, make, fragment):
    with pytest.raises(ConfigError, match=fragment) as raised:
        resolve(files, MODEL_NAME=make(files))
    assert "env MODEL_NAME=" in str(raised.value)


def test_missing_model_is_an_error(files):
    with pytest.raises(ConfigError, match="no model configured: set MODEL_NAME"):
        resolve(files)


@pytest.mark.parametrize(("content", "fragment"), [("model: [unclosed", "not valid YAML"),
                                                   ("- a\n- b\n", "expected a mapping")])
def test_bad_config_file(files, content, fragment):
    files.write_yaml(content)
    with pytest.raises(ConfigError, match=fragment):
        resolve(files, MODEL_NAME="m")


def test_bad_baked_file(files):
    files.baked.write_text("{oops")
    with pytest.raises(ConfigError, match="baked args .* not valid JSON"):
        resolve(files, MODEL_NAME="m")


# --- warnings and secrets ------------------------------------------------------------------

@pytest.mark.parametrize(("typo", "real"), [("MAX_MODEL_LENGTH", "MAX_MODEL_LEN"),
                                            ("MAX_CONCURENCY", "MAX_CONCURRENCY"),
                                            ("ENFORCE_EAGR", "ENFORCE_EAGER"),
                                            ("VLLM_EXTRA_ARG", "VLLM_EXTRA_ARGS"),
                                            ("VLLM_STARTUP_TIMEOUTS", "VLLM_STARTUP_TIMEOUT"),
                                            ("VLLM_LOGGING_LEVE", "VLLM_LOGGING_LEVEL")])
def test_near_miss_names_get_a_suggestion(files, caplog, typo, real):
    load_config(files.env(MODEL_NAME="m", **{typo: "1"}))
    assert f"Unknown setting {typo} is ignored; did you mean {real}?" in caplog.text


def test_near_misses_of_the_fitness_checks_variables_get_a_suggestion(files, caplog):
    """They are read before the rest (startup/fitness): the start names them to load_config."""
    load_config(files.env(MODEL_NAME="m", NETWORK_CHECK_TARGT="127.0.0.1:9"), also_read=env_names(FitnessSettings))
    assert "Unknown setting NETWORK_CHECK_TARGT is ignored; did you mean NETWORK_CHECK_TARGET?" in caplog.text


def test_unrelated_names_get_no_suggestion(files, caplog):
    load_config(files.env(MODEL_NAME="m", PATH="/bin", RUNPOD_POD_ID="x", MY_APP_MODE="y", VLLM_CPU_KVCACHE_SPACE="1", LD_LIBRARY_PATH="/x",
                          VLLM_MY_OWN_THING="z"))
    assert "did you mean" not in caplog.text


def test_secrets_never_logged(files, caplog):
    caplog.set_level(logging.DEBUG)
    files.write_yaml("hf-token: hf_yamlsecret\n")
    config = load_config(files.env(MODEL_NAME="m", HF_TOKEN="hf_envsecret"))
    assert config.args.engine_args.hf_token == "hf_yamlsecret"  # from the file only
    assert "hf_yamlsecret" not in config.args.summary() and "***" in config.args.summary()
    assert "secret" not in caplog.text


def test_log_level_is_the_workers_own_in_any_case(files):
    """Not vLLM's --log-level, whose choices are capitals only: LOG_LEVEL=debug once stopped the start."""
    config = load_config(files.env(MODEL_NAME="m", LOG_LEVEL="debug"))
    assert "log_level" not in config.args.flags


# --- worker settings ------------------------------------------------------------------------

def test_worker_settings_defaults():
    s = load_settings({})
    assert (s.max_concurrency, s.min_concurrency, s.max_batch_size, s.min_batch_size,
            s.batch_size_growth_factor, s.raw_openai_output, s.openai_served_model_name_override) == (
        None, 1, 50, 1, 3.0, True, None)


def test_worker_settings_documented_spellings():
    s = load_settings({"DEFAULT_MIN_BATCH_SIZE": "2", "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "1.5",
                       "RAW_OPENAI_OUTPUT": "0", "MAX_CONCURRENCY": "8"})
    assert (s.min_batch_size, s.batch_size_growth_factor, s.raw_openai_output, s.max_concurrency) == (
        2, 1.5, False, 8)
    assert load_settings({"MIN_BATCH_SIZE": "3", "DEFAULT_MIN_BATCH_SIZE": "2"}).min_batch_size == 3


# --- security defaults --------------------------------------------------------------------------

def test_remote_code_and_request_templates_stay_off_unless_set(files):
    default = resolve(files, MODEL_NAME="m")
    assert default.engine_args.trust_remote_code is False
    assert default.namespace.trust_request_chat_template is False
    opted_in = resolve(files, MODEL_NAME="m", TRUST_REMOTE_CODE="true", TRUST_REQUEST_CHAT_TEMPLATE="1")
    assert opted_in.engine_args.trust_remote_code is True
    assert opted_in.namespace.trust_request_chat_template is True
