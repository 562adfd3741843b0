"""JSON nested too deep (``wire/nesting``): the limit, reading a batch that holds such a job, and
writing it on. The worker's paths that use it: tests/unit/test_job_loop.py (job-take),
test_load_balancer_app.py, test_endpoint_app.py; on real workers: tests/endpoint/test_local_endpoint.py
and tests/worker/test_load_balancer_worker.py."""

from __future__ import annotations

import json

import pytest

from worker.wire.nesting import MAX_DEPTH, Raw, dumps, loads, too_deep


def nested(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


def test_the_limit_counts_objects_and_arrays_and_a_raw_part_is_always_too_deep():
    assert not too_deep(json.loads(nested(MAX_DEPTH)))
    assert too_deep(json.loads(nested(MAX_DEPTH + 1)))
    four = json.loads('{"a": [{"b": {}}]}')
    assert not too_deep(four, limit=4) and too_deep(four, limit=3)
    assert not too_deep("text") and not too_deep(None) and not too_deep([1, "two", 3.0])
    assert too_deep(Raw("[[1]]")) and too_deep({"prompt": "x", "deep": [Raw("[1]")]})


def test_json_in_a_string_counts_its_levels_where_it_sits():
    """A tool call's ``arguments``, which vLLM's chat renderer parses."""
    def chat(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {"messages": [{"role": "assistant", "tool_calls": [call]}]}

    sits = 6  # the containers around ``arguments``
    assert not too_deep(chat(nested(MAX_DEPTH - sits)))
    assert too_deep(chat(nested(MAX_DEPTH - sits + 1))) and too_deep(chat(" " + nested(3000)))
    assert not too_deep(chat('{"note": "[[[[' + "[" * 200 + '"}'))  # brackets in its strings do not count
    assert not too_deep("x" + "[" * 200) and not too_deep("{" + "}" * 500)  # not JSON / not nesting
    assert too_deep(nested(MAX_DEPTH + 1)) and not too_deep(nested(MAX_DEPTH))


def test_a_batch_too_deep_to_parse_whole_is_read_job_by_job():
    """The others parse as json.loads parses them; the deep one keeps its id, its input as text."""
    good = [{"id": "a", "input": {"prompt": 'brackets in a string: [[{ \\" ]', "n": 12345678901234567890}},
            {"id": "c", "input": {"messages": [{"role": "user", "content": "hi"}]}}]
    deep = nested(5000)
    batch = json.dumps([good[0], {"input": {"x": "PLACE"}, "id": "b"}, good[1]]).replace('"PLACE"', deep)
    with pytest.raises(RecursionError):
        json.loads(batch)
    first, middle, last = loads(batch.encode(), levels=2)
    assert [first, last] == good
    assert middle == {"input": Raw(f'{{"x": {deep}}}'), "id": "b"} and too_deep(middle["input"])


def test_what_parses_whole_is_json_loads_own_answer():
    text = '{"a": [1, 2.5, null, true], "b": {"c": "d"}}'
    assert loads(text, levels=2) == json.loads(text)
    assert loads(nested(5000), levels=0) == Raw(nested(5000))


@pytest.mark.parametrize("text", [
    nested(5000) + " trailing", "[" + nested(5000), '{"a": ' + nested(5000) + ", 2}",
    "[" + nested(5000) + ', "k": 2]', '{"a": ' + nested(5000) + ", 1: 2}"])
def test_text_that_is_not_json_is_a_value_error(text):
    """Text that fails only past the point where json.loads gave up: the splitter's own checks."""
    with pytest.raises(ValueError):  # noqa: PT011 - json.loads raises it too, with its own messages
        loads(text, levels=2)


def test_dumps_writes_a_raw_part_as_it_came():
    deep = nested(5000)
    jobs = [{"id": "a", "input": {"prompt": "x"}}, {"id": "b", "input": Raw(deep)}]
    assert dumps(jobs) == '[{"id": "a", "input": {"prompt": "x"}}, {"id": "b", "input": ' + deep + "}]"
    assert loads(dumps(jobs), levels=2) == jobs
    assert dumps({"a": [1, "x"]}) == json.dumps({"a": [1, "x"]})
    with pytest.raises(TypeError):
        dumps({"a": object()})
