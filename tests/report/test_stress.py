"""Stability under stress (report/stress.py): the LR sensitivity, the largest rate that trains and
divergences on synthetic run stores with known curves, the values a verdict gets, the study file's
stress section and its errors, every stress run of the DALL·E Mega study composing, and the runs
themselves end to end (a rerun starts none of those that finished or diverged)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import SMALL_DATA, TINY_TRAIN
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import load_stress, run_name, stress_folder, study_path
from dalle_ablate.report.load import load_runs
from dalle_ablate.report.stress import claim_values, measures, stress_sections
from dalle_ablate.study.stress_runs import job_command
from dalle_ablate.track.runstore import settled
from dalle_ablate.validate import compose, to_run_config

RATES = [1e-3, 3e-3, 1e-2, 3e-2]
L0 = 5.0
FLOOR = 2.0  # the code frequencies' entropy: below it a run trains
DIV = math.inf
# arm -> seed -> final eval loss per rate (inf: diverged)
CURVES = {
    "steady": {0: [1.0, 0.8, 0.9, 1.2], 1: [1.1, 0.9, 1.0, 1.1]},
    "fragile": {0: [1.0, 0.8, 1.9, DIV], 1: [1.0, 0.85, 3.5, DIV]},
}


def write_store(root: Path, arm: str, lr: float, seed: int, final: float) -> None:
    store = root / run_name(arm, lr, seed) / "run"
    store.mkdir(parents=True)
    # Step 1's loss is L0; a diverged run logged finite losses only (the non-finite step never is).
    rows = [{"step": s, "train/loss": L0 if s == 1 else 2.0 + 1.0 / s} for s in range(1, 31)]
    if np.isfinite(final):
        rows.append({"step": 30, "eval/valid/loss": final})
    else:
        rows[25]["train/loss"] = 9.0  # a spike (> 1.5x the median of the 20 steps before) on its way out
        rows = rows[:26]
    (store / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (store / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "optim": {"lr": lr}}))
    (store / "meta.json").write_text(json.dumps({"overrides": [f"+arm={arm}", f"optim.lr={lr}", f"seed={seed}"]}))
    status = "finished" if np.isfinite(final) else "diverged"
    (store / "summary.json").write_text(
        json.dumps(
            {
                "status": status,
                "steps": 30 if status == "finished" else 25,
                "train/first_loss": L0,
                "data/code_unigram_entropy": FLOOR,
                "wall_time": 15.0 * (1 + seed),
            }
        )
    )


def study_file(tmp_path: Path, **stress) -> Path:
    spec = {
        "name": "synthetic",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "steady",
        "findings": [
            {
                "id": "steady-stabler",
                "claim": "steady is more stable than fragile",
                "arm": "fragile",
                "against": "steady",
                "metric": "lr_sensitivity",
                "expect": "higher",
            },
            {
                "id": "captions",
                "claim": "c",
                "arm": "fragile",
                "against": "steady",
                "metric": "shapes_all",
                "expect": "lower",
            },
        ],
        "stress": {"claims": ["steady-stabler"], "lr": RATES, "seeds": [0, 1], "steps": 30, **stress},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def synthetic(tmp_path):
    for arm, seeds in CURVES.items():
        for seed, finals in seeds.items():
            for lr, final in zip(RATES, finals):
                write_store(tmp_path / "runs", arm, lr, seed, final)
    return load_stress(study_file(tmp_path)), load_runs(str(tmp_path / "runs"))


def test_sensitivity_largest_rate_and_divergences_on_known_curves(tmp_path):
    plan, runs = synthetic(tmp_path)
    m = measures(plan, runs)
    # Wortsman et al.: mean over rates of min(loss, L0) minus the least; a diverged run counts as L0.
    assert m[("steady", 0)]["lr_sensitivity"] == pytest.approx((1.0 + 0.8 + 0.9 + 1.2) / 4 - 0.8)
    assert m[("fragile", 0)]["lr_sensitivity"] == pytest.approx((1.0 + 0.8 + 1.9 + 5.0) / 4 - 0.8)
    assert m[("fragile", 1)]["lr_sensitivity"] == pytest.approx((1.0 + 0.85 + 3.5 + 5.0) / 4 - 0.85)
    # Trains: a final loss below the code frequencies' entropy (2.0).
    assert m[("fragile", 0)]["log10_max_lr"] == pytest.approx(math.log10(1e-2))  # 1.9
    assert m[("fragile", 1)]["log10_max_lr"] == pytest.approx(math.log10(3e-3))  # 3.5 at 1e-2
    assert m[("steady", 1)]["log10_max_lr"] == pytest.approx(math.log10(3e-2))
    assert [m[("fragile", s)]["divergences"] for s in (0, 1)] == [1.0, 1.0]
    assert m[("steady", 0)]["divergences"] == 0.0


def test_claim_values_per_arm_and_seed_for_a_verdict(tmp_path):
    plan, runs = synthetic(tmp_path)
    (v,) = claim_values(plan, runs)
    assert (v["id"], v["arm"], v["against"], v["expect"]) == ("steady-stabler", "fragile", "steady", "higher")
    assert set(v["values"]) == {"fragile", "steady"} and set(v["values"]["fragile"]) == {0, 1}
    assert v["values"]["fragile"][1] == pytest.approx((1.0 + 0.85 + 3.5 + 5.0) / 4 - 0.85)
    # A stabler arm trains at higher rates: the claim's direction flips for that measure.
    (w,) = claim_values(plan, runs, "log10_max_lr")
    assert w["expect"] == "lower" and w["values"]["steady"][0] == pytest.approx(math.log10(3e-2))
    with pytest.raises(
        ConfigError, match="^stress measure 'spikes' is not one of: lr_sensitivity, log10_max_lr, divergences$"
    ):
        claim_values(plan, runs, "spikes")


def test_a_seed_with_a_missing_rate_has_no_value(tmp_path):
    plan, runs = synthetic(tmp_path)
    runs = [r for r in runs if r.root.parent.name != run_name("steady", 1e-2, 1)]
    m = measures(plan, runs)
    assert math.isnan(m[("steady", 1)]["lr_sensitivity"]) and math.isnan(m[("steady", 1)]["log10_max_lr"])
    assert np.isfinite(m[("steady", 0)]["lr_sensitivity"])


def test_the_page_section_has_the_figures_and_every_arm_and_seed(tmp_path):
    plan, runs = synthetic(tmp_path)
    (section,), values = stress_sections(plan, runs)
    assert len(section.images) == 2 and all(png[:8] == b"\x89PNG\r\n\x1a\n" for _, png in section.images)
    per_seed, per_arm = section.tables
    assert [row[:2] for row in per_seed[1]] == [["fragile", 0], ["fragile", 1], ["steady", 0], ["steady", 1]]
    assert per_seed[1][0][-1] == "diverged" and per_seed[1][0][-4:-1] == ["1.00", "0.800", "1.90"]
    assert per_seed[1][0][5] == "0 / 0 / 0 / 1"  # the diverged run's spike
    assert [row[0] for row in per_arm[1]] == ["fragile", "steady"] and per_arm[1][0][3] == 2
    assert "16 of 16 runs done" in section.text[0] and "Wortsman et al. 2023" in section.text[1]
    assert "their wall time adds up to 6 min" in section.text[0]  # 8 runs of 15 s (seed 0) and 8 of 30 s (seed 1)
    assert values == claim_values(plan, runs)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(lr=[1e-3, 1e-2]),
            "stress.lr=[0.001, 0.01] must be at least 3 distinct positive rates in increasing order",
        ),
        (
            dict(lr=[1e-2, 1e-3, 1e-1]),
            "stress.lr=[0.01, 0.001, 0.1] must be at least 3 distinct positive rates in increasing order",
        ),
        (
            dict(claims=["nosuch"]),
            "stress.claims names 'nosuch', not a finding of the study; valid: steady-stabler, captions",
        ),
        (
            dict(claims=["captions"]),
            "stress.claims: finding 'captions' has metric 'shapes_all'; a stress claim's metric must be "
            "lr_sensitivity (lower is more stable): it is judged on the stress runs",
        ),
        (dict(seeds=[0, 0]), "stress.seeds=[0, 0] must be a non-empty list of distinct integers >= 0"),
        (dict(steps=0), "stress.steps=0 must be an integer >= 1"),
    ],
)
def test_a_bad_stress_section_is_named_in_one_line(tmp_path, change, message):
    path = study_file(tmp_path, **change)
    with pytest.raises(ConfigError) as err:
        load_stress(path)
    assert str(err.value) == f"{path}: {message}"


def test_a_study_without_a_stress_section_has_no_stress_runs(tmp_path):
    path = study_file(tmp_path)
    spec = yaml.safe_load(path.read_text())
    del spec["stress"]
    path.write_text(yaml.safe_dump(spec))
    assert load_stress(path) is None


def test_every_stress_run_of_the_mega_study_composes():
    plan = load_stress(study_path("mega-variants"))
    assert plan is not None and plan.source
    arms = {p.stem for p in (Path(__file__).parents[2] / "dalle_ablate/conf/arm").glob("*.yaml")}
    assert set(plan.arms) <= arms and len(plan.jobs()) == len(plan.arms) * len(plan.rates) * len(plan.seeds)
    user = [
        "seed=0,1,2",
        "trainer.steps=1500",
        "data.num_train=1500",
    ]  # the study command's own: seeds and budget not passed on
    commands = {
        job: job_command(sys.executable, "study_mega", Path("/x/mega-variants-stress"), *job, plan, user)
        for job in plan.jobs()
    }
    for (arm, lr, seed), cmd in commands.items():
        assert cmd[:3] == [sys.executable, "-m", "dalle_ablate.job"]
        assert cmd[-1] == f"hydra.run.dir=/x/mega-variants-stress/{run_name(arm, lr, seed)}"
        # the seeds of an (arm, rate) differ in their seed alone: each composes if the first does
        first = commands[(arm, lr, plan.seeds[0])]
        assert [o for o in cmd[:-1] if o != f"seed={seed}"] == [o for o in first[:-1] if o != f"seed={plan.seeds[0]}"]
        if seed != plan.seeds[0]:
            continue
        cfg = to_run_config(compose(cmd[3:-1]))
        assert (cfg.optim.lr, cfg.seed, cfg.trainer.steps, cfg.resume) == (lr, seed, plan.steps, "auto")
        assert (
            cfg.data.num_train == 1500 and cfg.eval.metrics == [] and cfg.eval.grids == []
        )  # the plan's own overrides
        # the seeds of an arm and rate as members of one job, each in its own run's folder
        members = job_command(
            sys.executable, "study_mega", Path("/x/mega-variants-stress"), arm, lr, seed, plan, user, plan.seeds
        )
        assert members[-1] == f"hydra.run.dir=/x/mega-variants-stress/{run_name(arm, lr, seed)}".replace(
            f"-seed{seed}", "-seed${seed}"
        )
        cfg = to_run_config(compose(members[3:-1]))
        assert (cfg.seed, cfg.seeds, cfg.members.impl) == (plan.seeds[0], plan.seeds, "map")


@pytest.mark.slow
def test_stress_runs_end_to_end_and_a_rerun_starts_none_that_finished_or_diverged(tmp_path):
    from dalle_ablate.study.stress_runs import run_stress

    # Adam's first steps move every weight by about the rate: at 1e30 the attention logits pass
    # float32's 3.4e38 and the loss stops being finite.
    path = study_file(tmp_path, lr=[1e-3, 3e-3, 1e30], seeds=[0, 1], steps=6)
    spec = yaml.safe_load(path.read_text())
    spec["findings"][0].update(arm="swish", against="baseline")
    path.write_text(yaml.safe_dump(spec))
    env = dict(os.environ)  # the suite's compilation cache (conftest.py), as every run's
    folder = tmp_path / "studies" / "synthetic"
    # one evaluation and one checkpoint a run, at its end: the measures read the last evaluation alone;
    # one decoder layer: each of the 8 jobs traces a smaller step, and each of the 6 (arm, rate) pairs
    # compiles one (the rate is a constant of the program) -- a rate of 1e30 diverges at any depth
    overrides = [*SMALL_DATA, *TINY_TRAIN, "tracker=none", "trainer.eval_every=6", "trainer.save_every=6"]
    overrides.append("model.decoder_layers=1")
    first = run_stress(path, "study_mega", folder, overrides, env)  # each arm and rate's two seeds: one job's members
    assert first.failed == [] and "started 12 of them" in first.line and "as members of one job" in first.line
    where = stress_folder(folder)
    assert sorted(p.name for p in where.iterdir()) == sorted(
        run_name(a, lr, s) for a in ("swish", "baseline") for lr in (1e-3, 3e-3, 1e30) for s in (0, 1)
    )
    status = {p.parent.name: json.loads((p / "summary.json").read_text())["status"] for p in where.glob("*/run")}
    assert status[run_name("baseline", 1e30, 1)] == "diverged" and status[run_name("swish", 1e-3, 1)] == "finished"
    assert all(settled(json.loads((where / name / "run" / "summary.json").read_text()), 6) for name in status)
    meta = json.loads((where / run_name("swish", 1e-3, 1) / "run" / "meta.json").read_text())
    assert "seed=1" in meta["overrides"] and meta["members"]["seeds"] == [0, 1]  # the member is its separate run
    second = run_stress(path, "study_mega", folder, overrides, env)
    assert second.failed == [] and "started 0 of them" in second.line
    plan = load_stress(path)
    m = measures(plan, load_runs(str(where)))
    assert m[("baseline", 0)]["divergences"] == 1.0 and np.isfinite(m[("baseline", 0)]["lr_sensitivity"])
    # one process per run gives the same runs (members under map are their separate runs bit for bit):
    # two members set aside -- one that finished and one that diverged, of each arm, seed 1 (not the
    # job's first member) -- and the plan run again as a process per run, which starts those two alone
    aside = tmp_path / "members"
    kept = [run_name("swish", 1e-3, 1), run_name("baseline", 1e30, 1)]
    aside.mkdir()
    for name in kept:
        (where / name).rename(aside / name)
    alone = run_stress(path, "study_mega", folder, overrides, env, members=False)
    assert alone.failed == [] and "as members" not in alone.line and "started 2 of them" in alone.line
    for name in kept:
        a, b = (json.loads((w / name / "run" / "summary.json").read_text()) for w in (aside, where))
        assert (a["status"], a.get("eval/valid/loss")) == (b["status"], b.get("eval/valid/loss"))
        assert not json.loads((where / name / "run" / "meta.json").read_text()).get("members")  # its own process


def test_a_stability_finding_is_judged_on_the_stress_runs_values(tmp_path):
    """The study page's verdicts read a stress claim's per-seed LR sensitivity (stress.stress_measures
    into findings.compare): the paired difference is the mean over seeds of the two arms' sensitivities,
    computed here from the curves by hand, and Δ is 10 % of the baseline arm's mean sensitivity."""
    from dalle_ablate.report.study_file import load_study
    from dalle_ablate.report.findings import claims_tables, compare
    from dalle_ablate.report.stress import stress_measures

    for arm, seeds in CURVES.items():
        for seed, finals in seeds.items():
            for lr, final in zip(RATES, finals):
                write_store(stress_folder(tmp_path / "synthetic"), arm, lr, seed, final)
    path = study_file(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["findings"] = spec["findings"][:1]  # the stability claim alone
    path.write_text(yaml.safe_dump(spec))
    sections, extra, untestable = stress_measures(path, str(tmp_path / "synthetic"))
    assert [s.title for s in sections] == [
        "Stability under stress"
    ] and untestable == {}  # both arms train at some rate

    def sens(finals):
        capped = [min(f, L0) for f in finals]
        return sum(capped) / len(capped) - min(capped)

    by_hand = {arm: {s: sens(f) for s, f in seeds.items()} for arm, seeds in CURVES.items()}
    study = load_study(path)
    (row,) = compare(study, claims_tables(study, {}, extra))
    assert row.spread.n == (2, 2) and row.spread.seeds == [0, 1]
    assert row.diff == pytest.approx(np.mean([by_hand["fragile"][s] - by_hand["steady"][s] for s in (0, 1)]))
    assert row.margin == pytest.approx(0.1 * np.mean(list(by_hand["steady"].values())))
    assert stress_measures(path, str(tmp_path / "elsewhere")) == ([], {}, {})  # no stress runs there yet
    (stress_folder(tmp_path / "begun") / run_name("steady", RATES[0], 0)).mkdir(parents=True)  # a job that died early
    assert stress_measures(path, str(tmp_path / "begun")) == ([], {}, {})


def test_a_stability_claim_whose_arms_train_at_no_rate_is_untestable_not_a_seed_count(tmp_path):
    """Both arms at the code-frequency floor (or above) at every rate and seed, as post-LN and
    DeepNet were on the first stress grid: their sensitivities compare two untrained models, and the
    page says the claim is untestable on these runs instead of how many seeds it needs."""
    from dalle_ablate.report.study_file import load_study
    from dalle_ablate.report.findings import claims_tables, compare
    from dalle_ablate.report.stress import stress_measures

    stuck = {
        "steady": {0: [2.1, 2.0, 2.2, 2.4], 1: [2.05, 2.0, 2.3, 2.6]},
        "fragile": {0: [2.0, 2.1, 2.2, DIV], 1: [2.2, 2.0, 2.5, DIV]},
    }
    for arm, seeds in stuck.items():
        for seed, finals in seeds.items():
            for lr, final in zip(RATES, finals):
                write_store(stress_folder(tmp_path / "synthetic"), arm, lr, seed, final)
    path = study_file(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["findings"] = spec["findings"][:1]
    path.write_text(yaml.safe_dump(spec))
    _, extra, untestable = stress_measures(path, str(tmp_path / "synthetic"))
    assert untestable == {
        "steady-stabler": "neither fragile nor steady trains at any rate of the stress grid (0.001, 0.003, "
        "0.01, 0.03) on any seed: both end at or above the code-frequency floor"
    }
    study = load_study(path)
    (row,) = compare(study, claims_tables(study, {}, extra), untestable=untestable)
    assert row.verdict == "untestable here: " + untestable["steady-stabler"] and row.code == 5
    # one arm that trains at one rate on one seed makes the claim testable again
    (stress_folder(tmp_path / "synthetic") / run_name("steady", RATES[1], 1) / "run" / "metrics.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [{"step": s, "train/loss": L0 if s == 1 else 2.0 + 1.0 / s} for s in range(1, 31)]
            + [{"step": 30, "eval/valid/loss": 1.5}]
        )
    )
    assert stress_measures(path, str(tmp_path / "synthetic"))[2] == {}
