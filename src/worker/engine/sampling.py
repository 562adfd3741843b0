"""``sampling_params`` of a raw job → vLLM ``SamplingParams``, or a RequestError naming the field;
and where a request parameter belongs in a job (``check_top_level``).

Every public field of vLLM's SamplingParams is accepted (n, stop, seed, logprobs,
``structured_outputs``, ...). worker-vllm's ``guided_*`` spellings map onto structured outputs.
``max_tokens`` defaults to 100, as in worker-vllm.
"""

from __future__ import annotations

import difflib
import logging
import re
from typing import TYPE_CHECKING, Any

import msgspec

from worker.vllm_adapter.errors import REQUEST_ERRORS
from worker.vllm_adapter.raw_jobs import (REQUEST_FIELDS, SAMPLING_FIELDS, RequestOutputKind,
                                          SamplingParams, make_sampling_params)
from worker.wire.errors import RequestError

if TYPE_CHECKING:
    from worker.jobs.job_input import JobInput

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_TOKENS", "LABELS", "build_sampling_params", "check_top_level"]

DEFAULT_MAX_TOKENS = 100
# worker-vllm / older vLLM names → keys of StructuredOutputsParams.
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}


# Keys that, at a job input's top level, are request parameters put in the wrong place (nothing reads
# them there: worker-vllm's issue #235, with guided_json): SamplingParams' fields and worker-vllm's
# guided_* spellings, and the fields of the OpenAI request bodies (the openai format's sampling_params),
# but those that only label a request (who sent it, the session, the id an answer carries) and change
# nothing in the answer's content: a client may put them beside the prompt, and worker-vllm ignores them.
LABELS = frozenset({"user", "request_id", "session_id"})
_SAMPLING_KEYS = SAMPLING_FIELDS | frozenset(GUIDED_KEYS)
_MISPLACED_KEYS = (_SAMPLING_KEYS | REQUEST_FIELDS) - LABELS
_SHOWN_KEYS, _SHOWN_KEY_CHARS = 10, 40  # a log line names this many unread keys, this long at most


def _misplaced(key: str, job: JobInput, raw_format: str) -> RequestError:
    where = "the input's top level is not read"
    if job.openai_route is not None:
        advice = "the request body goes in 'openai_input'"
    elif raw_format == "openai" or key in _SAMPLING_KEYS:
        advice = "request parameters go in 'sampling_params'"
    else:  # an OpenAI body field the tokens format's SamplingParams lacks (response_format, tools)
        advice = ("it is a field of OpenAI's request body, which a raw job sends as 'sampling_params' with "
                  "RAW_JOB_FORMAT=openai (or send the job to 'openai_route'); this worker's raw format "
                  "takes vLLM's SamplingParams in 'sampling_params'")
    return RequestError(f"'{key}' at {where}: {advice}", param=key)


def check_top_level(job: JobInput, raw_format: str, job_id: object = None) -> None:
    """Refuse a request parameter at the input's top level; warn once about the other keys no field
    reads, which are ignored. ``raw_format``: RAW_JOB_FORMAT (the advice differs)."""
    unread = job.unread_keys
    if misplaced := next((key for key in unread if key in _MISPLACED_KEYS), None):
        raise _misplaced(misplaced, job, raw_format)
    if unread:
        shown = ", ".join(repr(key[:_SHOWN_KEY_CHARS]) for key in unread[:_SHOWN_KEYS])
        more = f" and {len(unread) - _SHOWN_KEYS} more" if len(unread) > _SHOWN_KEYS else ""
        log.warning("Job %s: input keys %s%s are not read (ignored)", job_id, shown, more)


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
