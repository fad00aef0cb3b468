"""A study in two declared stages (report/staged.py, dalle_ablate/study/stage2.py): its file's
`stages:` checked in one line; stage 2's plan on synthetic stores (the budget kept, nothing for an
arm no open finding needs); each finding's verdict at both looks against an oracle written from
scipy's paired t tests, the inverse-normal combination and the published boundaries; and the study
command end to end, a finding settling at stage 2, a rerun planning and training nothing again."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as st

from conftest import AT_THE_END, SMALL_DATA, TINY_TRAIN, replacing
from dalle_ablate.registry import ConfigError
from dalle_ablate.stats import stages as S
from dalle_ablate.report import staged
from dalle_ablate.report import prose as P
from dalle_ablate.stats import verdicts as V
from dalle_ablate.report.study_file import load_study
from dalle_ablate.report.findings import _arms_by, claims_tables
from dalle_ablate.report.load import load_runs
from test_findings import write_store

STAGES = {"declared": "2026-12-02, before stage 1", "budget": {"runs": 6}, "seeds_from": 10, "cap": 3}
# stage 1's three seeds per arm: "worse" far above "base" seed for seed, "close" a little above
# with noise of its own, "other" an arm only a settled finding names
STAGE1 = {
    "base": [1.0, 1.1, 0.9],
    "worse": [2.03, 2.08, 1.89],
    "close": [1.06, 1.13, 0.99],
    "other": [0.5, 0.6, 0.4],
}
# (id, arm, against, Δ): "close" differs by about twice its Δ
FINDINGS = [("worse", "worse", "base", "0.5"), ("close", "close", "base", "0.03"), ("other", "other", "worse", "0.5")]


def staged_study(tmp_path: Path, stages=None) -> Path:
    spec = {
        "name": "staged",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "base",
        "findings": [
            {"id": i, "claim": i, "arm": a, "against": b, "metric": "eval_loss", "expect": "higher", "margin": m}
            for i, a, b, m in FINDINGS
        ],
        "stages": STAGES if stages is None else stages,
    }
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(
    "stages, message",
    [
        ([1], "stages must be a mapping of declared, budget, seeds_from, cap, w1, boundaries, rule; it holds [1]"),
        (
            {**STAGES, "weights": 1},
            "stages has 'weights'; valid: declared, budget, seeds_from, cap, w1, boundaries, rule",
        ),
        (
            {k: v for k, v in STAGES.items() if k != "declared"},
            "stages lacks 'declared' (declare it before stage 1 runs)",
        ),
        ({**STAGES, "budget": 6}, "stages.budget is 6; give one of {runs: N}, {cpu_hours: H}"),
        ({**STAGES, "budget": {"runs": 0}}, "stages.budget.runs is 0; give a positive number"),
        ({**STAGES, "cap": 1}, "stages.cap is 1; give a whole number >= 2"),
        ({**STAGES, "w1": 1.0}, "stages.w1 is 1.0; give stage 1's weight in (0, 1), sqrt(n1 / (n1 + n2)) planned"),
        ({**STAGES, "boundaries": "OBF"}, "stages.boundaries is 'OBF'; valid: OF, P, asOF, asP"),
        ({**STAGES, "rule": "greedy"}, "stages.rule is 'greedy'; valid: budget, even"),
    ],
)
def test_a_bad_stages_declaration_is_named_in_one_line(tmp_path, stages, message):
    path = staged_study(tmp_path, stages)
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert str(err.value) == f"{path}: {message}"


def stores(tmp_path: Path, values: dict[str, list[float]], first_seed: int = 0) -> Path:
    root = tmp_path / "runs"
    for arm, finals in values.items():
        for i, v in enumerate(finals):
            write_store(root, arm, first_seed + i, v)
    return root


def test_the_plan_spends_its_budget_only_on_the_arms_of_findings_still_open(tmp_path):
    study = load_study(staged_study(tmp_path))
    runs = stores(tmp_path, STAGE1)
    record = staged.plan(study, _arms_by(load_runs(str(runs))), [0, 1, 2])
    # "worse" (a difference of 1 at an sd of 0.1 between seeds) settles at look 1, and with it
    # "other" against it (-1.5 at a small sd); only "close" (+0.06) is open: its two arms get seeds
    assert list(record["open"]) == ["close"]
    assert set(record["stage2"]) == {"close", "base"} and 0 < record["spent"] <= 6
    assert record["stage2"]["close"] == record["stage2"]["base"] == [10, 11, 12][: len(record["stage2"]["base"])]
    assert record["stage1"] == [0, 1, 2] and record["open"]["close"]["pairs"] == len(record["stage2"]["base"])
    assert 0 < record["open"]["close"]["chance"] <= 1
    # Δ fixed from stage 1's baseline, as declared: absolute margins here
    assert record["margins"] == {"worse": 0.5, "close": 0.03, "other": 0.5}
    # the even rule: every arm of an open finding alike, as many as the budget affords (6 runs / 2 arms)
    even = load_study(staged_study(tmp_path, {**STAGES, "rule": "even"}))
    assert staged.plan(even, _arms_by(load_runs(str(runs))), [0, 1, 2])["stage2"] == {
        "base": [10, 11, 12],
        "close": [10, 11, 12],
    }


def test_a_study_run_on_some_of_its_arms_plans_stage_2_in_cpu_hours_on_the_arms_it_ran(tmp_path):
    """A study whose `+arm=` left "other" out: that finding was never tested, so its arm gets no
    stage-2 seeds and needs no measured cost (the plan used to refuse, naming it)."""
    study = load_study(staged_study(tmp_path, {**STAGES, "budget": {"cpu_hours": 0.6}}))
    runs = stores(tmp_path, {a: v for a, v in STAGE1.items() if a != "other"})
    for summary in runs.glob("*/run/summary.json"):
        summary.write_text(json.dumps({"status": "finished", "steps": 10, "wall_time": 360.0}))
    record = staged.plan(study, _arms_by(load_runs(str(runs))), [0, 1, 2])
    assert list(record["open"]) == ["close"] and set(record["stage2"]) == {"close", "base"}
    assert record["seconds_per_run"] == {"base": 360.0, "worse": 360.0, "close": 360.0}
    k = len(record["stage2"]["base"])
    assert k >= 2 and record["spent"] == pytest.approx(2 * k * 0.1) and record["spent"] <= 0.6 + 1e-9


def test_no_stage_2_seed_goes_to_an_arm_only_a_settled_finding_names_even_at_no_cost(tmp_path):
    """Findings a vs c and a vs base open, b vs base settled at look 1: raising b vs base would lift
    base as much as raising a vs base does, and b costs nothing the budget counts (no open finding
    names it) -- so b must get no seeds, and the runs trained are the runs counted."""
    spec = yaml.safe_load(staged_study(tmp_path).read_text())
    spec["findings"] = [
        {"id": i, "claim": i, "arm": a, "against": b, "metric": "eval_loss", "expect": "higher", "margin": "0.03"}
        for i, a, b in (("a-vs-c", "a", "c"), ("b-vs-base", "b", "base"), ("a-vs-base", "a", "base"))
    ]
    (tmp_path / "staged.yaml").write_text(yaml.safe_dump(spec))
    values = {"base": [1.0, 1.1, 0.9], "a": [1.06, 1.13, 0.99], "c": [1.0, 1.08, 0.93], "b": [2.03, 2.08, 1.89]}
    runs = stores(tmp_path, values)
    record = staged.plan(load_study(tmp_path / "staged.yaml"), _arms_by(load_runs(str(runs))), [0, 1, 2])
    assert list(record["open"]) == ["a-vs-c", "a-vs-base"] and "b" not in record["stage2"]
    assert sum(map(len, record["stage2"].values())) == record["spent"] <= 6


def oracle_z(a: np.ndarray, b: np.ndarray) -> float:
    """A stage's one-sided score of arm a above arm b: Φ⁻¹(1 - p) of scipy's paired t test."""
    return float(st.norm.isf(st.ttest_rel(a, b, alternative="greater").pvalue))


def test_each_finding_is_judged_at_both_looks_as_the_combination_test_and_holm_say(tmp_path):
    """Stage 2 on "close" and "base" (seeds 10-12): by look 2 its combined statistic, from scipy's
    two paired t tests, passes the boundary Holm's step asks (one finding left, the others settled
    at look 1: α/2 per side), which stage 1's alone did not; its interval is the repeated one."""
    study = load_study(staged_study(tmp_path))
    second = {"base": [1.2, 0.95, 1.05], "close": [1.27, 1.01, 1.12]}
    runs = stores(tmp_path, STAGE1)
    record = {
        **staged.plan(study, _arms_by(load_runs(str(runs))), [0, 1, 2]),
        "stage2": {a: [10, 11, 12] for a in second},
    }
    stores(tmp_path, second, first_seed=10)
    stores(tmp_path, {"worse": [9.0]}, first_seed=10)  # a seed the plan did not give "worse": in no stage
    by_arm = _arms_by(load_runs(str(runs)))
    rows = staged.judge_study(study, claims_tables(study, by_arm), record)
    verdicts = {r.finding.id: (r.look1, P.VERDICTS[r.code]) for r in rows}
    combination = study.stages.combination
    z1 = oracle_z(np.array(STAGE1["close"]), np.array(STAGE1["base"]))
    z2 = oracle_z(np.array(second["close"]), np.array(second["base"]))
    c1, c2 = S.boundaries(0.05 / 2, combination.w1**2, combination.kind)  # Holm's last step: one finding, α/2 a side
    assert z1 < c1 and combination.w1 * z1 + combination.w2 * z2 >= c2  # the oracle: settled by look 2, not at look 1
    # and beyond its Δ of 0.03 too (its repeated interval above it): reproduced
    assert verdicts["close"] == ("not resolved", "reproduced")
    assert verdicts["worse"][0] == "reproduced, possibly smaller than Δ"
    assert verdicts["other"] == ("contradicted (reversed)", "contradicted (reversed)")
    stage_n = {r.finding.id: r.stage_n for r in rows}
    assert stage_n == {"worse": (3, 0), "close": (3, 3), "other": (3, 0)}  # worse's seed 10 is in no stage
    close = next(r for r in rows if r.finding.id == "close")
    d = lambda x, y: np.array(x) - np.array(y)  # noqa: E731
    a, b = d(STAGE1["close"], STAGE1["base"]), d(second["close"], second["base"])
    (_, want) = S.repeated_interval(
        a.mean(), a.std(ddof=1) / math.sqrt(3), 2, b.mean(), b.std(ddof=1) / math.sqrt(3), 2, combination, 0.025
    )
    assert (close.low, close.high) == pytest.approx(want) and close.low > 0.03
    assert close.stage_n == (3, 3) and min(a.mean(), b.mean()) <= close.diff <= max(a.mean(), b.mean())


