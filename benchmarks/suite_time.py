"""The test suite's time as CI runs it, before and after (issue 62): the README's test command
(`pytest -q -n 2 --dist loadfile`, with CI=true) at each commit given, in a clean clone with its own
virtual environment, its per-test times kept in a JUnit file; then the table of both runs -- the
suite's wall time, the tests' own seconds and where they went, by file and by test.

    python benchmarks/suite_time.py --commit 2d932c4 --commit HEAD          # runs both (about an hour)
    python benchmarks/suite_time.py --junit before=base.xml@2d932c4 --junit after=r2.xml@HEAD   # runs read back

A JUnit file is pytest's own (`--junitxml`); its suite's `time` is the wall time of the run. Run on
a quiet machine, one run after the other: the two share nothing but the machine."""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTALL = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -q -c constraints.txt -e '.[dev,ref,cluster,docs]'"
)
TESTS = "pytest -q -n 2 --dist loadfile"  # the README's test command (tests/test_repo.py keeps them the same)


@dataclass
class Suite:
    label: str
    commit: str
    wall: float  # the run's wall time, s (pytest's)
    tests: dict[tuple[str, str], float]  # (file, test) -> seconds, setup and teardown included
    failed: int
    skipped: int


def read_junit(label: str, path: Path, commit: str) -> Suite:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests, failed, skipped = {}, 0, 0
    for case in suite.iter("testcase"):
        tests[(case.get("classname", "").rsplit(".", 1)[-1], case.get("name", ""))] = float(case.get("time", 0))
        failed += case.find("failure") is not None or case.find("error") is not None
        skipped += case.find("skipped") is not None
    return Suite(label, commit, float(suite.get("time", 0)), tests, failed, skipped)


def run_at(commit: str, out: Path) -> Path:
    """The CI command's tests at `commit` in a fresh clone; the JUnit file's path."""
    sha = subprocess.run(
        ["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    clone = Path(tempfile.mkdtemp(prefix=f"suite-{sha[:8]}-"))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", sha], cwd=clone, check=True)
    junit = out / f"junit-{sha[:12]}.xml"
    env = {**os.environ, "CI": "true"}
    t = time.time()
    subprocess.run(["bash", "-c", f"{INSTALL} && {TESTS} --junitxml={junit}"], cwd=clone, env=env)
    print(f"{commit} ({sha[:12]}): {time.time() - t:.0f} s with the install", file=sys.stderr)
    return junit


def by_file(s: Suite) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for (f, _), t in s.tests.items():
        c[f] += t
    return c


def table(suites: list[Suite]) -> None:
    print("| run | commit | tests | failed | skipped | wall (min) | tests' own seconds | vs the first |")
    print("|---|---|---|---|---|---|---|---|")
    for s in suites:
        print(
            f"| {s.label} | {s.commit} | {len(s.tests)} | {s.failed} | {s.skipped} | {s.wall / 60:.1f} | "
            f"{sum(s.tests.values()):.0f} | {s.wall / suites[0].wall:.2f}x |"
        )
    first, last = suites[0], suites[-1]
    files = sorted(by_file(first) | by_file(last), key=lambda f: -by_file(first).get(f, 0))[:20]
    print(f"\nThe 20 files that took longest in {first.label}, seconds of tests (setup and teardown included):\n")
    print(f"| file | {first.label} | {last.label} | ratio |")
    print("|---|---|---|---|")
    a, b = by_file(first), by_file(last)
    for f in files:
        print(
            f"| {f} | {a.get(f, 0):.0f} | {b.get(f, 0):.0f} | {b.get(f, 0) / a[f]:.2f} |"
            if a.get(f)
            else f"| {f} | 0 | {b.get(f, 0):.0f} | - |"
        )
    print(f"\nThe 15 slowest tests of {last.label}:\n")
    print(f"| test | {first.label} (s) | {last.label} (s) |")
    print("|---|---|---|")
    for key, t in sorted(last.tests.items(), key=lambda kv: -kv[1])[:15]:
        print(f"| {key[0]}::{key[1]} | {first.tests.get(key, float('nan')):.0f} | {t:.0f} |")


@writes_page("The test suite's time, before and after")
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", action="append", default=[], help="run the suite at this commit (repeat: in order)")
    p.add_argument("--junit", action="append", default=[], help="LABEL=PATH@COMMIT: a run's JUnit file read back")
    p.add_argument("--out", default=tempfile.gettempdir(), help="where the JUnit files of --commit runs go")
    args = p.parse_args()
    suites = []
    for commit in args.commit:
        suites.append(read_junit(commit, run_at(commit, Path(args.out)), commit))
    for spec in args.junit:
        label, _, rest = spec.partition("=")
        path, _, commit = rest.partition("@")
        suites.append(read_junit(label, Path(path), commit or "unknown"))
    if not suites:
        p.error("give --commit or --junit")
    table(suites)


if __name__ == "__main__":
    main()
