"""Before and after a change, in one run: ``python -m bench.compare --before REV [--parts stub,engine]``.

Checks out ``REV`` beside this checkout (a git worktree sharing its ``.venv`` and models), then runs
``python -m bench`` in the two trees alternately (before then after, then after then before, ...),
each run writing its own RESULTS.md, and prints each figure's median over the rounds in both trees
with their ratio (after ÷ before). A refactor that claims "no slower" reads the ratios, whose spread
the per-round columns show.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (?P<item>[^|]+) \| (?P<model>[^|]+) \| (?P<figure>[^|]+) \| (?P<median>[\d.]+) ?(?P<unit>[^|]*)\|",
                 re.MULTILINE)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare against")
    parser.add_argument("--parts", default="stub,engine")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree")
    parser.add_argument("--quick", action="store_true", help="the bench's smoke run (tiny model)")
    return parser.parse_args()


def _worktree(revision: str, folder: Path) -> Path:
    tree = folder / "before"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), revision], cwd=REPO, check=True)
    for shared in (".venv", ".cache"):
        (tree / shared).symlink_to(REPO / shared)
    return tree


def _run(tree: Path, args: argparse.Namespace, out: Path) -> dict[tuple[str, str, str], tuple[float, str]]:
    command = [str(REPO / ".venv" / "bin" / "python"), "-m", "bench", "--parts", args.parts, "--out", str(out)]
    subprocess.run(command + (["--quick"] if args.quick else []), cwd=tree, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {(m["item"].strip(), m["model"].strip(), m["figure"].strip()): (float(m["median"]), m["unit"].strip())
            for m in ROW.finditer((out / "RESULTS.md").read_text())}


def main() -> None:
    args = _parse()
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as folder:
        trees = {"before": _worktree(args.before, Path(folder)), "after": REPO}
        figures: dict[str, list[dict]] = {"before": [], "after": []}
        try:
            for round_ in range(args.rounds):
                order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
                for name in order:
                    print(f"bench.compare: round {round_ + 1}, {name}", file=sys.stderr, flush=True)
                    figures[name].append(_run(trees[name], args, Path(folder) / f"{name}-{round_}"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"])], cwd=REPO, check=False)
    print("| item | model | figure | before | after | after ÷ before | rounds before | rounds after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in figures["after"][0]:
        before = [run[key][0] for run in figures["before"] if key in run]
        after = [run[key][0] for run in figures["after"] if key in run]
        if not before:
            continue
        unit = figures["after"][0][key][1]
        b, a = statistics.median(before), statistics.median(after)
        print(f"| {' | '.join(key)} | {b:g} {unit} | {a:g} {unit} | {a / b:.3f} | "
              f"{', '.join(f'{v:g}' for v in before)} | {', '.join(f'{v:g}' for v in after)} |")


if __name__ == "__main__":
    main()