def test_a_rejected_difference_is_on_the_side_whose_test_rejected_it():
    """Two findings: the first settles by look 2 through its combined statistic (up); that frees
    Holm's level for the second, which its stage-1 statistic alone then rejects -- on the down side,
    though its combined one points up. Its side is the side that rejected it."""
    combination = S.Combination()
    up1, up2 = np.array([1.0, -3.0]), np.array([6.0, 3.5])
    sides = [(up1, up2), (-up1, -up2)]
    _, by2 = S.holm_by_look(sides, 0.05, combination, np.ones(2, bool), split=2)
    assert by2.tolist() == [True, True]
    side1, side2 = S.sides_by_look(sides, 0.05, combination, np.ones(2, bool))
    assert side1.tolist() == [0, 0] and side2.tolist() == [1, -1]
    assert combination.w1 * up1[1] + combination.w2 * up2[1] > 0  # the combined statistic's sign would have said higher


def test_a_claim_judged_once_has_the_fixed_design_test_at_its_level():
    """A hypothesis of one look (a stress claim) at Holm's level a: stage 1's z past Φ⁻¹(1 - a)
    rejects it at look 1 and by look 2, whatever the group-sequential boundaries would ask."""
    combination = S.Combination()
    z1 = np.array([2.3, 2.3])  # between the fixed critical value 1.96 and look 1's 2.96 (α = 0.025)
    z2 = np.array([-np.inf, -np.inf])
    at1, by2 = S.holm_by_look([(z1, z2)], 0.025, combination, np.array([True, False]), single=np.array([True, False]))
    assert at1.tolist() == [True, False] and by2.tolist() == [True, False]
    none1, none2 = S.holm_by_look(
        [(z1, z2)], 0.025, combination, np.array([True, True]), single=np.array([False, False])
    )
    assert not none1.any() and not none2.any()


