"""The study's results page reads on its own (issue 41): every arm spelled out from its conf/arm/
file, every number with its unit to three significant digits, a caption under each figure, a
note per claim where the study gives one, a link to the statistics page that resolves; and its
provenance lines (study.runner.provenance, from its run_study: issue 39)."""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT
from test_findings import write_store
from dalle_ablate.registry import ConfigError
from dalle_ablate.stats import verdicts as V
from dalle_ablate.report.study_file import load_study, study_path
from dalle_ablate.report.findings import unit_of
from dalle_ablate.report.page import arm_definition, page_sections, write_page
from dalle_ablate.study.runner import provenance
from dalle_ablate.report.load import load_runs
from dalle_ablate.report.tables import fmt3

# Final eval losses per arm and seed; the arms are the package's own (conf/arm/).
FINALS = {"baseline": [1.0, 1.1, 0.9], "bias": [1.21, 1.33, 1.04], "swish": [0.987, 1.12, 0.884]}
FINDINGS = [
    {
        "id": "bias-hurts",
        "claim": "biases hurt",
        "arm": "bias",
        "against": "baseline",
        "metric": "eval_loss",
        "expect": "higher",
        "note": "the arm's biases are in every dense layer",
    },
    {
        "id": "swish-loss",
        "claim": "swish is no worse",
        "arm": "swish",
        "against": "baseline",
        "metric": "eval_loss",
        "expect": "lower",
        "margin": "0.05",
    },
    {
        "id": "swish-time",
        "claim": "swish is faster",
        "arm": "swish",
        "against": "baseline",
        "metric": "step_time",
        "expect": "lower",
    },
]


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """(the page's Markdown, its path, the comparison rows), written once from synthetic runs."""
    root = tmp_path_factory.mktemp("page")
    for arm, finals in FINALS.items():
        for seed, final in enumerate(finals):
            write_store(root / "runs", arm, seed, final)
            # step times that differ by arm and seed, so that no difference is exactly 0: multiples of 1/64 s,
            # exact in binary and in the microseconds a report reads them to, so each arm's difference from
            # the baseline is the same at every seed (a seeds cell of "–": no noise to plan with)
            metrics = root / "runs" / f"{arm}-seed{seed}" / "run" / "metrics.jsonl"
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            for r in rows:
                if "perf/step_time" in r:
                    r["perf/step_time"] = 0.125 + 0.015625 * seed + {"bias": 0.015625, "swish": -0.03125}.get(arm, 0.0)
            metrics.write_text("\n".join(json.dumps(r) for r in rows))
    spec = {
        "name": "synthetic",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "baseline",
        "findings": FINDINGS,
    }
    (root / "study.yaml").write_text(yaml.safe_dump(spec))
    study = load_study(root / "study.yaml")
    path = write_page(study, str(root / "runs"), root / "docs" / "results", ["a provenance line"])
    _, rows = page_sections(study, load_runs(str(root / "runs")), [])
    return path.read_text(), path, rows


def table_after(text: str, heading: str) -> list[dict]:
    """The first Markdown table under `## heading`, as one dict per row."""
    part = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in part.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def three_digits(number: str) -> bool:
    """Whether a printed number has three significant digits: a decimal point or an exponent fixes
    them (0.500, 1.20e+05); a whole number of 100 or more shows three, then zeros (9550)."""
    mantissa = number.lstrip("-−").split("e")[0]
    digits = mantissa.replace(".", "").lstrip("0")
    if "." in mantissa or "e" in number:
        return len(digits) == 3
    return len(digits) >= 3 and set(digits[3:]) <= {"0"}


NUMBER = r"−?-?\d+(?:\.\d+)?(?:e[+-]\d+)?"


@pytest.mark.parametrize("seed", range(3))
def test_a_number_prints_to_three_significant_digits_and_reads_back_within_rounding(seed):
    rng = np.random.default_rng(seed)
    for v in rng.choice([-1, 1], 200) * 10.0 ** rng.uniform(-7, 8, 200):
        text = fmt3(v)
        assert re.fullmatch(NUMBER, text) and three_digits(text), (v, text)
        assert float(text) == pytest.approx(v, rel=0.5e-2)
    assert fmt3(0.5) == "0.500" and fmt3(9.996, "s") == "10.0 s" and fmt3(math.nan) == "–" and fmt3(7) == "7"


