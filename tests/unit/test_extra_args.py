"""VLLM_EXTRA_ARGS, worker-vllm 2.24's raw `vllm serve` flags: parsed by vLLM's own parser into one
setting per flag, above every other layer; what vLLM rejects, and the server's own flags, stop the
start naming the variable and the flag (vLLM's real parser, no engine)."""

from __future__ import annotations

import pytest

from worker.config.arg_parser import OWNED, SERVER_ONLY
from worker.config.engine_args import known_env_names, resolve_args
from worker.config.model_request import model_request
from worker.wire.errors import ConfigError

pytestmark = pytest.mark.usefixtures("capture_info", "hub_lookups_off")


def resolve(extra: str, **env: str):
    return resolve_args({"MODEL_NAME": "m", "VLLM_CONFIG_FILE": "/nonexistent",
                         "LOCAL_MODEL_ARGS_FILE": "/nonexistent", "VLLM_EXTRA_ARGS": extra, **env})


def test_each_flag_is_a_setting_of_its_own_above_the_env():
    args = resolve("--max-num-seqs 6 --served-model-name a b --max_model_len=1024 --no-enable-prefix-caching "
                   "--enforce-eager", MAX_NUM_SEQS="32", ENABLE_PREFIX_CACHING="true")
    ns = args.namespace
    assert (ns.max_num_seqs, ns.served_model_name, ns.max_model_len) == (6, ["a", "b"], 1024)
    assert (ns.enable_prefix_caching, ns.enforce_eager) == (False, True)
    assert {dest: args.flags[dest].source for dest in ("max_num_seqs", "enable_prefix_caching")} == {
        "max_num_seqs": "env VLLM_EXTRA_ARGS: --max-num-seqs",
        "enable_prefix_caching": "env VLLM_EXTRA_ARGS: --enable-prefix-caching"}
    assert args.flags["max_num_seqs"].variables == ("VLLM_EXTRA_ARGS",)


def test_it_is_split_as_a_shell_line_and_parsed_as_vllm_serve_parses():
    ns = resolve("""--override-generation-config '{"max_new_tokens": 512}' -O0
                 --compilation-config.cudagraph_mode NONE --seed 1 --seed 7
                 --middleware a.b --middleware c.d""").namespace
    assert ns.override_generation_config == {"max_new_tokens": 512}
    assert (ns.seed, ns.middleware) == (7, ["a.b", "c.d"])  # the last of a repeated flag; each append
    assert ns.compilation_config.cudagraph_mode.name == "NONE"


def test_its_flags_replay_as_the_serve_argv():
    argv = resolve("--max-num-seqs 6 --no-enable-prefix-caching").serve_argv()
    assert argv[argv.index("--max-num-seqs") + 1] == "6" and "--no-enable-prefix-caching" in argv


@pytest.mark.parametrize(("extra", "fragment"), [
    ("--no-such-flag 1", "env VLLM_EXTRA_ARGS: unrecognized arguments: --no-such-flag"),
    ("--max-model-len abc", "env VLLM_EXTRA_ARGS: argument --max-model-len: invalid"),
    ("org/model", "env VLLM_EXTRA_ARGS: 'org/model' is not a flag (name the model with --model)"),
    ('--hf-overrides \'{"a": 1', "env VLLM_EXTRA_ARGS: No closing quotation"),
    ("--help", "env VLLM_EXTRA_ARGS: --help prints `vllm serve`'s help: it is not a setting"),
    ("--port 9000", f"env VLLM_EXTRA_ARGS: --port is the worker's own: {OWNED['port']}"),
    ("--api-key secret", f"env VLLM_EXTRA_ARGS: --api-key is the worker's own: {OWNED['api_key']}"),
])
def test_what_vllm_rejects_or_the_worker_owns_stops_the_start_naming_the_flag(extra, fragment):
    with pytest.raises(ConfigError) as raised:
        resolve(extra)
    assert fragment in str(raised.value) and "secret" not in str(raised.value)


def test_the_http_servers_other_flags_are_ignored_with_the_reason(caplog):
    ns = resolve("--uvicorn-log-level warning --allowed-origins '[\"x\"]' --max-num-seqs 3").namespace
    default = resolve("").namespace
    assert (ns.uvicorn_log_level, ns.allowed_origins) == (default.uvicorn_log_level, default.allowed_origins)
    assert ns.max_num_seqs == 3
    assert f"VLLM_EXTRA_ARGS: --uvicorn-log-level ignored: {SERVER_ONLY['uvicorn_log_level']}" in caplog.text


def test_the_owned_flags_are_server_flags():
    assert set(OWNED) <= set(SERVER_ONLY) and "VLLM_EXTRA_ARGS" in known_env_names()


def test_the_model_it_names_is_the_one_preflight_fetches(tmp_path):
    env = {"VLLM_CONFIG_FILE": "/nonexistent", "LOCAL_MODEL_ARGS_FILE": "/nonexistent",
           "MODEL_NAME": "org/alias",
           "VLLM_EXTRA_ARGS": "--max-num-seqs 4 --model=org/extra --revision v2 --tokenizer org/tok"}
    request = model_request(env)
    assert (request.model.repo, request.model.revision, request.model.variable) == (
        "org/extra", "v2", "VLLM_EXTRA_ARGS --model")
    assert (request.tokenizer.repo, request.tokenizer.variable) == ("org/tok", "VLLM_EXTRA_ARGS --tokenizer")
