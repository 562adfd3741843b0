"""Every measured figure the README and docs/ quote is backed by name by the result it comes from.

A figure is a number in prose or a table (outside code blocks, inline code and link targets): one with
a decimal point that is followed by a unit of a measurement (`1.04×`, `36.8 s`, `23.09 ms`, `4.74 µs`,
`1.5 %`, `31.4 minutes`) or has two or more decimals (a bare ratio: `0.977`, `1.04`), or a whole number
of minutes (`50 min`, both ends of `25 to 28 minutes`; `26 min 3 s` is one figure, in minutes to the
second). Versions (`vLLM 0.32`, `worker-vllm 2.24`) are not figures. bench/quoted_figures.yaml names,
for each page and figure, the result in bench/RESULTS.md it comes from: a table cell (part, row,
column) or a number in one of a part's notes. The figure is that result rounded at the figure's own
precision (`33.6 s` for `33.62 s`). Numbers that are not measurements are allowed one by one below,
each with its reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import yaml

from doc_pages import REPO, _outside_code, pages

RESULTS = REPO / "bench" / "RESULTS.md"
REGISTRY = REPO / "bench" / "quoted_figures.yaml"

# Figures that are not benchmark results: (page, the figure as written) → why.
GPU_MEMORY = "a GPU_MEMORY_UTILIZATION value (a setting: the worker's, vLLM's or the retry's)"
VLLM_PUBLISHED = "vLLM's default/published figure, not measured here"
NOT_MEASURED = {
    ("benchmarks.md", "0.99"): "item 1's goal",
    ("benchmarks.md", "0.95"): "a goal (items 11, 21 and 22)",
    ("benchmarks.md", "1.05"): "item 22's goal",
    ("benchmarks.md", "0.3"): "item 7's stub jobs' length, a bench setting",
    ("benchmarks.md", "0.85"): "item 20's goals (issue 56)",
    ("benchmarks.md", "1.15"): "item 20's goals (issue 56)",
    ("cold-start.md", "0.2"): "an example of the log line (inline code across a line break)",
    ("compatibility.md", "0.1"): "JOB_TAKE_LATENCY's default, a setting",
    ("compatibility.md", "0.95"): GPU_MEMORY,
    ("compatibility.md", "0.85"): GPU_MEMORY,
    ("compatibility.md", "0.92"): GPU_MEMORY,
    ("concurrency.md", "0.1"): "JOB_TAKE_LATENCY's default; the runpod SDK's wait before a taken job starts",
    ("concurrency.md", "0.2"): "the job take the adaptive-concurrency test sets",
    ("concurrency.md", "30.8"): VLLM_PUBLISHED,
    ("concurrency.md", "31.8"): VLLM_PUBLISHED,
    ("configuration.md", "0.92"): GPU_MEMORY,
    ("development.md", "25"): "the suite's budget, half of main's time before issue 53 (a goal)",
    ("development.md", "0.92"): GPU_MEMORY,
    ("development.md", "0.95"): GPU_MEMORY,
    ("image.md", "3.61"): "the image's size, as buildah reports it (docs/image.md), not a bench figure",
    ("image.md", "3.68"): "the image's size with the test lock, as buildah reports it",
    ("load-balancer.md", "2"): "how long the balancer waits for a ready worker, RunPod's setting",
    ("load-balancer.md", "5.5"): "RunPod's limit on a load-balanced request",
    ("local-endpoint.md", "0.5"): "the balancer's readiness poll interval, a setting",
    ("local-endpoint.md", "5"): "how long a strict affinity waits for its worker, a setting",
    ("startup-failures.md", "0.92"): GPU_MEMORY,
    ("startup-failures.md", "0.95"): GPU_MEMORY,
    ("startup-failures.md", "0.85"): GPU_MEMORY,
}

# vLLM's and worker-vllm's versions, also where the sentence names them once for two ("0.32 and 0.33").
VERSIONS = {"0.32", "0.33", "0.34", "2.24", "2.27"}
UNIT = r"\s?(?:×|x\b|s\b|ms\b|µs\b|%|min\b|minutes\b)"
# A number with a decimal point, not part of a longer dotted number (1.10.0) or a word.
DECIMAL = re.compile(rf"(?<![\w.])(\d+\.(\d+))(?![\w.]|\.\d)({UNIT})?")
MINUTES = re.compile(r"(?<![\w.,])(\d+)(?: to (\d+))? (?:min(?: (\d+) s)?\b|minutes\b)")
VERSION_BEFORE = re.compile(r"(?:vLLM|vllm|worker-vllm|torch|Python|glibc|runpod|openai|CUDA|v)\s?$")
# A number in RESULTS.md's text: thousands separators allowed, none inside a word (a commit's 7a57).
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


def _decimals(line: str) -> list[tuple[int, str]]:
    found = []
    for match in DECIMAL.finditer(line):
        number, decimals, unit = match.groups()
        version = number in VERSIONS or VERSION_BEFORE.search(line[:match.start()])
        if not version and not line[match.end():].startswith(("+", "'s")) and (unit or len(decimals) >= 2):
            found.append((match.start(), number))
    return found


def _minutes(line: str) -> list[tuple[int, str]]:
    found = []
    for match in MINUTES.finditer(line):
        first, last, seconds = match.groups()
        found.append((match.start(), f"{first} min {seconds} s" if seconds else first))
        if last:
            found.append((match.start(2), last))
    return found


def figures(text: str) -> list[str]:
    """The measured figures in ``text`` (a page), as written, in order."""
    found = []
    for line in _outside_code(text):
        line = re.sub(r"`[^`]*`", "", line)  # inline code: settings' values, log lines
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets
        found += [figure for _, figure in sorted(_decimals(line) + _minutes(line))]
    return found


def value(text: str) -> Decimal:
    """The first number in ``text``, without its unit or thousands separators; `26 min 3 s` in minutes."""
    match = re.search(rf"({NUMBER.pattern})(?: min (\d+) s\b)?", text)
    if not match:
        raise LookupError(f"no number in {text!r}")
    number = Decimal(match[1].replace(",", ""))
    return number + Decimal(match[2]) / 60 if match[2] else number


def held(figure: str, number: Decimal) -> bool:
    """Whether ``number`` rounds to ``figure`` at its precision (a second for `26 min 3 s`)."""
    if " min " in figure:
        step = Decimal(1) / 60
    else:
        step = Decimal(1).scaleb(-len(figure.partition(".")[2]))
    return abs(number - value(figure)) <= step / 2


def parts() -> dict[str, str]:
    """RESULTS.md's sections by part name."""
    found = re.findall(r"<!-- part (\S+) -->\n(.*?)<!-- end of part \1 -->", RESULTS.read_text(), re.S)
    return dict(found)


