"""The late-seed view (issue 59, report/transitions.py) on run stores built for the test: every
seed's eval loss falls from a plateau to a floor along a logistic curve whose drop is placed at a
known step. A seed whose drop is shifted later is named, the seeds on time are not, a run that
never drops reads "not reached", and noisy curves on time are not called late -- on the study's
page, in `dalle-ablate report` and in a sweep's re-check. The expected transition of each curve is
found here by root-finding on the continuous curve (scipy's brentq), not by the rule's code."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml
from scipy.optimize import brentq

from test_findings import write_store
from dalle_ablate.cli import main
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import load_study
from dalle_ablate.report.load import load_runs
from dalle_ablate.report.page import page_sections, write_page
from dalle_ablate.report.transitions import Rule, arm_transitions, late_lines, late_section, transition_step

EVERY = 100  # steps between evaluations
STEPS = np.arange(EVERY, 1501, EVERY)
LEVEL = Rule().level
# the shape of issue 59's curves: a fast early fall, a plateau at 0.30, a drop to 0.15 when the
# run learns to follow captions
PLATEAU, FLOOR, WIDTH, EARLY, TAU = 0.30, 0.15, 40.0, 1.5, 70.0
ON_TIME = {3001: 600.0, 3002: 650.0, 3003: 620.0}  # each seed's drop, in steps
LATE_DROP = 1000.0


def curve(s, drop: float) -> np.ndarray:
    """The eval loss at steps `s` of a run whose plateau ends at `drop`: decreasing everywhere."""
    s = np.asarray(s, float)
    return FLOOR + (PLATEAU - FLOOR) / (1 + np.exp((s - drop) / WIDTH)) + EARLY * np.exp(-s / TAU)


def expected_step(drop: float) -> float | None:
    """The first evaluation step after the continuous curve crosses LEVEL (it stays below after: the
    curve decreases), or None where it crosses after the last evaluation."""
    if curve(STEPS[-1], drop) >= LEVEL:
        return None
    crossing = brentq(lambda s: curve(s, drop) - LEVEL, 1.0, float(STEPS[-1]))
    return float(EVERY * math.floor(crossing / EVERY) + EVERY)


def write_curve(root: Path, arm: str, seed: int, values: np.ndarray) -> Path:
    """A run store of `arm` and `seed` (test_findings.write_store: its config, overrides, summary)
    whose eval loss is `values` at STEPS, its train loss a little above it."""
    write_store(root, arm, seed, float(values[-1]))
    store = root / f"{arm}-seed{seed}" / "run"
    rows = [{"step": int(s), "train/loss": float(v) + 0.01, "perf/step_time": 0.1} for s, v in zip(STEPS, values)]
    rows += [{"step": int(s), "eval/valid/loss": float(v)} for s, v in zip(STEPS, values)]
    (store / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return store


def write_arms(root: Path, late: dict[int, float | None]) -> None:
    """baseline: the seeds on time, and each seed of `late` with its drop (None: never); bias: every
    seed on time, 0.01 above the baseline's curve."""
    drops = {**ON_TIME, **{s: d if d is not None else 10 * STEPS[-1] for s, d in late.items()}}
    for seed, drop in sorted(drops.items()):
        write_curve(root, "baseline", seed, curve(STEPS, drop))
    for seed, drop in ON_TIME.items():
        write_curve(root, "bias", seed, curve(STEPS, drop) + 0.01)


def test_the_transition_is_the_first_evaluation_below_the_level_found_on_the_curve():
    for drop in (350.0, 480.0, 620.0, 1010.0, 1330.0):
        expected = expected_step(drop)
        assert expected is not None and transition_step(STEPS, curve(STEPS, drop), LEVEL, 2) == expected
    # issue 59's numbers: the late seed leaves the plateau ~350 steps after the others
    assert expected_step(LATE_DROP) - np.median([expected_step(d) for d in ON_TIME.values()]) >= 300
    # one evaluation dipping below the level on the plateau is not the transition; the run's last one counts alone
    dip = curve(STEPS, 900.0)
    dip[3] = LEVEL - 0.02
    assert transition_step(STEPS, dip, LEVEL, 2) == expected_step(900.0) and expected_step(900.0) > STEPS[3]
    assert transition_step(STEPS, dip, LEVEL, 1) == STEPS[3]
    ends = np.full(len(STEPS), PLATEAU)
    ends[-1] = LEVEL - 0.01
    assert transition_step(STEPS, ends, LEVEL, 2) == STEPS[-1]
    assert transition_step(STEPS, np.full(len(STEPS), PLATEAU), LEVEL, 2) is None
    assert transition_step(STEPS, np.full(len(STEPS), math.nan), LEVEL, 2) is None


