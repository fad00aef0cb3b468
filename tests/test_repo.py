"""The repository keeps its promises: CI runs the README's test command; generated output is ignored."""

from __future__ import annotations

import subprocess

from conftest import ROOT


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme, f"README.md must show the test command CI runs: {ci}"


def test_generated_output_is_ignored_by_git():
    paths = ["outputs/x/run/metrics.jsonl", "multirun/x/0/run/config.yaml", "wandb/offline-run-x/run.wandb",
             "reports/some-report/index.html", ".venv/bin/python", "site/index.html"]
    proc = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.split() == paths


def test_docs_live_in_the_repository():
    """Every doc reference resolves inside the repository: nothing points at files a user of the
    package does not have (the design notes beside a developer's checkout)."""
    import re

    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.yaml"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    outside = [f for f in tracked if re.search(r"\.\./shared|\bDESIGN\.md|\bVARIANTS\.md", (ROOT / f).read_text())]
    assert outside == [], outside
    for link in re.findall(r"\]\((docs/[^)]+)\)", (ROOT / "README.md").read_text()):
        assert (ROOT / link.partition("#")[0]).is_file(), link


def test_ci_builds_the_docs_site_strict():
    """`mkdocs build --strict -q` passes with broken anchors: -q hides the warnings strict counts."""
    import re

    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    build = re.search(r"mkdocs build[^&]*", ci)
    assert build and "--strict" in build.group(0) and not re.search(r"\s-q\b|--quiet", build.group(0)), ci
