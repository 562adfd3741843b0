"""Reading README.md and docs/*.md as the tests that check them need: one section by its heading, a
table's rows, the links and the anchors GitHub makes of the headings."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"


def pages() -> list[Path]:
    """The README and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _outside_code(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _heading(line: str) -> tuple[int, str] | None:
    match = re.match(r"(#{1,6}) (.+?)\s*#*\s*$", line)
    return (len(match.group(1)), match.group(2)) if match else None


def section(path: Path, heading: str) -> str:
    """The text under the heading ``heading`` (its exact text), up to the next heading of its level
    or above."""
    lines = path.read_text().split("\n")
    fenced, start, level = False, None, 0
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        found = None if fenced else _heading(line)
        if found and start is None and found[1] == heading:
            start, level = i + 1, found[0]
        elif found and start is not None and found[0] <= level:
            return "\n".join(lines[start:i])
    if start is None:
        raise AssertionError(f"{path.relative_to(REPO)} has no heading {heading!r}")
    return "\n".join(lines[start:])


def table(text: str) -> list[list[str]]:
    """The rows of the first table in ``text``, each a list of its cells (header and rule left out)."""
    lines = _outside_code(text)
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    assert first is not None, "no table"
    body = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        body.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return body


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (a repeated one gets -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(path.read_text()):
        found = _heading(line)
        if found:
            base = slug(found[1])
            out.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return out


def links(path: Path) -> list[str]:
    """The targets of a page's links and images, outside code."""
    text = "\n".join(_outside_code(path.read_text()))
    text = re.sub(r"`[^`]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def broken_links(path: Path) -> list[str]:
    """The relative links of a page whose file, or whose anchor in that file, does not exist."""
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and (dest.suffix != ".md" or anchor not in anchors(dest))):
            broken.append(target)
    return broken