# The suite's tiny runs with one validation and one checkpoint each, at their last step (a run's
# hooks all run there; the plan and the verdicts read the final evaluation): the same training, so
# the same numbers and verdicts, with one evaluation and one save fewer in each of the study's runs.
LEAN_TRAIN = replacing(TINY_TRAIN, *AT_THE_END)


@pytest.mark.slow
def test_a_staged_study_runs_stage_2_from_its_plan_and_a_rerun_neither_plans_nor_trains_again(tmp_path):
    """Adafactor against Adam, 2 seeds at stage 1 and up to 3 more each: the study plans stage 2 from
    stage 1's runs, keeps the plan, trains it beside stage 1's runs; the page has both looks."""
    spec = {
        "name": "tiny-staged",
        "title": "A staged study",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "baseline",
        "findings": [
            {
                "id": "adafactor-loss",
                "claim": "Adafactor ends at another loss",
                "arm": "adafactor",
                "against": "baseline",
                "metric": "eval_loss",
                "expect": "higher",
                "margin": "2%",
            }
        ],
        "stages": {**STAGES, "budget": {"runs": 6}, "w1": math.sqrt(2 / 5)},
    }
    path = tmp_path / "tiny-staged.yaml"
    path.write_text(yaml.safe_dump(spec))

    def study() -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "dalle_ablate.cli", "study", str(path), "--out", str(tmp_path / "studies")]
        cmd += ["--report-out", str(tmp_path / "reports"), "--page-out", str(tmp_path / "results")]
        cmd += ["+arm=baseline,adafactor", "seed=0,1", *SMALL_DATA, *LEAN_TRAIN, "tracker=none"]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=dict(os.environ))

    first = study()
    assert first.returncode == 0, first.stderr[-3000:]
    folder = tmp_path / "studies" / "tiny-staged"
    record = json.loads((folder / staged.RECORD).read_text())
    assert record["stage1"] == [0, 1] and record["budget"] == {"runs": 6.0}
    assert "stage 2 of study tiny-staged, by its budget rule: " in first.stdout
    trained = sorted(p.name for p in folder.iterdir() if (p / "run" / "summary.json").exists())
    want = sorted(
        [f"{a}-seed{s}" for a in ("baseline", "adafactor") for s in (0, 1)]
        + [f"{a}-seed{s}" for a, seeds in record["stage2"].items() for s in seeds]
    )
    assert trained == want
    page = (tmp_path / "results" / "tiny-staged.md").read_text()
    assert "## The stages" in page and "Stage 1: seeds 0, 1; look 1 settled 0 of the 1 findings." in page
    row = next(line for line in page.splitlines() if line.startswith("| adafactor-loss | not resolved |"))
    *_, seeds, by_look_2 = row.strip("| ").split(" | ")
    n2 = len(record["stage2"]["adafactor"])
    assert seeds == f"2 + {n2}" and n2 >= 2 and by_look_2 in P.VERDICTS[: V.NOT_RESOLVED]  # settled at stage 2
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file() and "run" in p.parts}
    again = study()
    assert again.returncode == 0, again.stderr[-3000:]
    assert "stage 2 of study" not in again.stdout  # the plan kept is the plan
    assert json.loads((folder / staged.RECORD).read_text()) == record
    assert {p: p.stat().st_mtime_ns for p in before} == before  # nothing trained again


