"""worker-vllm's environment names that vLLM 0.32 spells differently or no longer has.

``translate(env, errors)`` turns them into env texts for vLLM's own flag names, each with the
source it is reported under, so the engine-args layer parses them like any other variable:

- renamed: ``DISABLE_LOG_REQUESTS`` (and its misspelling ``DISABLE_LOGGING_REQUEST``) →
  ``ENABLE_LOG_REQUESTS`` negated, ``VLLM_ATTENTION_BACKEND`` → ``ATTENTION_BACKEND``; the new
  name wins when both are set;
- folded: ``ROPE_SCALING``/``ROPE_THETA`` → ``HF_OVERRIDES`` (``rope_parameters``), applied by
  ``MergedRope`` so that they are merged into the model's own rope parameters (vLLM replaces a
  dict-valued override whole: ``ROPE_THETA`` alone would drop the model's ``rope_type``); the
  ``SPECULATIVE_*`` family → ``SPECULATIVE_CONFIG``, with worker-vllm's meaning;
  ``LIMIT_MM_PER_PROMPT=image=2,video=1`` → vLLM's JSON;
- removed: one warning naming what to use instead, then ignored;
- worker-vllm >= 2.24's settings of its ``vllm serve`` subprocess, which an in-process engine does not
  have (``SUBPROCESS_ENV``): one warning naming each and why.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from worker.env_text import env_value, parse_bool

log = logging.getLogger(__name__)

__all__ = ["LEGACY_ENV", "SUBPROCESS_ENV", "MergedRope", "merge_rope", "translate"]

REMOVED_ENV: Mapping[str, str] = {
    "SWAP_SPACE": "vLLM V1 preempts by recomputation",
    "PREEMPTION_MODE": "vLLM V1 always preempts by recomputation",
    "PREEMPTION_CHECK_PERIOD": "vLLM V1 always preempts by recomputation",
    "PREEMPTION_CPU_CAPACITY": "vLLM V1 always preempts by recomputation",
    "WORKER_USE_RAY": "use DISTRIBUTED_EXECUTOR_BACKEND=ray",
    "TOKENIZER_POOL_SIZE": "tokenization runs in the API process",
    "TOKENIZER_POOL_TYPE": "tokenization runs in the API process",
    "TOKENIZER_POOL_EXTRA_CONFIG": "tokenization runs in the API process",
    "ENABLE_PROMPT_ADAPTER": "prompt adapters were removed from vLLM",
    "MAX_PROMPT_ADAPTERS": "prompt adapters were removed from vLLM",
    "MAX_PROMPT_ADAPTER_TOKEN": "prompt adapters were removed from vLLM",
    "LORA_EXTRA_VOCAB_SIZE": "removed from vLLM",
    "LONG_LORA_SCALING_FACTORS": "long-context LoRA was removed from vLLM",
    "QUANTIZATION_PARAM_PATH": "FP8 KV-cache scales are read from the checkpoint (KV_CACHE_DTYPE=fp8)",
    "NUM_LOOKAHEAD_SLOTS": "removed with the V0 engine",
    "SCHEDULER_DELAY_FACTOR": "removed with the V0 engine",
    "USE_V2_BLOCK_MANAGER": "removed with the V0 engine",
    "SPEC_DECODING_ACCEPTANCE_METHOD": "removed with the V0 engine",
    "SPECULATIVE_DISABLE_BY_BATCH_SIZE": "vLLM's speculative config no longer has disable_by_batch_size",
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_THRESHOLD": "vLLM V1 verifies draft tokens by rejection sampling",
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_ALPHA": "vLLM V1 verifies draft tokens by rejection sampling",
    "GUIDED_DECODING_BACKEND": 'use STRUCTURED_OUTPUTS_CONFIG=\'{"backend": "..."}\'',
    "DEVICE": "vLLM detects the platform",
    "MAX_SEQ_LEN_TO_CAPTURE": "use COMPILATION_CONFIG (cudagraph capture sizes)",
    "MAX_CONTEXT_LEN_TO_CAPTURE": "use COMPILATION_CONFIG (cudagraph capture sizes)",
    "TRANSFORMERS_VERSION": "transformers is fixed when the image is built; build an image "
                            "(FROM this one) that installs the version you need",
}


# worker-vllm >= 2.24 runs `vllm serve` as a subprocess and proxies jobs to it over HTTP; these
# place that server. (Its other variables are honoured: settings, engine_args, model/preflight.)
SUBPROCESS_ENV: Mapping[str, str] = {
    "VLLM_PORT": "it placed worker-vllm's `vllm serve` subprocess, and this worker runs vLLM in-process, "
                 "with no HTTP server of its own (a load-balancing worker listens on PORT); vLLM still reads "
                 "it as the first port of its internal connections",
    "VLLM_BASE_URL": "it pointed worker-vllm's proxy at its `vllm serve` subprocess, and this worker calls "
                     "vLLM's routes in-process",
}


def _negated(text: str) -> str:
    return str(not parse_bool(text)).lower()


# Old name → (new name, value conversion).
RENAMED_ENV: Mapping[str, tuple[str, Callable[[str], str]]] = {
    "VLLM_ATTENTION_BACKEND": ("ATTENTION_BACKEND", str),
    "DISABLE_LOG_REQUESTS": ("ENABLE_LOG_REQUESTS", _negated),
    "DISABLE_LOGGING_REQUEST": ("ENABLE_LOG_REQUESTS", _negated),
}


def _positive_int(text: str) -> int | None:
    """worker-vllm's reading of the speculative counts: ``0`` means unset."""
    return int(text) or None


