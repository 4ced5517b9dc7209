"""Wall time of chosen test files at two commits, run side by side: the suite's cost before and after a change.

The tree of `--base` (default: main) is exported once with `git archive` into a temporary directory (nothing
else is checked out); this checkout is the other side, or the tree of `--after` exported the same way. Each round runs pytest on the same test paths in both
trees, one after the other, the order alternating round by round (base first in odd rounds), each run in a
fresh interpreter with the tree first on PYTHONPATH, in file order (`-p no:randomly`) with every test
selected by `-m`. Reports each run's wall time and pass count, the medians, the spread and
the after/before ratio of the medians. A run that does not pass fails the script (a faster suite that
fails proves nothing).

    python bench/suite_time.py --rounds 3
    python bench/suite_time.py --base 1c7aa47 --rounds 2 -m "slow or not slow" tests/engine/test_spec_async.py
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What round 6 changed, sized for a few minutes a run: the async speculation tests (their plain-decoding
# oracles shared), the real-model speculation tests (one plain engine for both), and two
# modules on the session's shared SmolLM2 pair (before: a pair each; a module alone gains nothing).
DEFAULT_TESTS = (
    "tests/engine/test_spec_async.py",
    "tests/realmodel/test_spec_decode_real.py",
    "tests/realmodel/test_engine_served_tokenizer.py",
    "tests/realmodel/test_responses_served.py::test_the_openai_client_reads_both_forms",
)
# Leaves out test_spec_async's TP=2 and `tandem serve` tests (unchanged; processes that double the run).
DEFAULT_KEYWORDS = "not tp2 and not tandem_serve"


def export(rev: str, into: Path) -> Path:
    """`rev`'s tree under `into` (git archive | tar): its tests and the code they import."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_once(tree: Path, tests: list[str], marks: str, extra: list[str]) -> tuple[float, str]:
    """(wall seconds, pytest's last line) of one run in `tree`; raises if it did not pass."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "protos")])}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
            "-m", marks, *extra, *tests]
    start = time.monotonic()
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0:
        raise SystemExit(f"pytest failed in {tree} (exit {done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
    return wall, last


def passed(line: str) -> str:
    found = re.search(r"(\d+) passed", line)
    return found.group(1) if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="test paths or ids (both trees)")
    parser.add_argument("--base", default="main", help="the commit to compare against")
    parser.add_argument("--after", default=None, help="a commit to export as the other side (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-m", dest="marks", default="slow or not slow", help="pytest's -m (default: every test)")
    parser.add_argument("-k", dest="keywords", default=DEFAULT_KEYWORDS,
                        help=f"pytest's -k (default: {DEFAULT_KEYWORDS!r}; '' for none)")
    parser.add_argument("--pytest-arg", action="append", default=[], help="one more pytest argument (repeatable)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="suite-time-") as tmp:
        trees = {"before": export(args.base, Path(tmp) / "before"),
                 "after": export(args.after, Path(tmp) / "after") if args.after else ROOT}
        for round_ in range(args.rounds):
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for side in order:
                extra = [*(["-k", args.keywords] if args.keywords else []), *args.pytest_arg]
                wall, last = run_once(trees[side], args.tests, args.marks, extra)
                times[side].append(wall)
                print(f"round {round_ + 1} {side:6s} {wall:7.1f} s  {passed(last)} passed  ({last})", flush=True)
    med = {side: statistics.median(values) for side, values in times.items()}
    for side, values in times.items():
        print(f"{side:6s} median {med[side]:7.1f} s  range {min(values):.1f}-{max(values):.1f} s")
    ratios = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
    print(f"after/before: {med['after'] / med['before']:.2f} (per round {', '.join(f'{r:.2f}' for r in ratios)}); "
          f"saved {med['before'] - med['after']:.1f} s of {med['before']:.1f} s")


if __name__ == "__main__":
    main()
