"""The documentation cannot rot: the generated references are current, every relative link and
anchor in README.md and docs/ resolves, and every `python run.py ...` command shown composes."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_generated_references_are_current():
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_ablate.docs", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout


def _reference_tables() -> list[list[str]]:
    """The cells of every field's row in the configuration reference, as generated now."""
    from dalle_ablate.docs import config_reference

    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in config_reference().splitlines() if line.startswith("| `")]
    return [[c.strip() for c in row] for row in rows if len(row) == 5]  # field | type | default | range | what it does


def test_every_field_of_the_configuration_reference_says_what_it_does():
    """Each field's comment in its schema is its description (the generator reads it): none is empty."""
    fields = _reference_tables()
    assert len(fields) > 250
    assert [row[0] for row in fields if not row[-1]] == []


def test_a_placeholder_in_a_description_stays_text():
    """`<step>`, `<name>`: written as &lt;, or the site would take them for HTML tags and show nothing."""
    from dalle_ablate.docs import cli_reference

    described = [row[-1] for row in _reference_tables()]
    assert any("&lt;" in d for d in described) and not any("<" in d for d in described)
    assert "reports/&lt;name>" in cli_reference() and "reports/<name>" not in cli_reference()


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"`|\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(link)
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def _run_py_commands() -> list[tuple[str, str]]:
    """(page, command) for every `python run.py ...` shown, in code blocks and inline code."""
    out = []
    for page in PAGES:
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # a command continued over lines
        for m in re.finditer(r"python run\.py[^`\n|]*", text):
            cmd = re.split(r"&&| # | \(|  ", m.group(0))[0].strip()
            out.append((str(page.relative_to(ROOT)), cmd))
    return sorted(set(out))


def _placeholder(cmd: str) -> bool:
    """A command with a placeholder (`<folder>`, `[sweeps]`, `NAME`, `field=value`) is a pattern, not a command."""
    return bool(re.search(r"<|…|\.\.\.|\[[\w.=]+\]|[A-Z]{3,}|\bfield=value|\ba=x", cmd))


# Commands the docs show failing on purpose (what a mistake prints): they must fail as a user's mistake.
MISTAKES = ("model=nosuch", "optim=lion")


COMMANDS = [c for c in _run_py_commands() if not _placeholder(c[1])]


def test_the_docs_show_run_py_commands():
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("page,cmd", COMMANDS, ids=[f"{p}:{c[14:60]}" for p, c in COMMANDS])
def test_every_run_py_command_shown_composes(page, cmd):
    """Composed in-process as `python run.py` would; a multirun's comma lists by their first value
    (Hydra's sweep syntax is the sweeper's); hydra.* settings are the launcher's, not the run's."""
    from dalle_ablate.validate import compose, to_run_config

    try:
        tokens = shlex.split(cmd)[2:]
    except ValueError as e:
        pytest.fail(f"{page}: {cmd}: {e}")
    overrides = []
    for tok in tokens:
        if tok.startswith("-") or tok.startswith("hydra") or tok.startswith("+hydra"):
            continue
        key, sep, value = tok.partition("=")
        if (
            sep
            and not value.startswith(("[", "'[", "{"))
            and "," in value
            and not value.startswith(("glob(", "range(", "choice(", "interval("))
        ):
            value = value.split(",")[0]
        if "(" in value:  # a sweep function (choice, interval, tag, range, glob): the sweeper's
            continue
        overrides.append(f"{key}{sep}{value}")
    if any(m in cmd for m in MISTAKES):
        from dalle_ablate.cli import format_error

        with pytest.raises(Exception) as e:
            to_run_config(compose(overrides))
        assert format_error(e.value) is not None, e.value  # a one-line user error, not a bug
        return
    to_run_config(compose(overrides))


def test_every_reference_from_code_to_a_page_or_heading_resolves():
    """`docs/x.md` in a comment or docstring names a page that exists, and `docs/x.md, "Heading"`
    (or `docs/x.md "Heading"`, `docs/x.md ("Heading"`) a heading that page has (or one it starts)."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.yaml", "*.toml", "*.md", ".ci/*"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    broken = []
    for f in tracked:
        if f == "tests/docs/test_docs.py":  # its own examples
            continue
        text = re.sub(r"\s*\n\s*#?\s*", " ", (ROOT / f).read_text())  # a reference wrapped over comment lines
        for m in re.finditer(r"\b(docs/[\w/.-]+\.md)(?:,? \(?\"([^\"]+)\")?", text):
            page, heading = (ROOT / m.group(1)), m.group(2)
            if not page.is_file():
                broken.append(f"{f}: {m.group(1)}")
            elif heading and not any(h.startswith(_slug(heading)) for h in _anchors(page)):  # a heading's start
                broken.append(f'{f}: {m.group(1)}, "{heading}"')
    assert broken == [], broken


def _describe_plan_lines() -> list[tuple[str, str]]:
    """(page, line) for every `dalle-ablate describe|plan ...` shown with real arguments."""
    out = set()
    for page in PAGES:
        for m in re.finditer(r"dalle-ablate (?:describe|plan)\b[^`|\n]*", page.read_text()):
            line = m.group(0).split(" # ")[0].split("  ")[0].strip().rstrip(",.;:)")
            if not re.search(r"\[|<|…|\.\.\.|[A-Z]{3,}", line):
                out.add((str(page.relative_to(ROOT)), line))
    return sorted(out)


DESCRIBE_PLAN = _describe_plan_lines()


@pytest.mark.parametrize("page,line", DESCRIBE_PLAN, ids=[f"{p}:{c[13:70]}" for p, c in DESCRIBE_PLAN])
def test_every_describe_and_plan_line_shown_runs(page, line, capsys):
    """Abstract shapes only: nothing is allocated, so even size=dalle12b runs in seconds."""
    from dalle_ablate.cli import main

    main(shlex.split(line)[1:])
    assert capsys.readouterr().out.strip(), f"{page}: {line} printed nothing"


def test_the_study_file_the_guide_shows_loads(tmp_path):
    """docs/guides/studies.md's example study file is one `dalle-ablate study` accepts."""
    from dalle_ablate.report.study_file import load_study

    text = (ROOT / "docs" / "guides" / "studies.md").read_text()
    example = text.split("## Writing your own study file", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my-norms.yaml").write_text(example)
    study = load_study(tmp_path / "my-norms.yaml")
    arms = {p.stem for p in (ROOT / "dalle_ablate" / "conf" / "arm").glob("*.yaml")}
    assert {study.baseline, *(f.arm for f in study.findings), *(f.against for f in study.findings)} <= arms
    assert (ROOT / "dalle_ablate" / "conf" / "experiment" / f"{study.experiment}.yaml").is_file()
