"""The test suite's time as CI runs it, before and after (issues 62, 71): `.ci/run`'s steps at each
commit given, in a clean clone with its own virtual environment, each step timed (the PostgreSQL
server, Debian's Chromium, the venv and pip install, ruff, mkdocs, the README's test command with
CI=true), the tests' times kept in a JUnit file; then the tables -- CI's steps, the suite's wall
time, the tests' own seconds and where they went, by file and by test.

    python benchmarks/suite_time.py --commit 2d932c4 --commit HEAD          # runs both (about an hour)
    python benchmarks/suite_time.py --junit before=base.xml@2d932c4 --junit after=r2.xml@HEAD   # runs read back
    DALLE_ABLATE_RESULTS=- python benchmarks/suite_time.py --junit ci=build/junit.xml   # CI's own run (.ci/run)

A JUnit file is pytest's own (`--junitxml`; every pytest run of this repository writes
build/junit.xml, pyproject.toml's addopts); its suite's `time` is the wall time of the run. Run on a
quiet machine, one run after the other: the runs share nothing but the machine. `--fresh-apt` times
the apt installs as a machine without them pays (reinstalling Chromium and PostgreSQL's packages);
without it a step whose package is there costs the check alone."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TESTS = "pytest -q -n 2 --dist loadfile"  # the README's test command (tests/test_repo.py keeps them the same)
SLOWEST = 20  # the slowest tests each table lists
# What a machine without them pays for .ci/run's apt installs (it installs each only when missing).
FRESH_APT = (
    "apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install --reinstall -y -qq chromium "
    "postgresql-$(ls /usr/lib/postgresql | sort -V | tail -1) >/dev/null"
)


@dataclass
class Suite:
    label: str
    commit: str
    wall: float  # the run's wall time, s (pytest's)
    tests: dict[tuple[str, str], float]  # (file, test) -> seconds, setup and teardown included
    failed: int
    skipped: int
    steps: dict[str, float] = field(default_factory=dict)  # CI's steps -> seconds (runs of --commit only)


def read_junit(label: str, path: Path, commit: str) -> Suite:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests, failed, skipped = {}, 0, 0
    for case in suite.iter("testcase"):
        tests[(case.get("classname", "").rsplit(".", 1)[-1], case.get("name", ""))] = float(case.get("time", 0))
        failed += case.find("failure") is not None or case.find("error") is not None
        skipped += case.find("skipped") is not None
    return Suite(label, commit, float(suite.get("time", 0)), tests, failed, skipped)


def ci_steps(
    clone: Path, junit: Path, fresh_apt: bool, hook: Optional[tuple[str, str]] = None
) -> list[tuple[str, str]]:
    """`.ci/run`'s steps, as (what, shell command): the PostgreSQL server and Chromium, then the
    README's command that is its last line, one step per `&&`; the tests' step writes `junit`.
    `hook`: a step of a measurement's own, just before the tests' (benchmarks/suite_children.py)."""
    readme_command = (clone / ".ci" / "run").read_text().strip().splitlines()[-1]
    steps = [("apt: Chromium and PostgreSQL, reinstalled", FRESH_APT)] if fresh_apt else []
    steps += [
        ("PostgreSQL server (.ci/postgres.sh)", 'export DALLE_ABLATE_TEST_POSTGRES="$(.ci/postgres.sh)"'),
        (
            "Chromium (apt-get when missing)",
            "command -v chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null && "
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }",
        ),
    ]
    for command in readme_command.split(" && "):
        if command == TESTS:  # its failures are the JUnit file's to count, not a reason to stop
            steps += [hook] if hook else []
            steps.append((command, f"{command} --junitxml={junit} || true"))
        else:
            steps.append((command, command))
    return steps


def run_at(
    commit: str, out: Path, fresh_apt: bool, hook: Optional[tuple[str, str]] = None, env: Optional[dict] = None
) -> tuple[Path, dict[str, float]]:
    """CI's steps at `commit` in a fresh clone, each timed; the JUnit file's path and the steps' seconds.
    `hook` and `env`: a measurement's own step before the tests' (ci_steps) and variables."""
    sha = subprocess.run(
        ["git", "rev-parse", commit], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    clone = Path(tempfile.mkdtemp(prefix=f"suite-{sha[:8]}-"))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", sha], cwd=clone, check=True)
    junit, times = out / f"junit-{sha[:12]}.xml", out / f"steps-{sha[:12]}.txt"
    times.unlink(missing_ok=True)
    steps = ci_steps(clone, junit, fresh_apt, hook)
    script = ["set -euo pipefail", "export PIP_DISABLE_PIP_VERSION_CHECK=1 NO_MKDOCS_2_WARNING=1"]
    for i, (_, command) in enumerate(steps):
        script += ["t0=$EPOCHREALTIME", command, f'echo "{i} $t0 $EPOCHREALTIME" >> {times}']
    env = {**os.environ, **(env or {}), "CI": "true", "LC_ALL": "C"}  # C: EPOCHREALTIME's decimal point is a dot
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=clone, env=env)
    seconds = {}
    for line in times.read_text().splitlines() if times.exists() else []:
        i, t0, t1 = line.split()
        seconds[steps[int(i)][0]] = float(t1) - float(t0)
    if done.returncode:
        raise SystemExit(f"{commit}: CI's step `{steps[len(seconds)][0]}` failed (exit {done.returncode})")
    print(f"{commit} ({sha[:12]}): {sum(seconds.values()):.0f} s, CI's steps together", file=sys.stderr)
    return junit, seconds


def by_file(s: Suite) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for (f, _), t in s.tests.items():
        c[f] += t
    return c


def table(suites: list[Suite]) -> None:
    timed = [s for s in suites if s.steps]
    if timed:
        print("CI's steps on a fresh clone, seconds (`.ci/run`; the tests' step is the README's test command):\n")
        print("| step | " + " | ".join(s.label for s in timed) + " |")
        print("|---|" + "---|" * len(timed))
        for step in dict.fromkeys(k for s in timed for k in s.steps):
            print(
                f"| `{step}` | " + " | ".join(f"{s.steps[step]:.0f}" if step in s.steps else "-" for s in timed) + " |"
            )
        print("| all of CI | " + " | ".join(f"{sum(s.steps.values()):.0f}" for s in timed) + " |\n")
    print("| run | commit | tests | failed | skipped | wall (min) | tests' own seconds | vs the first |")
    print("|---|---|---|---|---|---|---|---|")
    for s in suites:
        print(
            f"| {s.label} | {s.commit} | {len(s.tests)} | {s.failed} | {s.skipped} | {s.wall / 60:.1f} | "
            f"{sum(s.tests.values()):.0f} | {s.wall / suites[0].wall:.2f}x |"
        )
    first, last = suites[0], suites[-1]
    a, b = by_file(first), by_file(last)
    files = sorted(a | b, key=lambda f: -a.get(f, 0))[:SLOWEST]
    print(
        f"\nThe {SLOWEST} files that took longest in {first.label}, seconds of tests (setup and teardown included):\n"
    )
    if len(suites) == 1:
        print(f"| file | {first.label} |\n|---|---|")
        for f in files:
            print(f"| {f} | {a[f]:.0f} |")
    else:
        print(f"| file | {first.label} | {last.label} | ratio |\n|---|---|---|---|")
        for f in files:
            ratio = f"{b.get(f, 0) / a[f]:.2f}" if a.get(f) else "-"
            print(f"| {f} | {a.get(f, 0):.0f} | {b.get(f, 0):.0f} | {ratio} |")
    print(f"\nThe {SLOWEST} slowest tests of {last.label}:\n")
    if len(suites) == 1:
        print(f"| test | {last.label} (s) |\n|---|---|")
    else:
        print(f"| test | {first.label} (s) | {last.label} (s) |\n|---|---|---|")
    for key, t in sorted(last.tests.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        before = "" if len(suites) == 1 else f" {first.tests.get(key, float('nan')):.0f} |"
        print(f"| {key[0]}::{key[1]} |{before} {t:.0f} |")


@writes_page("The test suite's time, before and after")
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", action="append", default=[], help="run the suite at this commit (repeat: in order)")
    p.add_argument("--junit", action="append", default=[], help="LABEL=PATH@COMMIT: a run's JUnit file read back")
    p.add_argument("--out", default=tempfile.gettempdir(), help="where the JUnit files of --commit runs go")
    p.add_argument("--fresh-apt", action="store_true", help="time the apt installs too (reinstalls their packages)")
    args = p.parse_args()
    suites = []
    for commit in args.commit:
        junit, steps = run_at(commit, Path(args.out), args.fresh_apt)
        suites.append(dataclasses.replace(read_junit(commit, junit, commit), steps=steps))
    for spec in args.junit:
        label, _, rest = spec.partition("=")
        path, _, commit = rest.partition("@")
        suites.append(read_junit(label, Path(path), commit or "unknown"))
    if not suites:
        p.error("give --commit or --junit")
    table(suites)


if __name__ == "__main__":
    main()