# SPECULATIVE_* env vars → keys of vLLM's speculative config (value parser per key).
SPECULATIVE_ENV: Mapping[str, tuple[str, Callable[[str], Any]]] = {
    "SPECULATIVE_METHOD": ("method", str),
    "SPECULATIVE_MODEL": ("model", str),
    "NUM_SPECULATIVE_TOKENS": ("num_speculative_tokens", _positive_int),
    "NGRAM_PROMPT_LOOKUP_MAX": ("prompt_lookup_max", _positive_int),
    "NGRAM_PROMPT_LOOKUP_MIN": ("prompt_lookup_min", _positive_int),
    "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE": ("draft_tensor_parallel_size", int),
    "SPECULATIVE_MAX_MODEL_LEN": ("max_model_len", int),
    "SPECULATIVE_QUANTIZATION": ("quantization", str),
    "SPECULATIVE_MODEL_REVISION": ("revision", str),
    "SPECULATIVE_ENFORCE_EAGER": ("enforce_eager", parse_bool),
}
# Without one of these there is nothing to speculate with (worker-vllm ignored the rest then).
_SPECULATION_SOURCES = ("method", "model", "prompt_lookup_max")

ROPE_ENV = ("ROPE_SCALING", "ROPE_THETA")

LEGACY_ENV = frozenset({*REMOVED_ENV, *RENAMED_ENV, *SPECULATIVE_ENV, *ROPE_ENV, *SUBPROCESS_ENV})

# vLLM env name → (text, source), or None for a value already reported as an error.
Texts = dict[str, tuple[str, str] | None]


def _renamed(env: Mapping[str, str]) -> Texts:
    out: Texts = {}
    for old, (new, convert) in RENAMED_ENV.items():
        if (value := env_value(old, env)) is not None:
            log.warning("%s is deprecated, use %s", old, new)
            if env_value(new, env) is None:
                out[new] = (convert(value), f"env {old}")
    return out


def _speculative(env: Mapping[str, str], errors: list[str]) -> Texts:
    """SPECULATIVE_CONFIG from the SPECULATIVE_* variables, as worker-vllm read them."""
    config: dict[str, Any] = {}
    names = []
    for name, (key, convert) in SPECULATIVE_ENV.items():
        if (value := env_value(name, env)) is None:
            continue
        try:
            converted = convert(value)
        except ValueError as exc:
            errors.append(f"env {name}={value!r}: {exc}")
            continue
        if converted is not None:
            config[key], names = converted, [*names, name]
    if not names:
        return {}
    if env_value("SPECULATIVE_CONFIG", env) is not None:
        log.warning("SPECULATIVE_CONFIG is set: the SPECULATIVE_* variables are ignored")
        return {}
    if not any(key in config for key in _SPECULATION_SOURCES):
        log.warning("%s ignored: speculative decoding needs SPECULATIVE_METHOD, SPECULATIVE_MODEL "
                    "or NGRAM_PROMPT_LOOKUP_MAX", ", ".join(names))
        return {}
    if "method" not in config and "model" not in config:
        config["method"] = "ngram"  # only the n-gram window is given
    # With a draft model and no method, vLLM infers the method (eagle, medusa, ...) from it.
    return {"SPECULATIVE_CONFIG": (json.dumps(config), "env " + ", ".join(names))}


