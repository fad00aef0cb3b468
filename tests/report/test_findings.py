"""`dalle-ablate study`: the verdict of each finding on synthetic run stores with known
differences, checked against Welch's interval in closed form; the study file's errors; and the
command end to end on a 2-arm, 2-seed study, rerun after a stop without repeating finished runs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as st

from conftest import SMALL_DATA, TINY_TRAIN
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.findings import load_study, page_sections, study_path
from dalle_ablate.report.load import find_stores, load_runs
from dalle_ablate.validate import compose, to_run_config

# Final eval losses per arm and seed.
ARMS = {
    "base": [1.0, 1.1, 0.9],
    "worse": [2.0, 2.1, 1.9],  # far above base
    "better": [0.5, 0.6, 0.4],  # far below base
    "noisy": [0.8, 1.3, 1.0],  # around base
    "edge_a": [1.3, 1.4, 1.5],  # 0.3 above edge_b: t = 3.67 on 4 df, between the 95% and Bonferroni quantiles
    "edge_b": [1.0, 1.1, 1.2],
}
FINDINGS = [  # (id, arm, against, expect, the verdict at 95%)
    ("worse-is-worse", "worse", "base", "higher", "reproduced"),
    ("better-is-worse", "better", "base", "higher", "contradicted"),
    ("better-is-better", "better", "base", "lower", "reproduced"),
    ("noisy", "noisy", "base", "higher", "not resolved at this scale"),
    ("edge", "edge_a", "edge_b", "higher", "reproduced"),
]


def write_store(root: Path, arm: str, seed: int, final: float) -> None:
    store = root / f"{arm}-seed{seed}" / "run"
    store.mkdir(parents=True)
    rows = [{"step": s, "train/loss": final + 1.0 / s, "perf/step_time": 0.1} for s in range(1, 11)]
    rows.append({"step": 10, "eval/valid/loss": final})
    (store / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (store / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "arm_marker": arm}))
    (store / "meta.json").write_text(json.dumps({"overrides": [f"+arm={arm}", f"seed={seed}"]}))
    (store / "summary.json").write_text(json.dumps({"status": "finished", "steps": 10}))


def study_file(tmp_path: Path, **changes) -> Path:
    spec = {"name": "synthetic", "title": "t", "source": "s", "experiment": "study_mega", "baseline": "base",
            "findings": [{"id": i, "claim": f"claim {i}", "arm": a, "against": b, "metric": "eval_loss", "expect": e}
                         for i, a, b, e, _ in FINDINGS]}
    spec.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def welch(a, b, level):
    """Welch's interval from its textbook formula (Welch-Satterthwaite degrees of freedom)."""
    a, b = np.asarray(a), np.asarray(b)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = st.t.ppf(0.5 + level / 2, df) * math.sqrt(va + vb)
    return a.mean() - b.mean() - half, a.mean() - b.mean() + half


def test_each_finding_gets_the_verdict_its_welch_interval_gives(tmp_path):
    for arm, finals in ARMS.items():
        for seed, final in enumerate(finals):
            write_store(tmp_path / "runs", arm, seed, final)
    study = load_study(study_file(tmp_path))
    sections, rows = page_sections(study, load_runs(str(tmp_path / "runs")), ["provenance line"])
    assert [r["verdict"] for r in rows] == [f[4] for f in FINDINGS]
    bonferroni = 1 - 0.05 / len(FINDINGS)
    for r, (_, a, b, _, _) in zip(rows, FINDINGS):
        lo, hi = welch(ARMS[a], ARMS[b], 0.95)
        assert (r["low"], r["high"]) == pytest.approx((lo, hi), rel=1e-9)
        assert r["diff"] == pytest.approx(np.mean(ARMS[a]) - np.mean(ARMS[b]))
        assert r["n"] == (3, 3) and r["bonferroni_level"] == pytest.approx(bonferroni)
    # The edge case is beyond the seed spread at 95% but not at the Bonferroni level.
    lo, hi = welch(ARMS["edge_a"], ARMS["edge_b"], bonferroni)
    assert lo < 0 < hi and rows[-1]["bonferroni_verdict"] == "not resolved at this scale"
    assert [r["bonferroni_verdict"] for r in rows[:2]] == ["reproduced", "contradicted"]
    summary = sections[0]
    assert "5 findings: 3 reproduced, 1 contradicted, 1 not resolved at this scale." in " ".join(summary.text)
    assert "provenance line" in summary.text


