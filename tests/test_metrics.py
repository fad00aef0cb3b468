"""A metric is declared once, beside the code that computes it (dalle_ablate/metrics.py, issue 51):
the closing lines, the Pareto plot's axes, the W&B summaries, the report's labels and tables, a
study's findings and the generated reference all read the declaration. An evaluator registered from
this file alone, with its metric declared, reaches every one of them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from dalle_ablate import metrics
from dalle_ablate.evaluate import EVALUATORS, evaluator
from dalle_ablate.evaluate.runner import headline, number
from dalle_ablate.metrics import Metric, headlines, label, of_logged, pareto_axes
from dalle_ablate.track.wandb_tracker import best_of


@pytest.fixture
def restore_declarations():
    """The registries as they were: an evaluator and metric declared by a test are gone after it."""
    saved = [(d, dict(d)) for d in (metrics.METRICS, metrics.STUDY, EVALUATORS._items)]
    yield
    for d, items in saved:
        d.clear()
        d.update(items)


def test_the_wandb_summary_keeps_the_best_of_each_headline_on_its_declared_side():
    assert [m.key for m in headlines("run")] == [
        "eval/valid/loss",
        "train/loss",
    ]  # what the report's final table compares
    for m in headlines():
        for key in {m.logged(2.0), m.logged(0.5)}:
            assert of_logged(key) is m and best_of(key) == {"lower": "min", "higher": "max"}[m.better], key
    assert best_of("eval/rerank/s3/best_of4/shapes/all") == "max"  # best of N, as at its scale
    # declared but no headline, not declared, or a count beside a metric: no best
    for key in (
        "perf/step_time",
        "eval/pareto/s2/shapes/clean",
        "eval/pareto/s2/shapes/color",
        "train/lr",
        "eval/pareto/s2/shapes/one/all",
        "eval/caption_sensitivity/color_n",
    ):
        assert best_of(key) is None, key


def test_a_malformed_or_repeated_declaration_names_the_metric_and_the_field(restore_declarations):
    with pytest.raises(ValueError, match=r"^metric 'train/loss': declared twice$"):
        metrics.declare(Metric("train/loss", "x", "nats"))
    with pytest.raises(ValueError, match=r"^metric 'x': better 'up' is not one of"):
        metrics.declare(Metric("x", "x", "u", better="up"))
    with pytest.raises(ValueError, match=r"^metric 'y': margin '2 %' is not a number or N%$"):
        metrics.declare(Metric("y", "y", "u", margin="2 %"))
    with pytest.raises(ValueError, match=r"^metric 'z': study name 'eval_loss' declared twice$"):
        metrics.declare(Metric("z", "z", "u", study="eval_loss"))
    with pytest.raises(ValueError, match=r"^metric 'w': a report's measure needs value= or reads='given'$"):
        metrics.declare(Metric("w", "w", "u", source="report"))


def test_a_printed_number_has_no_negative_zero():
    assert [number(v, ".2f") for v in (-0.001, -0.0, 0.004, -0.006)] == ["0.00", "0.00", "0.00", "-0.01"]
    assert number(-1e-5, ".3g") == "-1e-05" and number(-0.0, ".3g") == "0"
    lines = headline({"model": {"eval/caption_sensitivity/color": -0.002, "eval/caption_sensitivity/shape": 1.5}})
    assert lines == ["caption sensitivity, nats per image: color 0.00, shape 1.50"]


def write_run(root, arm: str, seed: int, ink: float):
    """A run store of a study arm whose last evaluation logged toy/ink at guidance scales 1 and 2."""
    store = root / f"{arm}-seed{seed}" / "run"
    (store / "tables").mkdir(parents=True)
    (store / "metrics.jsonl").write_text(json.dumps({"step": 10, "train/loss": 1.0, "eval/valid/loss": 1.0}))
    (store / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
    (store / "meta.json").write_text(json.dumps({"overrides": [f"+arm={arm}", f"seed={seed}"]}))
    (store / "summary.json").write_text(json.dumps({"status": "finished", "steps": 10}))
    table = {
        "columns": ["run", "step", "scale", "n", "shapes/all", "toy/ink"],
        "line": ["toy/ink", "shapes/all"],
        "rows": [["r", 10, 1.0, 4, 0.5, 9.0], ["r", 10, 2.0, 4, 0.5, ink]],
    }
    (store / "tables" / "eval_pareto_10.json").write_text(json.dumps(table))


def test_an_evaluator_s_declared_metric_reaches_every_reader(tmp_path, restore_declarations):
    from dalle_ablate.docs import metrics_reference
    from dalle_ablate.report.study_file import load_study
    from dalle_ablate.report.findings import claims_tables, compare
    from dalle_ablate.report.load import load_runs
    from dalle_ablate.report.tables import headline_values
    from dalle_ablate.stats.verdicts import Margin

    @evaluator(
        "toy",
        "samples",
        metrics=[
            Metric(
                "ink",
                "stray ink",
                "fraction of drawn pixels",
                "lower",
                headline=99,
                pareto_against="shapes/all",
                study="toy_ink",
                margin="0.02",
            )
        ],
    )
    def toy(images, ctx):
        return {"ink": float(images.mean()), "n": float(len(images))}

    assert EVALUATORS.get("toy").fn(np.full((2, 4, 4, 3), 0.25), None) == {"ink": 0.25, "n": 2.0}
    rows = [
        {"scale": s, "n": 4, "shapes/all": 0.5, "shapes/all_lo": 0.2, "shapes/all_hi": 0.8, "toy/ink": 0.1 * s}
        for s in (1.0, 2.0)
    ]
    assert headline({"pareto": rows}) == [
        "shapes/all (n=4 per scale): s1 0.5 [0.20, 0.80], s2 0.5 [0.20, 0.80]",
        "toy/ink (n=4 per scale): s1 0.1, s2 0.2",
    ]
    assert (
        best_of("eval/pareto/s2/toy/ink") == "min"
        and label("toy/ink") == "toy/ink (fraction of drawn pixels, lower is better)"
    )
    assert pareto_axes(["shapes/all", "shapes/clean", "toy/ink"]) == (
        "toy/ink",
        "shapes/all",
    )  # a headline's pair first
    assert pareto_axes(["shapes/all", "shapes_fd/fd", "toy/ink"]) == ("shapes_fd/fd", "shapes/all")
    assert (
        "| `eval/pareto/s<scale>/toy/ink` | fraction of drawn pixels | lower | 99 | x, against `shapes/all` | "
        "`toy_ink`, 0.02 | stray ink |"
    ) in metrics_reference()
    # a study judges it at its guidance scale, with the declared margin
    inks = {"base": [0.10, 0.12, 0.11], "worse": [0.30, 0.33, 0.31]}
    for arm, values in inks.items():
        for seed, v in enumerate(values):
            write_run(tmp_path / "runs", arm, seed, v)
    spec = {
        "name": "s",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "base",
        "findings": [
            {
                "id": "ink",
                "claim": "worse draws more stray ink",
                "arm": "worse",
                "against": "base",
                "metric": "toy_ink",
                "expect": "higher",
            }
        ],
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    study = load_study(tmp_path / "s.yaml")
    assert study.findings[0].margin == Margin(0.02)
    runs = load_runs(str(tmp_path / "runs"))
    assert headline_values(runs[0])["toy/ink@s2"] in inks["base"] + inks["worse"]
    (row,) = compare(study, claims_tables(study, {a: [r for r in runs if r.name.startswith(a)] for a in inks}))
    assert row.diff == pytest.approx(np.mean(inks["worse"]) - np.mean(inks["base"]))
    assert row.margin == 0.02 and row.verdict == "reproduced"
    assert math.isclose(row.spread.arm_mean, np.mean(inks["worse"]))