def _rope(env: Mapping[str, str], errors: list[str]) -> Texts:
    """HF_OVERRIDES with the rope settings folded in; an explicit HF_OVERRIDES key wins."""
    rope: dict[str, Any] = {}
    try:
        if (text := env_value("ROPE_SCALING", env)) is not None:
            if not isinstance(scaling := json.loads(text), dict):
                raise ValueError("expected a JSON object")
            rope |= scaling
        if (text := env_value("ROPE_THETA", env)) is not None:
            rope["rope_theta"] = float(text)
    except ValueError as exc:
        errors.append(f"env ROPE_SCALING/ROPE_THETA: {exc}")
        return {}
    if not rope:
        return {}
    names = [name for name in ROPE_ENV if env_value(name, env) is not None]
    log.warning("%s are deprecated, use HF_OVERRIDES='{\"rope_parameters\": {...}}'", ", ".join(names))
    overrides: Any = {"rope_parameters": rope}
    if (explicit := env_value("HF_OVERRIDES", env)) is not None:
        try:
            given = json.loads(explicit)
        except ValueError:
            return {}  # the explicit value's own error is reported where it is parsed
        if not isinstance(given, dict):
            return {}
        overrides = {**given, "rope_parameters": rope | given.get("rope_parameters", {})}
        names.append("HF_OVERRIDES")
    return {"HF_OVERRIDES": (json.dumps(overrides), "env " + ", ".join(names))}


class MergedRope:
    """vLLM's ``hf_overrides`` as a function of the model's config: ``rope_parameters`` merged into
    the model's own (into each layer type's, when they are given per layer type), the other keys
    set as given. A module-level class, so that it pickles into vLLM's engine process."""

    def __init__(self, overrides: Mapping[str, Any]) -> None:
        self.overrides = dict(overrides)

    def __call__(self, config: Any) -> Any:
        others = {key: value for key, value in self.overrides.items() if key != "rope_parameters"}
        config.update(others)
        rope = self.overrides.get("rope_parameters") or {}
        own = getattr(config, "rope_parameters", None) or {}
        if own and all(isinstance(value, dict) for value in own.values()):  # per layer type
            config.rope_parameters = {layer: {**params, **rope} for layer, params in own.items()}
        else:
            config.rope_parameters = {**own, **rope}
        return config

    def __repr__(self) -> str:
        return f"MergedRope({self.overrides!r})"


def merge_rope(hf_overrides: Any, source: str) -> Any:
    """HF_OVERRIDES as vLLM gets it: a ``MergedRope`` when the rope knobs were folded into it."""
    if isinstance(hf_overrides, dict) and any(name in source for name in ROPE_ENV):
        return MergedRope(hf_overrides)
    return hf_overrides


def _limit_mm(env: Mapping[str, str], errors: list[str]) -> Texts:
    """``image=2,video=1`` (worker-vllm's format) → vLLM's JSON; JSON passes as it is."""
    text = env_value("LIMIT_MM_PER_PROMPT", env)
    if text is None or text.startswith("{"):
        return {}
    limits = {}
    for part in text.split(","):
        key, sep, count = part.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            limits[key.strip()] = int(count)
        except ValueError:
            errors.append(f"env LIMIT_MM_PER_PROMPT: expected 'modality=count,...' or JSON, got {text!r}")
            return {"LIMIT_MM_PER_PROMPT": None}
    return {"LIMIT_MM_PER_PROMPT": (json.dumps(limits), "env LIMIT_MM_PER_PROMPT")}


def translate(env: Mapping[str, str], errors: list[str]) -> Texts:
    """vLLM env texts for the legacy names set in ``env``; they win over the same vLLM names
    (each already accounts for an explicit new name). Warns about removed knobs."""
    for name, reason in REMOVED_ENV.items():
        if env_value(name, env) is not None:
            log.warning("%s is not supported by this vLLM version and is ignored: %s", name, reason)
    for name, reason in SUBPROCESS_ENV.items():
        if env_value(name, env) is not None:
            log.warning("%s is ignored: %s", name, reason)
    return _renamed(env) | _speculative(env, errors) | _rope(env, errors) | _limit_mm(env, errors)