REPORT_STAGES = {**STAGES, "budget": {"runs": 6}, "cap": 2}


def test_a_staged_report_plans_stage_2_then_judges_both_looks_as_the_combination_test_and_holm_say(tmp_path, capsys):
    """`dalle-ablate report --stages`: stage 1 (seeds 0-2) plans stage 2 by the rule, with the
    commands that train it; with stage 2's runs, each comparison's verdict by look 2 is the one
    an oracle from scipy's paired t tests, the inverse-normal combination and the published
    boundaries gives, stepping down Holm's levels over the report's four comparisons (the two
    variants on eval/valid/loss and train/loss, which write_store logs 0.1 above it)."""
    from dalle_ablate.report.build import build_sections

    design_file = tmp_path / "design.yaml"
    design_file.write_text(yaml.safe_dump({"stages": REPORT_STAGES}))
    stages = staged.read_stages(str(design_file))
    first = {a: STAGE1[a] for a in ("base", "worse", "close")}
    runs = stores(tmp_path, first)
    margins = {"eval/valid/loss": "0.03"}
    sections, info = build_sections(load_runs(str(runs)), "+arm=base", margins=margins, stages=stages)
    record = info["stages"]
    assert record["stage1"] == [0, 1, 2] and record["spent"] <= 6
    planned = record["stage2"]
    assert set(planned) <= {"+arm=base", "+arm=close", "+arm=worse"} and "+arm=base" in planned
    text = next(s for s in sections if s.key == "stages").text
    for variant, seeds in planned.items():
        assert f"`python run.py -m {variant} seed={','.join(map(str, seeds))}`" in text[-1]

    z = lambda a, b: float(st.norm.isf(st.ttest_rel(a, b, alternative="greater").pvalue))  # noqa: E731
    w1, w2, kind = stages.combination.w1, stages.combination.w2, stages.combination.kind
    c = {m: S.boundaries(0.05 / (2 * m), w1**2, kind) for m in (4, 2)}  # Holm's steps, α/2 a side
    worse1 = z(np.array(first["worse"]), np.array(first["base"]))
    close1 = z(np.array(first["close"]), np.array(first["base"]))
    assert close1 < worse1 < c[4][0]  # the oracle at look 1: nothing past Holm's first step
    assert all(j["look1"] == "not resolved" for j in info["judged"].values())

    assert planned["+arm=close"] == planned["+arm=base"] == [10, 11]
    # a seed of neither stage, and a stage-1 seed still training, change nothing: the plan is stage 1's
    stores(tmp_path, {"close": [9.0]}, first_seed=50)
    stores(tmp_path, {"worse": [0.1]}, first_seed=3)
    (runs / "worse-seed3" / "run" / "summary.json").write_text(json.dumps({"status": "running"}))
    _, info = build_sections(load_runs(str(runs)), "+arm=base", margins=margins, stages=stages)
    assert info["stages"] == record
    second = {"base": [1.2, 0.95], "close": [1.27, 1.01]}
    stores(tmp_path, second, first_seed=10)
    _, info = build_sections(load_runs(str(runs)), "+arm=base", margins=margins, stages=stages)
    assert info["stages"] == record  # planned from stage 1 alone: the same plan at every report
    close2 = z(np.array(second["close"]), np.array(second["base"]))
    # the oracle by look 2: close's combined statistic past Holm's first step (both its metrics
    # alike), which leaves two comparisons, and worse's look-1 statistic past that step's look-1 boundary
    assert w1 * close1 + w2 * close2 >= c[4][1] and worse1 >= c[2][0]
    judged = info["judged"]
    for v in ("+arm=close", "+arm=worse"):
        assert judged[(v, "train/loss")]["verdict"] == "worse than the baseline"
    d = np.array(second["close"]) - np.array(second["base"])
    d1 = np.array(first["close"]) - np.array(first["base"])
    (_, want) = S.repeated_interval(
        d1.mean(),
        d1.std(ddof=1) / math.sqrt(3),
        2,
        d.mean(),
        d.std(ddof=1) / math.sqrt(2),
        1,
        stages.combination,
        0.025,
    )
    close = judged[("+arm=close", "eval/valid/loss")]
    assert close["stage_n"] == (3, 2) and (close["low"], close["high"]) == pytest.approx(want)
    assert want[0] > 0.03 and close["verdict"] == "worse than the baseline by more than Δ"  # beyond Δ = 0.03

    from dalle_ablate.cli import main  # the command: the same plan kept beside the report, and its section

    main(
        ["report", str(runs), "--out", str(tmp_path / "reports"), "--name", "r", "--baseline", "+arm=base"]
        + ["--margin", "eval/valid/loss=0.03", "--stages", str(design_file)]
    )
    assert json.loads((tmp_path / "reports" / "r" / "stages.json").read_text()) == json.loads(json.dumps(record))
    assert "## The stages" in (tmp_path / "reports" / "r" / "report.md").read_text()
    # its kept plan freezes the design and the margins it judges under (issue 70): w1, the
    # boundaries or a margin chosen after stage 2 was seen is refused in one line, nothing rewritten
    kept = (tmp_path / "reports" / "r" / "stages.json").read_bytes()
    spec = yaml.safe_load(design_file.read_text())
    for change, margin, message in [
        (
            {"w1": 0.6},
            "0.03",
            "its stage 2 was planned under stages.w1 = 0.7071067811865476, now 0.6; a changed design",
        ),
        ({"boundaries": "P"}, "0.03", "its stage 2 was planned under stages.boundaries = 'asOF', now 'P'; a changed"),
        ({}, "0.05", "froze the margins "),
    ]:
        design_file.write_text(yaml.safe_dump({**spec, "stages": {**spec["stages"], **change}}))
        with pytest.raises(SystemExit) as e:
            main(
                ["report", str(runs), "--out", str(tmp_path / "reports"), "--name", "r", "--baseline", "+arm=base"]
                + ["--margin", f"eval/valid/loss={margin}", "--stages", str(design_file)]
            )
        assert e.value.code == 2
        assert message in capsys.readouterr().err
        assert (tmp_path / "reports" / "r" / "stages.json").read_bytes() == kept


def test_a_bad_stages_file_of_a_report_is_named_in_one_line(tmp_path):
    from dalle_ablate.report.staged import read_stages

    with pytest.raises(ConfigError) as err:
        read_stages(str(tmp_path / "none.yaml"))
    assert str(err.value) == (
        f"--stages {tmp_path / 'none.yaml'}: no such file; give a YAML file with a stages: mapping (a study file's)"
    )
    (tmp_path / "plain.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError) as err:
        read_stages(str(tmp_path / "plain.yaml"))
    assert str(err.value) == (
        f"--stages {tmp_path / 'plain.yaml'}: no stages: mapping in it (docs/statistics.md, 'Studies in stages')"
    )
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"stages": {**STAGES, "cap": 1}}))
    with pytest.raises(ConfigError) as err:
        read_stages(str(tmp_path / "bad.yaml"))
    assert str(err.value) == f"{tmp_path / 'bad.yaml'}: stages.cap is 1; give a whole number >= 2"