def test_every_arm_of_the_study_is_spelled_out_from_its_conf_file(page):
    from dalle_ablate.validate import compose

    text, _, _ = page
    rows = {r["arm"].removesuffix(" (baseline)"): r for r in table_after(text, "The arms")}
    swept = ["baseline", "bias", "swish"]  # the baseline, then the arms its findings compare, in the file's order
    assert list(rows) == swept and rows["baseline"]["arm"] == "baseline (baseline)"
    base = compose(["experiment=study_mega"])
    for arm in swept:
        head = (ROOT / "dalle_ablate/conf/arm" / f"{arm}.yaml").read_text().split("\n\n")[0]
        comment = [line[1:].strip() for line in head.splitlines() if line.startswith("#") and "@package" not in line]
        assert comment and rows[arm]["what it is"] == " ".join(comment)
        # the overrides as shown, given on the command line instead of +arm=, compose the arm's config
        shown = re.findall(r"`([^`]+)`", rows[arm]["overrides"])
        assert shown == arm_definition(arm)[1]
        composed = compose(["experiment=study_mega", *shown])
        assert OmegaConf.to_yaml(composed) == OmegaConf.to_yaml(compose(["experiment=study_mega", f"+arm={arm}"]))
        assert (composed == base) == (arm == "baseline")  # an arm other than the baseline differs from it
    assert rows["baseline"]["overrides"].startswith("none")


def test_the_summary_gives_each_claim_its_verdict_its_difference_in_margins_and_its_seeds(page):
    """The first table: a row per finding, the difference and its 95 % interval in units of its
    margin Δ, + on the side the claim predicts (as the forest plot draws it), to 3 digits."""
    text, _, rows = page
    head = text.split("## Summary\n", 1)[1].split("\n## ", 1)[0]
    assert head.index("| finding |") < head.index("![")  # the table, then the forest plot, before any other section
    table = table_after(text, "Summary")
    assert list(table[0]) == [
        "finding",
        "claim (metric)",
        "verdict",
        "difference in Δ (95% CI)",
        "seeds used / plan (range) / for Δ",
    ]
    for cells, r in zip(table, rows):
        f = r.finding
        assert cells["finding"] == f.id and cells["claim (metric)"] == f"{f.claim} ({f.metric})"
        assert r.verdict.startswith(cells["verdict"])
        side = 1 if f.expect == "higher" else -1
        d, low, high = (float(x) for x in re.findall(NUMBER, cells["difference in Δ (95% CI)"]))
        assert d == pytest.approx(side * r.diff / r.margin, rel=0.5e-2, abs=1e-9)
        assert (low, high) == pytest.approx(
            sorted((side * r.low / r.margin, side * r.high / r.margin)), rel=0.5e-2, abs=1e-9
        )
        assert cells["difference in Δ (95% CI)"].startswith("+") == (d > 0)
        used, plan, needed = cells["seeds used / plan (range) / for Δ"].split(" / ")
        assert int(used) == len(r.spread.seeds) == 3 and needed == (str(r.spread.needed) if r.spread.needed else "–")
        # a plan (at the observed difference, its range across the 95 % interval) only where not resolved
        count = lambda n: f"> {V.MAX_SEEDS}" if n > V.MAX_SEEDS else str(n)  # noqa: E731
        planned, fewest, most = r.spread.plan
        flat = fewest == most == planned
        assert plan == (
            "–" if r.code != V.NOT_RESOLVED else count(planned) + ("" if flat else f" ({count(fewest)}–{count(most)})")
        )
    assert {r.code == V.NOT_RESOLVED for r in rows} == {True, False}  # both kinds of plan cell above


