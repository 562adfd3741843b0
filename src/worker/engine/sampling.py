"""``sampling_params`` of a raw job → vLLM ``SamplingParams``, or a RequestError naming the field.

Every public field of vLLM's SamplingParams is accepted (n, stop, seed, logprobs,
``structured_outputs``, ...). worker-vllm's ``guided_*`` spellings map onto structured outputs.
``max_tokens`` defaults to 100, as in worker-vllm.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec

from worker.vllm_adapter import (
    REQUEST_ERRORS,
    SAMPLING_FIELDS,
    RequestOutputKind,
    SamplingParams,
    make_sampling_params,
)
from worker.wire.errors import RequestError

__all__ = ["DEFAULT_MAX_TOKENS", "build_sampling_params"]

DEFAULT_MAX_TOKENS = 100
# worker-vllm / older vLLM names → keys of StructuredOutputsParams.
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}


def _unknown_field(name: str) -> RequestError:
    hint = difflib.get_close_matches(name, SAMPLING_FIELDS, n=1)
    suffix = f"; did you mean '{hint[0]}'?" if hint else ""
    return RequestError(f"sampling_params: unknown field '{name}'{suffix}",
                        param=f"sampling_params.{name}")


def build_sampling_params(fields: dict[str, Any], stream: bool) -> SamplingParams:
    params = {"max_tokens": DEFAULT_MAX_TOKENS, **fields}  # the caller's dict is not touched
    guided = {GUIDED_KEYS[k]: params.pop(k) for k in list(params) if k in GUIDED_KEYS}
    if guided:
        params["structured_outputs"] = {**guided, **(params.get("structured_outputs") or {})}
    for name in params:
        if name not in SAMPLING_FIELDS:
            raise _unknown_field(name)
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return make_sampling_params(params, kind)
    except msgspec.ValidationError as exc:  # "Expected `float`, got `str` - at `$.temperature`"
        where = re.search(r"at `\$\.([\w.\[\]]+)`", str(exc))
        param = f"sampling_params.{where.group(1)}" if where else "sampling_params"
        raise RequestError(f"{param}: {str(exc).split(' - at ')[0]}", param=param) from None
    except REQUEST_ERRORS as exc:
        # vLLM's checks name the field as an attribute or as the message's first word.
        name = getattr(exc, "parameter", None) or next(
            (w for w in str(exc).split()[:1] if w in SAMPLING_FIELDS), None)
        raise RequestError(f"sampling_params: {exc}",
                           param=f"sampling_params.{name}" if name else "sampling_params") from None
