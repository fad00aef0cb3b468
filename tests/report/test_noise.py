"""The noise report (report/noise.py) on run stores built for the test, each number against a direct
computation: the evaluation set's share from statsmodels' OLS of a per-scene loss on run and scene
(the interaction is its residual), one run's sd and its chi-square interval, the last evaluations'
mean, and a comparison's paired numbers; the page and the report carry the section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st
from statsmodels.formula.api import ols

from dalle_ablate.report import noise
from dalle_ablate.report.load import load_run, load_runs

SCENES, STEPS = 40, (60, 70, 80, 90, 100)


def write_store(root: Path, arm: str, seed: int, per_scene: np.ndarray, drift: float) -> None:
    """A finished run whose last validation scored `per_scene`; its earlier evaluations above it by
    `drift` per 10 steps."""
    store = root / f"{arm}-seed{seed}" / "run"
    (store / "tables").mkdir(parents=True)
    final = float(per_scene.mean())
    rows = [{"step": s, "eval/valid/loss": final + drift * (STEPS[-1] - s) / 10} for s in STEPS]
    (store / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = {"columns": ["example", "loss"], "rows": [[i, float(v)] for i, v in enumerate(per_scene)], "line": None}
    (store / "tables" / f"eval_valid_examples_{STEPS[-1]}.json").write_text(json.dumps(table))
    (store / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
    (store / "meta.json").write_text(json.dumps({"overrides": [f"+arm={arm}", f"seed={seed}"]}))
    (store / "summary.json").write_text(json.dumps({"status": "finished", "steps": STEPS[-1]}))


@pytest.fixture
def stores(tmp_path):
    rng = np.random.default_rng(0)
    difficulty = rng.gamma(2.0, 0.1, SCENES)  # what every run finds hard
    values = {}
    for arm, shift in (("base", 0.0), ("other", 0.05)):
        for seed in range(4):
            run_effect = rng.normal(0, 0.02)  # the seed's: the same in both arms, plus the arm's own
            v = difficulty + shift + run_effect + rng.normal(0, 0.01) + rng.normal(0, 0.03, SCENES)
            values[arm, seed] = v
            write_store(tmp_path / "runs", arm, seed, v, drift=0.01 * (1 + seed))
    by_arm = {}
    for r in load_runs(str(tmp_path / "runs")):
        by_arm.setdefault(r.meta["overrides"][0].split("=")[1], []).append(r)
    return by_arm, values


def test_the_evaluation_set_share_is_the_run_by_scene_interaction_over_the_scenes(stores):
    by_arm, values = stores
    table = np.stack([values["base", s] for s in range(4)])
    frame = pd.DataFrame([{"y": table[r, c], "run": r, "scene": c} for r in range(4) for c in range(SCENES)])
    fit = ols("y ~ C(run) + C(scene)", frame).fit()  # no replication: the residual is the interaction
    var, share, n = noise.eval_set_share(by_arm["base"])
    assert n == 4 and var == pytest.approx(fit.mse_resid / SCENES)
    assert share == pytest.approx(fit.mse_resid / SCENES / table.mean(1).var(ddof=1))
    assert noise.interaction(table) == (pytest.approx(fit.mse_resid), fit.df_resid)


def test_the_arms_rows_give_each_arm_s_spread_its_interval_and_the_last_evaluations(stores):
    by_arm, values = stores
    cols, rows = noise.ARM_COLUMNS, noise.arm_rows(by_arm)
    row = dict(zip(cols, next(r for r in rows if r[0] == "base")))
    finals = np.array([values["base", s].mean() for s in range(4)])
    sd = finals.std(ddof=1)
    lo, hi = np.sqrt(3 * sd**2 / st.chi2.ppf([0.975, 0.025], 3))
    assert row["seeds"] == 4 and row["scenes"] == SCENES
    assert row["final eval loss: mean"] == pytest.approx(finals.mean()) and row["sd of one run"] == pytest.approx(sd)
    assert row["its 95% CI"] == f"[{lo:.3g}, {hi:.3g}]"
    # the last five evaluations' mean: the final plus the drift of the four before it, 0.01 (1 + seed) x (4+3+2+1)/5
    last = finals + np.array([0.01 * (1 + s) * 10 / 5 for s in range(4)])
    assert row[f"sd of the mean of the last {noise.LAST} evaluations"] == pytest.approx(last.std(ddof=1))


def test_a_comparison_s_row_is_its_paired_seeds(stores):
    by_arm, values = stores
    row = dict(zip(noise.PAIR_COLUMNS, noise.pair_row("other-vs-base", by_arm["other"], by_arm["base"])))
    a = np.array([values["other", s].mean() for s in range(4)])
    b = np.array([values["base", s].mean() for s in range(4)])
    assert row["seeds"] == 4 and row["sd of a seed's difference"] == pytest.approx(np.std(a - b, ddof=1))
    assert row["rho"] == pytest.approx(np.corrcoef(a, b)[0, 1])
    d = np.stack([values["other", s] - values["base", s] for s in range(4)])
    frame = pd.DataFrame([{"y": d[r, c], "run": r, "scene": c} for r in range(4) for c in range(SCENES)])
    fit = ols("y ~ C(run) + C(scene)", frame).fit()
    assert row["of its variance: the evaluation set"] == pytest.approx(fit.mse_resid / SCENES / (a - b).var(ddof=1))


def test_runs_without_per_scene_losses_leave_the_share_unmeasured(stores, tmp_path):
    by_arm, _ = stores
    for r in by_arm["base"][1:]:
        for p in (Path(r.root) / "tables").glob("eval_valid_examples_*.json"):
            p.unlink()
        r.valid_losses = load_run(Path(r.root)).valid_losses  # the store read again: a run read with its tables
    assert math.isnan(noise.eval_set_share(by_arm["base"])[1])
    assert by_arm["base"][1].valid_losses is None and len(by_arm["base"][0].valid_losses) == SCENES