def test_the_full_table_gives_every_number_its_unit_and_three_digits(page):
    text, _, rows = page
    table = table_after(text, "Every finding in full")
    assert [r["finding"] for r in table] == [f["id"] for f in FINDINGS]
    for cells, r in zip(table, rows):
        unit = unit_of(r.finding.metric)
        for col in ("Δ margin", "arm", "vs", "difference", "95% CI", "family-wise CI", "Welch 95% CI"):
            numbers = re.findall(NUMBER, cells[col].split(" (")[0])
            assert numbers and all(three_digits(n) for n in numbers), (col, cells[col])
            assert cells[col].split(" (")[0].endswith(f" {unit}"), (col, cells[col])
        assert three_digits(cells["rho"])
        # the numbers are the comparison's, rounded
        numbers = (
            ("arm", r.spread.arm_mean),
            ("vs", r.spread.against_mean),
            ("difference", r.diff),
            ("Δ margin", r.margin),
        )
        for col, number in numbers:
            assert float(re.search(NUMBER, cells[col]).group()) == pytest.approx(number, rel=0.5e-2)
        low, high = map(float, re.findall(NUMBER, cells["95% CI"]))
        assert (low, high) == pytest.approx((r.low, r.high), rel=0.5e-2)
    assert unit_of("eval_loss") == "nats per image token" and unit_of("step_time") == "s"
    assert rows[0].spread.needed > 0 and rows[-1].spread.needed == 0  # each kind of seeds cell above


def test_each_figure_has_its_caption_under_it(page):
    text, path, _ = page
    lines = text.splitlines()
    figures = [i for i, line in enumerate(lines) if line.startswith("![")]
    assert len(figures) == 2 + len(FINDINGS)  # the forest plot, the courses, one per finding
    for i in figures:
        alt, target = re.fullmatch(r"!\[(.*)\]\((.*)\)", lines[i]).groups()
        following = next(line for line in lines[i + 1 :] if line.strip())
        assert following == f"*{alt}*" and len(alt.split()) > 8  # a sentence saying what it shows
        assert (path.parent / target).is_file()
    curves = [lines[i] for i in figures[2:]]
    assert all("nats per image token" in c for c in curves) and "(s)" in curves[-1]  # each panel's unit


def test_the_claims_notes_and_the_statistics_link_are_on_the_page(page, tmp_path):
    text, path, _ = page
    notes = text.split("## Notes on the findings\n", 1)[1].split("\n## ", 1)[0]
    assert "bias-hurts: the arm's biases are in every dense layer" in notes and "swish" not in notes
    links = re.findall(r"\]\(([^)]*statistics\.md)\)", text)
    assert links and all((path.parent / link).resolve() == (ROOT / "docs" / "statistics.md") for link in links)
    # written in docs/results/, the page links the statistics page next to it
    assert (ROOT / "docs" / "results" / page_sections.__defaults__[-1]).resolve() == ROOT / "docs" / "statistics.md"
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "title": "t",
                "source": "s",
                "experiment": "study_mega",
                "baseline": "baseline",
                "findings": [{**FINDINGS[0], "note": ["a", "list"]}],
            }
        )
    )
    with pytest.raises(ConfigError, match="finding 'bias-hurts' has note"):
        load_study(bad)


def test_the_mega_study_s_shampoo_note_names_the_rate_its_arm_runs_at():
    study = load_study(study_path("mega-variants"))
    (shampoo,) = [f for f in study.findings if f.arm == "shampoo"]
    lr = next(o for o in arm_definition("shampoo")[1] if o.startswith("optim.lr="))
    assert lr in shampoo.note


def test_the_provenance_lines_name_the_command_the_commits_and_the_runs():
    def run(status, wall, commit, dirty=False):
        return types.SimpleNamespace(
            summary={"status": status, "wall_time": wall}, meta={"git": {"commit": commit, "dirty": dirty}}
        )

    runs = [run("finished", 60.0, "aaa"), run("finished", 90.0, "aaa"), run("stopped", 30.0, "bbb", dirty=True)]
    command = ["python", "-m", "dalle_ablate.job", "-m", "experiment=study_mega", "hydra.sweep.dir=out dir"]
    lines = provenance("mega-variants", "5", ["seed=0,1", "x=a b"], command, runs, 125.0, True, "stress line")
    assert lines[0] == (
        "Command: `dalle-ablate study mega-variants --seeds 5 seed=0,1 'x=a b'` "
        "(runs: `-m dalle_ablate.job -m experiment=study_mega 'hydra.sweep.dir=out dir'`)."
    )
    assert lines[1].endswith("runs trained at aaa (2 runs), bbb + uncommitted changes (1 runs).")
    assert lines[2] == (
        "Runs: 3 (2 finished); their wall time adds up to 3.00 min; this invocation took 2.08 min (runs "
        "finished before it are skipped, not repeated)."
    )
    assert lines[3] == "stress line"
    quiet = provenance("s.yaml", None, [], command, runs[:1], 0.0, False)
    assert len(quiet) == 3 and quiet[0].startswith("Command: `dalle-ablate study s.yaml` ")
    assert quiet[2].endswith("this invocation ran nothing (--no-run).")


