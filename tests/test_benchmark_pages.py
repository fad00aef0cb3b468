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
        if path.name == "common.py":
            continue
        mains = [f for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        decorators = [ast.unparse(d) for f in mains for d in f.decorator_list]
        assert len(mains) == 1 and any(d.startswith("writes_page(") for d in decorators), path.name