def rows(part: str) -> list[dict[str, str]]:
    """Each row of each table of a part, as its table's header → its cell."""
    found, header = [], None
    for line in part.split("\n"):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = cells
        elif not re.fullmatch(r"[-: ]*", "".join(cells)):  # the rule under the header
            found.append(dict(zip(header, cells)))
    return found


def notes(part: str) -> list[str]:
    """A part's bullets, each with its continuation lines joined."""
    found = []
    for line in part.split("\n"):
        if line.startswith("- "):
            found.append(line[2:])
        elif found and line.startswith("  ") and line.strip():
            found[-1] += " " + line.strip()
    return found


def one(candidates: list, strings: list[str], texts: Callable[[Any], list[str]]) -> Any:
    """The one candidate of which each string is a text (a cell) or, failing that, a part of one."""
    exact = [c for c in candidates if all(s in texts(c) for s in strings)]
    loose = [c for c in candidates if all(any(s in text for text in texts(c)) for s in strings)]
    found = exact or loose
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows or notes match {strings}")
    return found[0]


def result(ref: dict, sections: dict[str, str]) -> Decimal:
    """The number a reference names: a table cell, or the nth number after a text in a note."""
    if ref["part"] not in sections:
        raise LookupError(f"RESULTS.md has no part {ref['part']!r}")
    part = sections[ref["part"]]
    if "note" in ref:
        note = one(notes(part), ref["note"], lambda note: [note])
        _, found, after = note.partition(ref["after"])
        numbers = NUMBER.findall(after)
        nth = int(ref.get("nth", 0))
        if not found or nth >= len(numbers):
            raise LookupError(f"the note has no number {nth} after {ref['after']!r}")
        return value(numbers[nth])
    row = one(rows(part), ref["row"], lambda row: list(row.values()))
    if ref["column"] not in row:
        raise LookupError(f"the row's table has no column {ref['column']!r}")
    return value(row[ref["column"]])


def registry() -> dict[str, dict[str, list[dict]]]:
    """page → figure → its references. BaseLoader keeps every scalar a string: `1.30` stays `1.30`."""
    loaded = yaml.load(REGISTRY.read_text(), Loader=yaml.BaseLoader)
    return {page: {figure: refs if isinstance(refs, list) else [refs] for figure, refs in quoted.items()}
            for page, quoted in loaded.items()}


def test_the_matcher_finds_ratios_times_and_minutes_and_skips_versions_and_code():
    text = ("output tokens/s 1.04× `vllm serve`'s; 0.977 (0.970–1.064); compile from 36.8 s to 21.3 s\n"
            "vLLM 0.32 and worker-vllm 2.24+, runpod 1.10.0, `GPU_MEMORY_UTILIZATION` `0.95`, 0.1 s\n"
            "25 to 28 minutes, 50 min 39 s, 31.4 minutes, 2 min: 30 s, 1,268 tests, 90 → 96\n"
            "```\nimports=1.77s 9.99 50 min\n```\n")
    assert figures(text) == ["1.04", "0.977", "0.970", "1.064", "36.8", "21.3", "0.1",
                             "25", "28", "50 min 39 s", "31.4", "2"]
    assert held("33.6", Decimal("33.62")) and held("1.04", Decimal("1.039"))
    assert not held("33.7", Decimal("33.62")) and not held("0.97", Decimal("0.976"))
    assert held("50 min 39 s", value("50.65 min")) and held("25", value("25 min 29 s"))
    assert value("1,268 tests") == 1268 and value("4.74 µs") == Decimal("4.74")


def test_every_quoted_figure_is_registered_or_not_a_measurement():
    quoted = registry()
    missing = {}
    for page in pages():
        unnamed = [figure for figure in figures(page.read_text())
                   if (page.name, figure) not in NOT_MEASURED and figure not in quoted.get(page.name, {})]
        if unnamed:
            missing[page.name] = unnamed
    assert missing == {}, f"add these to {REGISTRY.name} with the result each comes from: {missing}"


def test_each_registered_figure_is_its_result_rounded():
    sections, wrong = parts(), []
    for page, quoted in registry().items():
        for figure, refs in quoted.items():
            for ref in refs:
                try:
                    number = result(ref, sections)
                except LookupError as error:
                    wrong.append(f"{page} {figure}: {ref}: {error}")
                    continue
                if not held(figure, number):
                    wrong.append(f"{page} {figure}: {ref} is {number}, which does not round to it")
    assert not wrong, "\n".join(wrong)


def test_each_registered_or_allowed_figure_is_still_quoted():
    quoted = {(page.name, figure) for page in pages() for figure in figures(page.read_text())}
    named = {(page, figure) for page, figures_ in registry().items() for figure in figures_}
    assert (named | set(NOT_MEASURED)) - quoted == set()