def test_a_seed_made_late_is_named_and_the_seeds_on_time_are_not(tmp_path):
    write_arms(tmp_path / "runs", {3000: LATE_DROP})
    runs = load_runs(str(tmp_path / "runs"))
    by_arm = {a: [r for r in runs if r.variant.endswith(a)] for a in ("baseline", "bias")}
    assert [len(rs) for rs in by_arm.values()] == [4, 3]
    arms = [arm_transitions(a, rs, Rule()) for a, rs in by_arm.items()]
    base = arms[0]
    assert {s.seed: s.step for s in base.seeds} == {
        s: expected_step(d) for s, d in {3000: LATE_DROP, **ON_TIME}.items()
    }
    median = np.median([expected_step(d) for d in (LATE_DROP, *ON_TIME.values())])
    assert base.median == median and base.interval == EVERY
    late = expected_step(LATE_DROP)
    assert late_lines(arms) == [
        f"baseline: seed 3000 is late (transition at step {late:g}; the arm's median {median:g})."
    ]
    assert [s.seed for a in arms for s in a.seeds if s.late] == [3000]


def test_a_run_that_never_transitions_reads_not_reached(tmp_path):
    write_arms(tmp_path / "runs", {3000: None})
    runs = load_runs(str(tmp_path / "runs"))
    section = late_section({"baseline": [r for r in runs if r.variant.endswith("baseline")]}, Rule(), "late")
    median = np.median([expected_step(d) for d in ON_TIME.values()] + [math.inf])
    line = f"baseline: seed 3000 is late (transition not reached; the arm's median {median:g})."
    assert section.text[1:] == [line]
    ((cols, rows),) = section.tables
    assert rows[0][1].startswith("3000: not reached, 3001: ") and rows[0][-1] == "3000"
    assert len(section.images) == 1
    # most seeds never transitioning: the arm's median is not reached and no seed is late against it
    never = {s: None for s in (3000, 3001, 3002)}
    write_arms(tmp_path / "most", never)
    most = [r for r in load_runs(str(tmp_path / "most")) if r.variant.endswith("baseline")]
    arm = arm_transitions("baseline", most, Rule())
    assert arm.median is None and not any(s.late for s in arm.seeds)
    assert late_section({"baseline": most}, Rule(), "late").text[1] == "No seed is late by this rule."


@pytest.mark.parametrize("seed", range(3))
def test_noisy_curves_on_time_are_not_called_late_and_a_late_one_still_is(seed):
    """Twenty arms of four seeds whose drops lie within an evaluation interval of each other, each
    evaluation off its curve by 1 % noise (the plateau's own wiggle, 0.29-0.30): none is late; the
    same noise on a seed whose drop is 400 steps later: that one is."""
    rng = np.random.default_rng(seed)

    def noisy(drop):
        return curve(STEPS, drop) * (1 + 0.01 * rng.standard_normal(len(STEPS)))

    def arm(drops):
        return [_run(s, noisy(d)) for s, d in enumerate(drops)]

    arms = [arm_transitions(f"arm {i}", arm(600 + rng.uniform(-50, 50, 4)), Rule()) for i in range(20)]
    assert late_lines(arms) == []
    drops = [*(600 + rng.uniform(-50, 50, 3)), 1000.0]
    late = arm_transitions("late", arm(drops), Rule())
    assert [s.seed for s in late.seeds if s.late] == [3]


def _run(seed: int, values: np.ndarray):
    """A run of `seed` with eval loss `values` at STEPS, in memory."""
    import pandas as pd

    from dalle_ablate.report.load import Run

    frame = pd.DataFrame({"step": STEPS, "eval/valid/loss": values})
    return Run(f"seed {seed}", Path("."), {"seed": seed}, {}, {"status": "finished"}, frame)


STUDY = {
    "name": "synthetic",
    "title": "t",
    "source": "s",
    "experiment": "study_mega",
    "baseline": "baseline",
    "findings": [
        {"id": "bias-hurts", "claim": "biases hurt", "arm": "bias", "against": "baseline", "metric": "eval_loss"}
        | {"expect": "higher"}
    ],
}


def test_the_study_page_names_the_late_seed_under_its_noise_report_and_judges_every_seed(tmp_path):
    write_arms(tmp_path / "runs", {3000: LATE_DROP})
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(STUDY))
    study = load_study(tmp_path / "study.yaml")
    path = write_page(study, str(tmp_path / "runs"), tmp_path / "docs" / "results", ["provenance"])
    text = path.read_text()
    noise = text.split("## Noise report\n", 1)[1].split("\n## ", 1)[0]
    part = noise.split("### Late seeds\n", 1)[1]
    median = np.median([expected_step(d) for d in (LATE_DROP, *ON_TIME.values())])
    line = (
        f"baseline: seed 3000 is late (transition at step {expected_step(LATE_DROP):g}; the arm's median {median:g})."
    )
    assert [t for t in part.splitlines() if ": seed " in t] == [line]
    assert re.search(r"\(\S*statistics\.md#late-seeds\)", part)  # the rule's link
    assert "seed 3001" not in part and "seed 3002" not in part and "bias:" not in part
    figure = re.search(r"!\[[^\]]*\]\((figures/synthetic_late_0\.png)\)", part)
    assert figure and (path.parent / figure.group(1)).is_file()
    # the verdict is the same as without the view: the late seed is one of the seeds it judges
    _, rows = page_sections(study, load_runs(str(tmp_path / "runs")), [])
    (row,) = rows
    assert row.spread.seeds == [3001, 3002, 3003]  # the seeds bias ran; 3000 is the baseline's own
    assert row.spread.against_mean == pytest.approx(np.mean([curve(STEPS, d)[-1] for d in ON_TIME.values()]))


