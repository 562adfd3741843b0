"""Every measured figure the README and docs/ quote is one that bench/RESULTS.md records.

A figure here is a number with a decimal point, in prose or a table (outside code blocks, inline code
and link targets), that is either followed by a unit of a measurement (`1.04×`, `36.8 s`, `23.09 ms`,
`4.74 µs`, `1.5 %`) or has two or more decimals (a bare ratio: `0.977`, `1.04`). It is held when some
number in RESULTS.md rounds to it at the figure's own precision (`33.6 s` for `33.62 s`). Versions
(`vLLM 0.32`, `worker-vllm 2.24`) are not figures. Numbers that are not measurements are allowed
one by one below, each with its reason; a figure RESULTS.md does not hold must be measured by
scripts/bench.sh (and recorded there) or removed.
"""

from __future__ import annotations

import re
from decimal import Decimal

from doc_pages import REPO, _outside_code, pages

RESULTS = REPO / "bench" / "RESULTS.md"

# Decimal figures that are not benchmark results: (page, the figure as written) → why.
NOT_MEASURED = {
    ("image.md", "3.61"): "the image's size, as buildah reports it (docs/image.md), not a bench figure",
    ("image.md", "3.68"): "the image's size with the test lock, as buildah reports it",
    ("concurrency.md", "29.16"): "a slot count (item 7's 29.163), kept at two decimals",
}

# vLLM's and worker-vllm's versions, also where the sentence names them once for two ("0.32 and 0.33").
VERSIONS = {"0.32", "0.33", "0.34", "2.24", "2.27"}
UNIT = r"\s?(?:×|x\b|s\b|ms\b|µs\b|%)"
# A number with a decimal point, not part of a longer dotted number (1.10.0) or a word.
NUMBER = re.compile(rf"(?<![\w.])(\d+\.(\d+))(?![\w.]|\.\d)({UNIT})?")
VERSION_BEFORE = re.compile(r"(?:vLLM|vllm|worker-vllm|torch|Python|glibc|runpod|openai|CUDA|v)\s?$")


def figures(text: str) -> list[str]:
    """The measured figures in ``text`` (a page), as written."""
    found = []
    for line in _outside_code(text):
        line = re.sub(r"`[^`]*`", "", line)  # inline code: settings' values, log lines
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets
        for match in NUMBER.finditer(line):
            number, decimals, unit = match.groups()
            if number in VERSIONS or VERSION_BEFORE.search(line[:match.start()]) or line[match.end():].startswith(("+", "'s")):
                continue
            if unit or len(decimals) >= 2:
                found.append(number)
    return found


def recorded() -> list[Decimal]:
    return [Decimal(n) for n in re.findall(r"(?<![\w.])-?\d+\.\d+(?![\w.]|\.\d)", RESULTS.read_text())]


def held(figure: str, numbers: list[Decimal]) -> bool:
    """Whether a recorded number rounds to ``figure`` at its precision."""
    value, step = Decimal(figure), Decimal(1).scaleb(-len(figure.split(".")[1]))
    return any(abs(number - value) <= step / 2 for number in numbers)


def test_the_matcher_finds_ratios_and_times_and_skips_versions_and_code():
    text = ("output tokens/s 1.04× `vllm serve`'s; 0.977 (0.970–1.064); compile fell from 36.8 s to 21.3 s\n"
            "vLLM 0.32 and worker-vllm 2.24+, runpod 1.10.0, `GPU_MEMORY_UTILIZATION` `0.95`, 0.1 s\n"
            "```\nimports=1.77s 9.99\n```\n")
    assert figures(text) == ["1.04", "0.977", "0.970", "1.064", "36.8", "21.3", "0.1"]
    numbers = [Decimal("33.62"), Decimal("1.039")]
    assert held("33.6", numbers) and held("1.04", numbers) and not held("33.7", numbers)


def test_every_figure_in_the_readme_and_docs_is_in_the_bench_results():
    numbers = recorded()
    missing = {}
    for page in pages():
        unheld = [figure for figure in figures(page.read_text())
                  if (page.name, figure) not in NOT_MEASURED and not held(figure, numbers)]
        if unheld:
            missing[page.name] = unheld
    assert missing == {}


def test_each_allowed_number_is_still_quoted():
    quoted = {(page.name, figure) for page in pages() for figure in figures(page.read_text())}
    assert set(NOT_MEASURED) <= quoted
