"""The repository keeps its promises: CI runs the README's test command; generated output is ignored;
the docs' examples are what the code prints today (tools/docs_examples.py generates them)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))  # tools/ is scripts, not a package
import docs_examples  # noqa: E402

RERUN = "run python tools/docs_examples.py (--render where only the words changed), which rewrites it"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    assert ci in readme, f"README.md must show the test command CI runs: {ci}"


def test_generated_output_is_ignored_by_git():
    paths = [
        "outputs/x/run/metrics.jsonl",
        "multirun/x/0/run/config.yaml",
        "wandb/offline-run-x/run.wandb",
        "reports/some-report/index.html",
        ".venv/bin/python",
        "site/index.html",
    ]
    proc = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.split() == paths


def test_docs_live_in_the_repository():
    """Every doc reference resolves inside the repository: nothing points at files a user of the
    package does not have (the design notes beside a developer's checkout)."""
    import re

    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.yaml"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
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


def record(name: str) -> dict:
    return json.loads((docs_examples.RECORDS / f"{name}.json").read_text())


def test_the_readme_s_closing_lines_are_what_the_code_prints_for_the_run_it_recorded():
    """The lines a default job printed, kept with that run's summary and last evaluation: the
    trainer's `closing_lines` prints them again from those values (a format that drifted fails
    here), and the README shows them as printed. tests/evaluate/test_evaluate.py checks on a fresh
    run that a run store's values give back the lines the run printed."""
    rec = record("default-job")
    assert docs_examples.closing(rec["runs"]["0"]) == rec["printed"], f"the closing lines' format changed: {RERUN}"
    shown = docs_examples.block((ROOT / "README.md").read_text(), "closing-lines")
    code = [line[4:] for line in shown.splitlines() if line.startswith("    ")]
    assert "\n".join(code) == rec["printed"]
    assert f"(commit {rec['commit']}, " in shown and rec["printed"].startswith("finished at step 2000 of 2000 ")


def test_the_docs_examples_are_what_the_script_writes_from_its_records():
    """Each generated block of the README and the docs (the closing lines with their seed spread,
    what the first ablation's report says) is the script's rendering of its record, in the words
    the code uses today (the report's variant sentence, its units)."""
    for (page, name), rec in docs_examples.BLOCKS.items():
        text = docs_examples.block((ROOT / page).read_text(), name)
        assert text == docs_examples.RENDER[rec](record(rec)), f"{page}, block {name}: {RERUN}"
    first = record("first-ablation")
    assert first["commands"][0] == " ".join(docs_examples.ABLATION) and first["baseline"] == docs_examples.BASELINE
    for page in ("README.md", "docs/first-ablation.md"):  # the commands shown are the ones the record ran
        assert (
            " ".join(docs_examples.ABLATION[2:]).replace("eval.guidance_scales=[1,3]", "'eval.guidance_scales=[1,3]'")
            in (ROOT / page).read_text()
        )


# Paths the code and the docs cite: from the repository's root (`tests/stats/test_stages.py`), or
# inside the package (`report/page.py`, a folder of dalle_ablate/ first). A move leaves these to rot
# first; this keeps them true. The architecture's worked example of adding an optimizer names the
# files it would add.
ROOTS = ("dalle_ablate", "tests", "benchmarks", "tools", "docs", "hydra_plugins")
EXAMPLES = {"optim/lion.py", "conf/optim/lion.yaml"}


def cited_paths(text: str) -> set[str]:
    import re

    packages = "|".join(p.name for p in (ROOT / "dalle_ablate").iterdir() if (p / "__init__.py").exists())
    rooted = rf"(?:{'|'.join(ROOTS)})/[\w/.-]*\.(?:py|md)"
    inside = rf"(?:{packages})/[\w/-]*\.py"
    return {m for m in re.findall(rf"(?<![\w/.-])((?:{rooted})|(?:{inside}))(?![\w/])", text)}


def test_every_path_the_code_and_docs_cite_exists():
    sources = [
        *(ROOT / "dalle_ablate").rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "tools").glob("*.py"),
    ]
    sources += [p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts and p.name != "CHANGELOG.md"]
    missing = [
        f"{p.relative_to(ROOT)}: {path}"
        for p in sources
        for path in sorted(cited_paths(p.read_text()) - EXAMPLES)
        if not (ROOT / path).exists() and not (ROOT / "dalle_ablate" / path).exists()
    ]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_a_citation_is_found_whole_and_only_as_a_path():
    text = "see report/page.py, `tests/stats/test_stages.py` and docs/guides/runs.md; not x/report/a.py or page.py"
    assert cited_paths(text) == {"report/page.py", "tests/stats/test_stages.py", "docs/guides/runs.md"}