def test_a_study_declares_its_own_level_and_a_bad_one_is_one_line(tmp_path):
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({**STUDY, "transition": {"level": 0.2, "late_after": 3}}))
    assert load_study(tmp_path / "study.yaml").transition == Rule(level=0.2, confirm=2, late_after=3.0)
    for bad, why in (
        ({"levels": 0.2}, r"transition has 'levels'; valid: level, confirm, late_after"),
        ({"level": -1}, r"transition.level is -1; give a positive number"),
        ({"confirm": 1.5}, r"transition.confirm is 1.5; give a whole number of evaluations, 1 or more"),
        (0.2, r"transition must be a mapping of level, confirm, late_after"),
    ):
        (tmp_path / "study.yaml").write_text(yaml.safe_dump({**STUDY, "transition": bad}))
        with pytest.raises(ConfigError, match=rf"study.yaml: {why}"):
            load_study(tmp_path / "study.yaml")


def test_the_report_names_the_late_seed_in_html_and_markdown(tmp_path, capsys):
    write_arms(tmp_path / "runs", {3000: LATE_DROP})
    main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "reports"), "--name", "r"])
    md = (tmp_path / "reports" / "r" / "report.md").read_text()
    html = (tmp_path / "reports" / "r" / "index.html").read_text()
    part = md.split("## Late seeds\n", 1)[1].split("\n## ", 1)[0]
    median = np.median([expected_step(d) for d in (LATE_DROP, *ON_TIME.values())])
    variant = "+arm=baseline"
    line = (
        f"{variant}: seed 3000 is late (transition at step {expected_step(LATE_DROP):g}; "
        f"the variant's median {median:g})."
    )
    assert [t for t in part.splitlines() if ": seed " in t] == [line]
    assert f"<p>{line}</p>".replace("'", "&#x27;") in html
    assert re.search(r"!\[[^\]]*\]\((figures/late_0\.png)\)", part)
    # a level no seed's curve reaches: no transition, so no seed is late
    main(
        [
            "report",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "reports"),
            "--name",
            "q",
            "--transition-level",
            "0.1",
        ]
    )
    md = (tmp_path / "reports" / "q" / "report.md").read_text()
    assert "No seed is late by this rule." in md and " is late (" not in md
    with pytest.raises(SystemExit) as stop:
        main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "reports"), "--transition-level", "-1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: --transition-level -1: give a positive loss, in nats per image token\n"


def test_a_sweep_s_recheck_names_the_late_seed_among_its_runs(tmp_path, caplog):
    """Two trials re-checked on seeds 3000-3003, their members' run stores as the trainer leaves
    them (members.json, each member's run store): seed 3000 of trial 0 leaves the plateau late."""
    from dalle_ablate.sweep.recheck import collect

    study = optuna.create_study()
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for x, v in ((0.1, 0.2), (0.2, 0.21)):
        study.add_trial(optuna.trial.create_trial(params={"x": x}, distributions=space, value=v))
    seeds = [3000, *ON_TIME]
    for number, drops in ((0, [LATE_DROP, *ON_TIME.values()]), (1, list(ON_TIME.values()) + [640.0])):
        job, members = tmp_path / "recheck" / f"trial{number}", []
        for seed, drop in zip(seeds, drops):
            store = write_curve(job, "x", seed, curve(STEPS, drop) + 0.01 * number)
            summary = json.loads((store / "summary.json").read_text())
            (store / "summary.json").write_text(json.dumps({**summary, "eval/valid/loss": curve(STEPS, drop)[-1]}))
            members.append({"seed": seed, "job_dir": str(store.parent), "status": "finished", "reason": ""})
        (job / "members.json").write_text(json.dumps({"seeds": seeds, "members": members}))
    with caplog.at_level(logging.INFO, logger="dalle_ablate.sweep.recheck"):
        record = collect(study.trials, ["", ""], tmp_path / "recheck", seeds, "eval/valid/loss", True, None)
    median = np.median([expected_step(d) for d in (LATE_DROP, *ON_TIME.values())])
    line = (
        f"trial 0: seed 3000 is late (transition at step {expected_step(LATE_DROP):g}; the trial's median {median:g})."
    )
    assert record["late_seeds"] == [line] and f"re-check: {line}" in caplog.messages
    assert record["trials"][0]["recheck_values"][0] == pytest.approx(curve(STEPS, LATE_DROP)[-1])  # judged with it
