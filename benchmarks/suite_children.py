"""Where the test suite's seconds go (issue 71): into the processes its tests start (`run.py` jobs, a
study's runs, mesh and multi-host workers, sweeps) or into the test's own process. The suite runs as
CI runs it (benchmarks/suite_time.py's steps, a clean clone at the commit given) with a clock in every
Python process of the clone's virtual environment (benchmarks/child_clock.py); then, per file and per
test, its seconds (JUnit), its children's wall seconds and the rest.

    python benchmarks/suite_children.py --commit HEAD                      # runs the suite (~25 min)
    python benchmarks/suite_children.py --junit r.xml --clock c.jsonl --label HEAD   # a run read back

A child is counted once, where its test started it: a process a pytest worker started (a study's
own runs are inside its time). Its wall seconds are the test's seconds spent on it, the worker
waiting; two it runs side by side (two processes of a mesh) count twice, so a file's rest can come
out below zero. A child killed with SIGKILL writes no end: counted, not timed."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402
from suite_time import SLOWEST, read_junit, run_at  # noqa: E402

CLOCK = Path(__file__).resolve().parent / "child_clock.py"


@dataclass
class Children:
    wall: dict[str, float]  # test ("file.py::name") -> its children's wall seconds
    started: collections.Counter  # test -> children started
    untimed: collections.Counter  # test -> children with no end (killed)


def children(records: list[dict]) -> Children:
    """The children of the suite's tests, from the clock's records: a process is a test's child when
    its parent is a process no test started (a pytest worker)."""
    starts = {r["pid"]: r for r in records if r["event"] == "start"}
    ends = {r["pid"]: r for r in records if r["event"] == "end"}
    workers = {pid for pid, r in starts.items() if r["test"] is None}
    wall, started, untimed = collections.defaultdict(float), collections.Counter(), collections.Counter()
    for pid, r in starts.items():
        if r["test"] is None:
            continue
        test, end = r["test"].rsplit(" ", 1)[0], ends.get(pid)  # "path::name (call)"
        if end is None:  # no end line: killed, or a grandchild killed with it -- counted where it was started
            untimed[test] += 1
        elif end["ppid"] in workers:
            wall[test] += end["wall"]
            started[test] += 1
    return Children(dict(wall), started, untimed)


def table(label: str, tests: dict[str, float], failed: int, kids: Children) -> None:
    total, spent = sum(tests.values()), sum(kids.wall.values())
    n, untimed = sum(kids.started.values()), sum(kids.untimed.values())
    print("| run | tests | failed | tests' own seconds | in children | children | not timed (killed) | rest |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {label} | {len(tests)} | {failed} | {total:.0f} | {spent:.0f} | {n} | {untimed} | {total - spent:.0f} |")
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for test, seconds in tests.items():
        f = files[test.split("::")[0]]
        f[0] += seconds
        f[1] += kids.wall.get(test, 0.0)
        f[2] += kids.started.get(test, 0) + kids.untimed.get(test, 0)
    print(f"\nThe {SLOWEST} files that took longest, seconds (a file's children side by side count twice):\n")
    print("| file | seconds | in children | children | rest |\n|---|---|---|---|---|")
    for name, (s, c, k) in sorted(files.items(), key=lambda kv: -kv[1][0])[:SLOWEST]:
        print(f"| {name} | {s:.0f} | {c:.0f} | {k} | {s - c:.0f} |")
    rest = {t: s - kids.wall.get(t, 0.0) for t, s in tests.items()}
    print(f"\nThe {SLOWEST} tests with the most seconds in their own process:\n")
    print("| test | seconds | in children | rest |\n|---|---|---|---|")
    for test, r in sorted(rest.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        print(f"| {test} | {tests[test]:.0f} | {kids.wall.get(test, 0.0):.0f} | {r:.0f} |")


def tests_of(junit: Path) -> dict[str, float]:
    """JUnit's seconds per test, named as $PYTEST_CURRENT_TEST names it (path::name; suite_time's
    read_junit keeps the module's name alone)."""
    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        out[f"{path}::{case.get('name', '')}"] = float(case.get("time", 0))
    return out


@writes_page("Where the test suite's seconds go: its child processes and the rest")
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", help="run the suite at this commit, every Python process clocked")
    p.add_argument("--junit", help="a run's JUnit file read back (with --clock)")
    p.add_argument("--clock", help="the clock's records of that run (JSON lines)")
    p.add_argument("--label", default="run", help="the run's name in the tables")
    p.add_argument("--out", default=tempfile.gettempdir(), help="where --commit's JUnit file and records go")
    args = p.parse_args()
    if args.commit:
        clock = Path(args.out) / "children.jsonl"
        clock.unlink(missing_ok=True)
        # after the install, before the tests: the clone's own venv runs the clock in every process
        hook = (
            f"import os, pathlib; os.environ.get('DALLE_ABLATE_CHILD_CLOCK') and exec(compile(pathlib.Path({str(CLOCK)!r}).read_text(), "
            f"{str(CLOCK)!r}, 'exec'), {{'__name__': 'child_clock'}})"
        )
        pth = f"echo {json.dumps(hook)} > \"$(python -c 'import site; print(site.getsitepackages()[0])')/clock.pth\""
        junit, _ = run_at(
            args.commit,
            Path(args.out),
            False,
            hook=("child clock (.pth)", pth),
            env={"DALLE_ABLATE_CHILD_CLOCK": str(clock)},
        )
        label, records_path = args.commit, clock
    elif args.junit and args.clock:
        junit, records_path, label = Path(args.junit), Path(args.clock), args.label
    else:
        p.error("give --commit, or --junit with --clock")
    records = [json.loads(line) for line in Path(records_path).read_text().splitlines() if line.strip()]
    # a failed test's seconds are not its usual ones: the count is in the table
    table(label, tests_of(junit), read_junit(label, junit, label).failed, children(records))


if __name__ == "__main__":
    main()