# The page's layout as a reader sees it on the docs site at 1400 px (headless Chromium, tools/browser.py):
# the first table and every figure, each image's size as shown against its size as drawn.
LAYOUT = """(() => {
  const t = document.querySelector('.md-content table'), wrap = t.closest('.md-typeset__scrollwrap') || t.parentElement;
  const imgs = [...document.querySelectorAll('.md-content img')].map(i => [i.getAttribute('src'), i.clientWidth, i.naturalWidth]);
  const h2 = [...document.querySelectorAll('.md-content h2')].map(h => h.textContent.replace('¶', '').trim());
  return {table: [t.scrollWidth, wrap.clientWidth, wrap.scrollWidth], imgs, h2,
          forest: document.querySelector('.md-content img').getBoundingClientRect().top + window.scrollY,
          content: document.querySelector('.md-content__inner').clientWidth};
})()"""


def test_the_summary_and_its_figures_read_at_1400_px_on_the_site(tmp_path, monkeypatch):
    """The summary table fits the content column without scrolling sideways; every figure draws its
    text at figures.MIN_PT or more and is shown at 80 % of its size or more, so no text is under
    10 px at the page's width; the answer (summary, forest plot) comes before the noise report and
    the details."""
    import os
    import shutil
    import subprocess
    import sys

    import matplotlib.text

    from dalle_ablate.report import figures

    sys.path.insert(0, str(ROOT / "tools"))
    from browser import Browser, chromium_path

    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must provide Chromium: .ci/run installs Debian's chromium package")
        pytest.skip("no chromium (apt-get install chromium)")
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -c constraints.txt -e '.[docs]'")
    smallest, drawn = [], figures.png

    def spy(fig) -> bytes:  # the smallest text each figure draws, as it is saved
        sizes = [
            t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()
        ]
        smallest.append(min(sizes))
        return drawn(fig)

    monkeypatch.setattr(figures, "png", spy)
    for arm, finals in FINALS.items():
        for seed, final in enumerate(finals):
            write_store(tmp_path / "runs", arm, seed, final)
    spec = {
        "name": "synthetic",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "baseline",
        "findings": FINDINGS,
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    docs = tmp_path / "docs"
    write_page(load_study(tmp_path / "study.yaml"), str(tmp_path / "runs"), docs / "results", ["provenance"])
    assert len(smallest) == 2 + len(FINDINGS) and min(smallest) >= figures.MIN_PT
    (docs / "stylesheets").mkdir()
    shutil.copy(ROOT / "docs" / "stylesheets" / "extra.css", docs / "stylesheets")
    (tmp_path / "mkdocs.yml").write_text(  # the site's theme and CSS (mkdocs.yml), this page alone
        "site_name: t\ntheme:\n  name: material\n  features: [navigation.sections]\nextra_css: [stylesheets/extra.css]\n"
        "markdown_extensions: [tables, attr_list, {toc: {permalink: true}}]\nnav:\n  - Results:\n    - Study: results/synthetic.md\n"
    )
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    with Browser() as browser:
        browser.open((tmp_path / "site" / "results" / "synthetic" / "index.html").as_uri(), 1400, 1000)
        got = browser.evaluate(LAYOUT)
    table, wrap, scrolled = got["table"]
    assert table <= wrap and scrolled <= wrap, got["table"]  # no sideways scrolling
    assert got["h2"][:3] == ["Summary", "Noise report", "How these verdicts were reached"]
    assert [Path(src).name for src, *_ in got["imgs"]][0] == "synthetic_summary_0.png"  # the forest plot first
    assert got["forest"] < 1000  # of three findings: on the first screen, under the table
    for src, shown, natural in got["imgs"]:
        assert shown >= 0.8 * natural and figures.MIN_PT * figures.DPI / 72 * shown / natural >= 10, (
            src,
            shown,
            natural,
        )
    assert got["content"] >= figures.FIT_IN * figures.DPI * 0.95  # what FIT_IN stands for
