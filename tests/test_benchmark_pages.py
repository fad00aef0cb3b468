"""Each benchmark writes its results page (benchmarks/common.py: writes_page): what it printed
under the command, commit, machine and date; nothing when it fails."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402


def test_a_benchmark_page_holds_what_it_printed_under_its_provenance(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(common.PAGE_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["benchmarks/toy_bench.py", "--steps", "3", "size=tiny"])

    @common.writes_page("A toy benchmark")
    def main():
        print("| size | steps/s |\n|---|---|\n| tiny | 9.5 |")
        return 7

    assert main() == 7
    assert "| tiny | 9.5 |" in capsys.readouterr().out  # still printed to the terminal
    page = (tmp_path / "toy-bench.md").read_text().splitlines()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert page[0] == "# A toy benchmark"
    assert page[2].startswith("Written by `python benchmarks/toy_bench.py --steps 3 size=tiny` (")
    assert page[4].startswith(f"Commit: {head}")
    assert page[6].startswith("Machine: ") and f"{__import__('os').cpu_count()} cores" in page[6]
    block = page[page.index("```text") + 1 :]
    assert block[:4] == ["| size | steps/s |", "|---|---|", "| tiny | 9.5 |", "```"]


def test_a_failed_benchmark_leaves_the_earlier_page_and_a_dash_writes_none(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/toy_bench.py"])
    monkeypatch.setenv(common.PAGE_ENV, str(tmp_path))
    (tmp_path / "toy-bench.md").write_text("the earlier page")

    @common.writes_page("A toy benchmark")
    def fails():
        print("half a table")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        fails()
    assert (tmp_path / "toy-bench.md").read_text() == "the earlier page"
    assert sys.stdout is not None and not isinstance(sys.stdout, common._Tee)
    monkeypatch.setenv(common.PAGE_ENV, "-")
    common.writes_page("A toy benchmark")(lambda: print("x"))()
    assert (tmp_path / "toy-bench.md").read_text() == "the earlier page"


def test_every_benchmark_writes_its_page():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.name in ("common.py", "child_clock.py"):  # their helpers, and suite_children.py's clock
            continue
        mains = [f for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        decorators = [ast.unparse(d) for f in mains for d in f.decorator_list]
        assert len(mains) == 1 and any(d.startswith("writes_page(") for d in decorators), path.name


def test_the_suites_children_are_counted_once_where_a_test_started_them():
    """benchmarks/suite_children.py: a child is the test's that started it, timed by its own clock; a
    grandchild (a study's run) is inside its parent's time, not counted again; a child killed with
    SIGKILL (no end line) is counted, not timed; a process no test started (a pytest worker) is none."""
    import suite_children

    records = [
        {"event": "start", "pid": 1, "test": None, "argv": ["-c"], "t": 0.0},  # a worker
        {"event": "start", "pid": 10, "test": "tests/a.py::t (call)", "argv": ["run.py"], "t": 1.0},
        {"event": "start", "pid": 11, "test": "tests/a.py::t (call)", "argv": ["-m"], "t": 2.0},  # 10's own run
        {"event": "start", "pid": 12, "test": "tests/a.py::t (call)", "argv": ["kill_worker.py"], "t": 3.0},
        {"event": "start", "pid": 20, "test": "tests/b.py::u[x] (setup)", "argv": ["run.py"], "t": 4.0},
        {"event": "end", "pid": 11, "ppid": 10, "wall": 3.0, "cpu": 2.0},
        {"event": "end", "pid": 10, "ppid": 1, "wall": 5.0, "cpu": 1.0},
        {"event": "end", "pid": 20, "ppid": 1, "wall": 2.5, "cpu": 2.0},
        {"event": "end", "pid": 1, "ppid": 0, "wall": 60.0, "cpu": 50.0},
    ]
    kids = suite_children.children(records)
    assert kids.wall == {"tests/a.py::t": 5.0, "tests/b.py::u[x]": 2.5}
    assert kids.started == {"tests/a.py::t": 1, "tests/b.py::u[x]": 1}
    assert kids.untimed == {"tests/a.py::t": 1}