def test_a_multirun_s_stage_1_tokenizer_is_not_one_of_its_runs(tmp_path):
    write_store(tmp_path, "base", 0, 1.0)
    tok = tmp_path / "base-seed0" / "tokenizer"
    tok.mkdir()
    (tok / "metrics.jsonl").write_text(json.dumps({"step": 0, "tokenizer/mse": 0.0}))
    assert find_stores(str(tmp_path)) == [tmp_path / "base-seed0" / "run"]


@pytest.mark.parametrize("change, message", [
    ({"findings": [{"id": "x", "claim": "c", "arm": "a", "against": "b", "metric": "fid", "expect": "lower"}]},
     "finding 'x' has metric 'fid'; valid: eval_loss, train_loss, step_time, loss_spikes, shapes_all"),
    ({"findings": [{"id": "x", "claim": "c", "arm": "a", "against": "b", "metric": "eval_loss", "expect": "worse"}]},
     "finding 'x' has expect 'worse'; valid: lower, higher"),
    ({"findings": [{"id": "x", "claim": "c", "arm": "a", "metric": "eval_loss", "expect": "lower"}]},
     "finding 0 lacks against"),
])
def test_a_bad_study_file_is_named_in_one_line(tmp_path, change, message):
    path = study_file(tmp_path, **change)
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert str(err.value) == f"{path}: {message}"
    with pytest.raises(ConfigError, match=r"^study 'nosuch' is not one of: mega-variants \(or give a study file"):
        study_path("nosuch")


def test_the_mega_study_names_only_arms_its_preset_runs():
    study = load_study(study_path("mega-variants"))
    preset = yaml.safe_load((Path(__file__).parents[2] / "dalle_ablate/conf/experiment/study_mega.yaml").read_text())
    arms = set(preset["hydra"]["sweeper"]["params"]["+arm"].split(","))
    assert study.baseline in arms and all({f.arm, f.against} <= arms for f in study.findings)
    assert arms == {p.stem for p in (Path(__file__).parents[2] / "dalle_ablate/conf/arm").glob("*.yaml")}
    for arm in sorted(arms):  # each arm composes and passes the checks a run makes before it starts
        cfg = to_run_config(compose(["experiment=study_mega", f"+arm={arm}", "seed=0"]))
        assert cfg.trainer.steps == preset["trainer"]["steps"] and cfg.resume == "auto"


@pytest.mark.slow
def test_the_study_command_runs_every_arm_and_a_rerun_skips_what_finished(tmp_path):
    def study(*seeds: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "dalle_ablate.cli", "study", "mega-variants", "--out", str(tmp_path / "studies"),
               "--report-out", str(tmp_path / "reports"), "--page-out", str(tmp_path / "results"),
               "--no-stress",  # the study's stress runs: tests/report/test_stress.py
               "+arm=baseline,bias", f"seed={','.join(seeds)}", *SMALL_DATA, *TINY_TRAIN]
        # the study's own compilation cache (in its folder), not the suite's (conftest.py)
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)

    first = study("0")  # a study stopped after its seed-0 jobs
    assert first.returncode == 0, first.stderr[-2000:]
    folder = tmp_path / "studies" / "mega-variants"
    done = {p: p.read_bytes() for d in ("baseline-seed0", "bias-seed0") for p in (folder / d / "run").rglob("*") if p.is_file()}
    second = study("0", "1")
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.count("left as it is (resume=auto)") == 2
    assert {p: p.read_bytes() for p in done} == done  # the finished runs untouched
    assert sorted(p.name for p in folder.iterdir() if (p / "run").is_dir()) == ["baseline-seed0", "baseline-seed1", "bias-seed0", "bias-seed1"]
    page = (tmp_path / "results" / "mega-variants.md").read_text()
    assert "| baseline (baseline) | 0, 1 | 2/2 |" in page and "| bias | 0, 1 | 2/2 |" in page
    assert "| bias-convergence | dense biases hurt convergence | bias vs baseline |" in page
    assert "Runs: 4 (4 finished)" in page and "Commit of this page: " in page
    assert re.search(r"runs trained at [0-9a-f]{40}( \+ uncommitted changes)? \(4 runs\)\.", page)  # one commit trained all four
    figures = sorted(p.name for p in (tmp_path / "results" / "figures").iterdir())
    assert figures and all(f.startswith("mega-variants_") for f in figures)
    assert (tmp_path / "reports" / "mega-variants" / "index.html").is_file()
    assert any((folder / "jax_cache").iterdir())  # the later seeds of an arm load its compiled programs
