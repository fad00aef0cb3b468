"""`dalle-ablate study`: the verdict of each finding on synthetic run stores with known
differences, checked against scipy's paired t test, statsmodels' TOST, power and Holm, and Welch's
interval in closed form; the study file's errors; and the command end to end on a 2-arm, 2-seed
study, rerun after a stop without repeating finished runs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats as st
from statsmodels.formula.api import ols
from statsmodels.stats.anova import anova_lm
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import ttost_paired
import pandas as pd

from conftest import AT_THE_END, SMALL_DATA, TINY_TRAIN, replacing
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import prose as P
from dalle_ablate.stats import verdicts as V
from dalle_ablate.report.study_file import load_study, study_path
from dalle_ablate.report.findings import claims_tables, compare
from dalle_ablate.report.page import page_sections, write_page
from dalle_ablate.study.runner import provenance
from dalle_ablate.report.load import find_stores, load_runs
from dalle_ablate.validate import compose, to_run_config

# Final eval losses per arm and seed.
ARMS = {  # each arm the baseline's seeds shifted, plus a little noise of its own
    "base": [1.0, 1.1, 0.9],
    "worse": [2.03, 2.08, 1.89],  # far above base, seed for seed
    "better": [0.48, 0.63, 0.39],  # far below base
    "noisy": [0.97, 1.15, 0.88],  # around base
    "same": [1.02, 1.10, 0.91],  # base + 0.01: within a margin of 0.5
    "slightly": [1.45, 1.60, 1.30],  # base + 0.45: beyond 0, neither beyond nor within a margin of 0.5
}
FINDINGS = [  # (id, arm, against, expect, margin, the verdict)
    ("worse-is-worse", "worse", "base", "higher", None, "reproduced"),
    ("better-is-worse", "better", "base", "higher", None, "contradicted (reversed)"),
    ("better-is-better", "better", "base", "lower", "0.1", "reproduced"),
    ("noisy", "noisy", "base", "higher", "2%", "not resolved: "),  # then the plan and 62 seeds for Δ: below
    ("same", "same", "base", "higher", "0.5", "no meaningful effect (equivalent within ±Δ)"),
    ("slightly", "slightly", "base", "higher", "0.5", "reproduced, possibly smaller than Δ"),
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
    spec = {
        "name": "synthetic",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "base",
        "findings": [
            {
                "id": i,
                "claim": f"claim {i}",
                "arm": a,
                "against": b,
                "metric": "eval_loss",
                "expect": e,
                **({"margin": m} if m else {}),
            }
            for i, a, b, e, m, _ in FINDINGS
        ],
    }
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


def test_each_finding_gets_the_verdict_of_its_own_paired_differences(tmp_path):
    for arm, finals in ARMS.items():
        for seed, final in enumerate(finals):
            write_store(tmp_path / "runs", arm, seed, final)
    study = load_study(study_file(tmp_path))
    sections, rows = page_sections(study, load_runs(str(tmp_path / "runs")), ["provenance line"])
    assert [r.verdict if f[0] != "noisy" else r.verdict[: len(f[5])] for r, f in zip(rows, FINDINGS)] == [
        f[5] for f in FINDINGS
    ]
    # The oracle: each finding on its own pair, scipy's paired t test and statsmodels' TOST, Holm
    # by statsmodels over the six findings; the verdict from the definitions (docs/statistics.md).
    k = len(FINDINGS)
    p_zero, p_beyond, p_tost = [], [], []
    for r, (_, a, b, _, margin, _) in zip(rows, FINDINGS):
        x, y = np.array(ARMS[a]), np.array(ARMS[b])
        delta = 0.02 * y.mean() if margin in (None, "2%") else float(margin)
        test = st.ttest_rel(x, y)
        ci, fw = test.confidence_interval(0.95), test.confidence_interval(1 - 0.05 / k)
        assert r.spread.paired and r.spread.df == 2 and r.spread.seeds == [0, 1, 2]
        assert r.diff == pytest.approx((x - y).mean()) and r.margin == pytest.approx(delta)
        assert (r.low, r.high, r.fw_low, r.fw_high) == pytest.approx((ci.low, ci.high, fw.low, fw.high))
        assert r.spread.sd == pytest.approx(np.std(x - y, ddof=1))
        assert (r.spread.welch_low, r.spread.welch_high) == pytest.approx(welch(x, y, 0.95), rel=1e-9)
        assert r.spread.rho == pytest.approx(np.corrcoef(x, y)[0, 1])
        p_zero.append(test.pvalue)
        side = "greater" if (x - y).mean() > 0 else "less"  # beyond Δ on the side the difference lies, both sides open
        p_beyond.append(
            min(1.0, 2 * st.ttest_rel(x, y + (delta if side == "greater" else -delta), alternative=side).pvalue)
        )
        p_tost.append(ttost_paired(x, y, -delta, delta)[0])
        assert r.p_zero == pytest.approx(p_zero[-1]) and r.p_tost == pytest.approx(p_tost[-1])
        assert r.p_beyond == pytest.approx(p_beyond[-1])
    zero, beyond, tost = (multipletests(p, 0.05, method="holm")[0] for p in (p_zero, p_beyond, p_tost))
    for i, (r, f) in enumerate(zip(rows, FINDINGS)):
        d, side = r.diff, 1 if f[3] == "higher" else -1
        want = (
            "no meaningful effect (equivalent within ±Δ)"
            if tost[i]
            else "contradicted (reversed)"
            if zero[i] and np.sign(d) != side
            else "reproduced"
            if zero[i] and beyond[i]
            else "reproduced, possibly smaller than Δ"
            if zero[i]
            else "not resolved"
        )
        assert r.verdict.startswith(want)
    # seeds-needed of the unresolved finding: from its own noise and margin, statsmodels' power for
    # a paired t test at Holm's first step, 80 %
    noisy = rows[3]
    effect = noisy.margin / np.std(np.array(ARMS["noisy"]) - ARMS["base"], ddof=1)
    assert noisy.spread.needed == math.ceil(TTestPower().solve_power(effect, None, 0.05 / k, 0.8)) == 62
    # and the plan at its observed difference (seeds_to_settle, checked against statsmodels and scipy in
    # test_verdicts.py) from scipy's paired interval, at 4 seeds at least: it is not resolved at 3
    x, y = np.array(ARMS["noisy"]), np.array(ARMS["base"])
    ci = st.ttest_rel(x, y).confidence_interval(0.95)
    plan = V.seeds_to_settle((x - y).mean(), ci.low, ci.high, np.std(x - y, ddof=1), 0.02 * y.mean(), k, at_least=4)
    assert noisy.spread.plan == tuple(int(n) for n in plan)
    assert noisy.verdict == "not resolved: " + P.seeds_words(*plan, 62)
    summary = sections[0]
    assert (
        f"{k} findings, 5 settled: 2 reproduced, 1 reproduced, possibly smaller than Δ, 1 no meaningful effect "
        "(equivalent within ±Δ), 1 contradicted (reversed), 1 not resolved."
    ) in summary.text
    assert "provenance line" in next(s for s in sections if s.key == "method").text
    # the verdict, its seeds apart and without the gloss on ±Δ
    assert [row[2] for row in summary.tables[0][1]] == [
        f[5].split(":")[0].removesuffix(" (equivalent within ±Δ)") for f in FINDINGS
    ]
    full = next(s for s in sections if s.key == "claims").tables[0]
    assert full[0][-1] == "verdict" and [row[-1] for row in full[1]] == [r.verdict for r in rows]
    # over training: the one evaluation of these stores is the end, judged as the end is
    assert [row[-2] for row in full[1]] == [
        "1 / 0 of 1",
        "0 / 1 of 1",
        "1 / 0 of 1",
        "0 / 0 of 1",
        "0 / 0 of 1",
        "1 / 0 of 1",
    ]
    # the noise floor: the baseline's own spread, the least and most spread arms and the seed's share
    # (ANOVA mean squares of loss ~ arm + seed)
    frame = pd.DataFrame([{"y": v, "arm": a, "seed": s} for a, vs in ARMS.items() for s, v in enumerate(vs)])
    fit = ols("y ~ C(arm) + C(seed)", frame).fit()
    seed_var = (anova_lm(fit).loc["C(seed)", "mean_sq"] - fit.mse_resid) / len(ARMS)
    sds = {a: np.std(v, ddof=1) for a, v in ARMS.items()}
    noise = next(t for t in next(s for s in sections if s.key == "noise").all_tables() if t[0][0] == "metric")[1]
    least, most = min(sds, key=sds.get), max(sds, key=sds.get)
    assert noise == [
        [
            "eval_loss",
            "nats per image token",
            pytest.approx(sds["base"]),
            3,
            least,
            pytest.approx(sds[least]),
            most,
            pytest.approx(sds[most]),
            pytest.approx(seed_var / (seed_var + fit.mse_resid)),
        ]
    ]
    topup = next(s for s in sections if s.key == "topup")
    assert f"Now 3 seeds per arm at most; the rule asks for {max(r.spread.needed for r in rows)}." in topup.text


def write_timed_store(root: Path, arm: str, seed: int, step_time: float, job: list[int], wall: float = 90.0) -> None:
    """A run store whose step time is `step_time` at every step, trained in a job of the seeds `job`
    ([seed]: a job of its own), as the trainer writes one: a member logs the job's step divided
    among the members (train/logger.py), names its job in meta.json and records the job's wall
    time up to its own end in its summary."""
    store = root / f"{arm}-seed{seed}" / "run"
    store.mkdir(parents=True)
    shared = {"perf/job_step_time": step_time * len(job)} if len(job) > 1 else {}
    rows = [{"step": s, "train/loss": 1.0 / s, "perf/step_time": step_time, **shared} for s in range(1, 11)]
    (store / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (store / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "arm_marker": arm}))
    members = {"seeds": job, "index": job.index(seed), "job_dir": str(root / f"{arm}-seed{job[0]}"), "impl": "map"}
    meta = {"overrides": [f"+arm={arm}", f"seed={seed}"], **({"members": members} if len(job) > 1 else {})}
    (store / "meta.json").write_text(json.dumps(meta))
    (store / "summary.json").write_text(json.dumps({"status": "finished", "steps": 10, "wall_time": wall}))


def test_a_time_the_members_of_one_job_share_is_one_measurement_not_one_per_seed(tmp_path):
    """Step time is measured once per job: seeds trained as members of one job all log the job's
    step divided among them, so they are no replicates of it. Such a finding is untestable, out of
    the Holm family, and the wall time counts the job once (its longest member's); as jobs of their
    own it is judged, and an arm mixing both is judged on its own jobs."""
    times = {"base": [0.100, 0.104, 0.098, 0.101], "fast": [0.090, 0.095, 0.091, 0.094]}
    spec = study_file(
        tmp_path,
        baseline="base",
        findings=[
            {"id": "t", "claim": "c", "arm": "fast", "against": "base", "metric": "step_time", "expect": "lower"}
        ],
    )
    study = load_study(spec)
    layouts = {  # how each arm's four seeds were grouped into jobs
        "members": [[0, 1, 2, 3]],
        "own": [[0], [1], [2], [3]],
        "mixed": [[0], [1], [2, 3]],
    }
    for name, jobs in layouts.items():
        root = tmp_path / name
        for arm, ts in times.items():
            for job in jobs:
                for seed in job:  # a diverged-early member records less of its job's wall time
                    write_timed_store(root, arm, seed, ts[job[0]], job, wall=90.0 - 30 * job.index(seed))
        runs = load_runs(str(root))
        sections, (row,) = page_sections(study, runs, ["p"])
        wall = provenance("s.yaml", None, [], ["python", "job.py"], runs, 0.0, False)[2]
        arms = next(t for s in sections for t in s.all_tables() if "step_time 95% CI (s)" in t[0])
        mean, ci = arms[0].index("step_time (s)"), arms[0].index("step_time 95% CI (s)")
        own = [s for job in jobs if len(job) == 1 for s in job]  # the seeds timed as jobs of their own
        # a job's wall time once, its first member's (90 s; the others ended 30 s apart before it)
        added = re.fullmatch(r"Runs: 8 \(8 finished\); their wall time adds up to ([\d.]+) min.*", wall)
        assert float(added[1]) == pytest.approx(2 * len(jobs) * 90 / 60)
        if name == "members":
            assert sections[0].tables[0][1][0][2] == "untestable here"  # the summary; why: the claims table
            assert row.verdict == (
                "untestable here: fast and base's seeds trained as members of shared jobs, so its step_time is "
                "one measurement per job, not one per seed; time the arms as jobs of their own (dalle-ablate study "
                "--no-members)"
            )
            assert math.isnan(row.p_zero) and row.spread.n == (0, 0) and row.spread.needed == 0
            assert [r[ci] for r in arms[1]] == ["–", "–"]  # four copies of one timing have no spread
            assert [r[mean] for r in arms[1]] == pytest.approx([times["base"][0], times["fast"][0]])
        else:  # judged on the seeds timed as jobs of their own, paired: scipy's t test on them
            fast, base = ([times[a][s] for s in own] for a in ("fast", "base"))
            test = st.ttest_rel(fast, base)
            assert row.spread.seeds == own and row.p_zero == pytest.approx(test.pvalue)
            lo, hi = st.t.interval(0.95, len(own) - 1, np.mean(base), st.sem(base))
            assert arms[1][0][mean] == pytest.approx(np.mean(base))
            assert arms[1][0][ci] == f"[{lo:.3g}, {hi:.3g}]"


def test_values_measured_elsewhere_are_judged_the_same_way(tmp_path):
    """The seam for stability claims judged on stress runs: per-arm, per-seed values of a metric
    handed in, not read from the run stores."""
    for arm in ("base", "worse"):
        for seed, final in enumerate(ARMS[arm]):
            write_store(tmp_path / "runs", arm, seed, final)
    study = load_study(
        study_file(
            tmp_path,
            findings=[
                {
                    "id": "x",
                    "claim": "c",
                    "arm": "worse",
                    "against": "base",
                    "metric": "loss_spikes",
                    "expect": "higher",
                    "margin": "0.5",
                }
            ],
        )
    )
    by_arm = {
        a: [r for r in load_runs(str(tmp_path / "runs")) if f"+arm={a}" in r.meta["overrides"]]
        for a in ("base", "worse")
    }
    extra = {"loss_spikes": {"base": {0: 1.0, 1: 2.0, 2: 0.0}, "worse": {0: 5.0, 1: 6.5, 2: 4.0}}}
    rows = compare(study, claims_tables(study, by_arm, extra))
    d = np.array([5.0, 6.5, 4.0]) - np.array([1.0, 2.0, 0.0])
    ci = st.ttest_rel([5.0, 6.5, 4.0], [1.0, 2.0, 0.0]).confidence_interval(0.95)
    assert rows[0].diff == pytest.approx(d.mean()) and (rows[0].low, rows[0].high) == pytest.approx((ci.low, ci.high))


def test_a_multirun_s_stage_1_tokenizer_is_not_one_of_its_runs(tmp_path):
    write_store(tmp_path, "base", 0, 1.0)
    tok = tmp_path / "base-seed0" / "tokenizer"
    tok.mkdir()
    (tok / "metrics.jsonl").write_text(json.dumps({"step": 0, "tokenizer/mse": 0.0}))
    assert find_stores(str(tmp_path)) == [tmp_path / "base-seed0" / "run"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"findings": [{"id": "x", "claim": "c", "arm": "a", "against": "b", "metric": "fid", "expect": "lower"}]},
            "finding 'x' has metric 'fid'; valid: eval_loss, loss_spikes, lr_sensitivity, shapes_all, step_time, train_loss",
        ),
        (
            {
                "findings": [
                    {
                        "id": "x",
                        "claim": "c",
                        "arm": "a",
                        "against": "b",
                        "metric": "eval_loss",
                        "expect": "lower",
                        "margin": "-3%",
                    }
                ]
            },
            "finding 'x' has margin '-3%'; valid: a positive number in the metric's units (0.01) or a percentage of the "
            "baseline's mean (2%)",
        ),
        (
            {
                "findings": [
                    {"id": "x", "claim": "c", "arm": "a", "against": "b", "metric": "eval_loss", "expect": "worse"}
                ]
            },
            "finding 'x' has expect 'worse'; valid: lower, higher",
        ),
        (
            {"findings": [{"id": "x", "claim": "c", "arm": "a", "metric": "eval_loss", "expect": "lower"}]},
            "finding 0 lacks against",
        ),
    ],
)
def test_a_bad_study_file_is_named_in_one_line(tmp_path, change, message):
    path = study_file(tmp_path, **change)
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert str(err.value) == f"{path}: {message}"
    with pytest.raises(ConfigError, match=r"^study 'nosuch' is not one of: mega-variants \(or give a study file"):
        study_path("nosuch")


def test_the_mega_study_runs_the_arms_its_findings_compare_and_only_those():
    from dalle_ablate.metrics import STUDY
    from dalle_ablate.report.study_file import load_stress, own_arms

    MEASURED_ELSEWHERE = {name for name, m in STUDY.items() if m.reads == "given"}  # on the stress runs

    study = load_study(study_path("mega-variants"))
    preset = yaml.safe_load((Path(__file__).parents[2] / "dalle_ablate/conf/experiment/study_mega.yaml").read_text())
    assert "+arm" not in preset["hydra"]["sweeper"]["params"]  # the study file lists its arms, nothing else does
    own = own_arms(study)
    arms = set(own)
    stressed = set(load_stress(study_path("mega-variants")).arms)
    assert own[0] == study.baseline and len(own) == len(arms) == 11
    assert all({f.arm, f.against} <= (stressed if f.metric in MEASURED_ELSEWHERE else arms) for f in study.findings)
    # every arm its own runs train is one a finding on them compares: none that judges nothing
    assert arms == {a for f in study.findings if f.metric not in MEASURED_ELSEWHERE for a in (f.arm, f.against)}
    assert arms | stressed <= {p.stem for p in (Path(__file__).parents[2] / "dalle_ablate/conf/arm").glob("*.yaml")}
    for arm in sorted(arms | stressed):  # each arm composes and passes the checks a run makes before it starts
        cfg = to_run_config(compose(["experiment=study_mega", f"+arm={arm}", "seed=0"]))
        assert cfg.trainer.steps == preset["trainer"]["steps"] and cfg.resume == "auto"


# The suite's tiny runs with one validation and one checkpoint each, at their last step (a run's
# hooks all run there; the page reads the final evaluation), and one decoder layer: a smaller step
# for each of the study's runs to trace and compile. What the study command does is the same at any size.
LEAN_TRAIN = replacing(TINY_TRAIN, *AT_THE_END, "model.decoder_layers=1")


@pytest.mark.slow
def test_the_study_command_runs_every_arm_and_a_rerun_skips_what_finished(tmp_path):
    """Each arm's seeds run as members of one job (the default, under members.impl=map): bit for bit
    the separate runs, so the page of `--no-members` is this page but for how its runs were made.
    The study as its file was before issue 59's re-run declared stages and timed arms (a staged
    study takes no --seeds, and timed arms train as jobs of their own: tests/report/test_staged.py)."""
    raw = yaml.safe_load(study_path("mega-variants").read_text())
    raw.pop("stages"), raw.pop("timing")
    plain = tmp_path / "mega-variants.yaml"
    plain.write_text(yaml.safe_dump(raw, sort_keys=False))

    def study(*how: str, where: Path = tmp_path) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "dalle_ablate.cli",
            "study",
            str(plain),
            "--out",
            str(where / "studies"),
            "--report-out",
            str(where / "reports"),
            "--page-out",
            str(where / "results"),
            "--no-stress",  # the study's stress runs: tests/report/test_stress.py
            "+arm=baseline,bias",
            *how,
            *SMALL_DATA,
            *LEAN_TRAIN,
            "tracker=none",  # no W&B service per child: nothing here reads W&B, and no page shows it
        ]
        # the suite's compilation cache (conftest.py), as every run's: the study's runs load what other tests compiled
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=dict(os.environ))

    first = study("seed=0")  # a study stopped after its seed-0 jobs
    assert first.returncode == 0, first.stderr[-2000:]
    folder = tmp_path / "studies" / "mega-variants"
    done = {
        p: p.read_bytes()
        for d in ("baseline-seed0", "bias-seed0")
        for p in (folder / d / "run").rglob("*")
        if p.is_file()
    }
    second = study("--seeds", "2")  # topped up to 2 seeds per arm: members 0 (settled) and 1
    assert second.returncode == 0, second.stderr[-2000:]
    assert "topping up from 1 to 2 seeds per arm (seed=0,1; the rule asks for" in second.stdout
    assert second.stdout.count("left as it is (resume=auto)") == 2
    assert {p: p.read_bytes() for p in done} == done  # the finished runs untouched
    assert sorted(p.name for p in folder.iterdir() if (p / "run").is_dir()) == [
        "baseline-seed0",
        "baseline-seed1",
        "bias-seed0",
        "bias-seed1",
    ]
    page = (tmp_path / "results" / "mega-variants.md").read_text()
    assert "| baseline (baseline) | 0, 1 | 2/2 |" in page and "| bias | 0, 1 | 2/2 |" in page
    assert "| bias-convergence | dense biases hurt convergence | bias vs baseline |" in page
    assert "Runs: 4 (4 finished)" in page and "Commit of this page: " in page
    assert (
        "Topped up from 1 to 2 seeds per arm (--seeds 2)" in page and f"`dalle-ablate study {plain} --seeds 2 " in page
    )
    assert re.search(
        r"runs trained at [0-9a-f]{40}( \+ uncommitted changes)? \(4 runs\)\.", page
    )  # one commit trained all four
    figures = sorted(p.name for p in (tmp_path / "results" / "figures").iterdir())
    assert figures and all(f.startswith("mega-variants_") for f in figures)
    assert (tmp_path / "reports" / "mega-variants" / "index.html").is_file()
    # the study's runs keep their compiled programs where the environment says (compilation_cache.dir),
    # and the top-up's run loaded its programs from there (a program compiled once, then loaded by
    # the next run: tests/parallel/test_compile_cache.py)
    topped = json.loads((folder / "baseline-seed1" / "run" / "meta.json").read_text())["compilation"]
    assert topped["cache_dir"] == os.environ["JAX_COMPILATION_CACHE_DIR"] and topped["loaded"] > 0
    assert "runs were trained as members of one job per arm" in page
    members_json = json.loads((folder / "baseline-seed0" / "members.json").read_text())
    assert [(m["seed"], Path(m["job_dir"]).name, m["status"]) for m in members_json["members"]] == [
        (0, "baseline-seed0", "finished"),
        (1, "baseline-seed1", "finished"),
    ]

    # the same study as a job per seed: its seed-0 runs are the first study's (a job per seed, one seed
    # each: one process, not members), so it starts with those and trains seed 1 -- the members' -- alone
    alone = tmp_path / "separate" / "studies" / "mega-variants"
    for d in ("baseline-seed0", "bias-seed0"):
        shutil.copytree(folder / d / "run", alone / d / "run")
    separate = study("--no-members", "seed=0,1", where=tmp_path / "separate")
    assert separate.returncode == 0, separate.stderr[-2000:]
    assert separate.stdout.count("left as it is (resume=auto)") == 2
    assert sorted(p.name for p in alone.iterdir() if (p / "run").is_dir()) == sorted(
        p.name for p in folder.iterdir() if (p / "run").is_dir()
    )
    for store in alone.glob("*/run"):
        assert (
            json.loads((store / "meta.json").read_text())["overrides"]
            == json.loads((folder / store.parent.name / "run" / "meta.json").read_text())["overrides"]
        )
    # Step time is one measurement per job: untestable on members, judged on separate jobs -- and
    # out of Holm's family on members, which can move the other findings' verdicts. Judged without
    # the step-time findings, the two pages are the same but for how and when their runs were made.
    timed = "| bias-time | dense biases cost time (step_time) | untestable here |"
    assert timed in page and timed not in (tmp_path / "separate" / "results" / "mega-variants.md").read_text()
    study = load_study(plain)
    study = dataclasses.replace(study, findings=[f for f in study.findings if f.metric != "step_time"])
    again = [write_page(study, str(f), tmp_path / "again" / f.parents[1].name, []) for f in (folder, alone)]
    assert untimed(again[0].read_text()) == untimed(again[1].read_text())


def untimed(page: str) -> list[str]:
    """A results page's lines without what says how and when its runs were made: the provenance,
    the top-up note and the seeds its rule asks for, the link whose depth is the page's folder's,
    every line naming step_time (its table rows, its figures' captions with their verdicts), the
    step_time columns of the arms' table, the count of verdicts (step-time findings are untestable
    on members), and blank lines."""
    # ("Now N seeds per arm": the rule's N is the largest seeds-needed of all findings, step time's among them)
    skip = re.compile(
        r"^(Command:|Commit of this page|Runs: |\d+ of the runs were trained as members|Topped up|How a verdict|"
        r"Now \d+ seeds per arm at most|\d+ findings, \d+ settled)"
    )
    out, timed = [], []
    for line in page.splitlines():
        cells = line.split("|")
        if line.startswith("| arm |"):
            timed = [i for i, c in enumerate(cells) if "step_time" in c]
        elif not line.startswith("|"):
            timed = []
        if skip.match(line) or ("step_time" in line and not line.startswith("| arm |")) or not line.strip():
            continue
        line = re.sub(r"\]\([^)]*statistics\.md", "](statistics.md", line)  # its depth is the page folder's
        cells = line.split("|")
        out.append("|".join(c for i, c in enumerate(cells) if i not in timed))
    return out


def test_a_top_up_adds_seeds_by_the_rule_or_as_asked_and_says_so(tmp_path, capsys):
    from dalle_ablate.cli import main
    from dalle_ablate.study.topup import plan_topup

    folder = tmp_path / "studies" / "synthetic"
    for arm, finals in ARMS.items():
        for seed, final in enumerate(finals):
            write_store(folder, arm, seed, final)
    study = load_study(study_file(tmp_path))
    override, entry = plan_topup(study, folder, "5", ["trainer.steps=10"])
    assert override == "seed=0,1,2,3,4" and (entry["from"], entry["to"], entry["how"]) == (3, 5, "--seeds 5")
    # the rule: the largest seeds-needed over every finding (each from its own noise), not only the unresolved
    _, rows = page_sections(study, load_runs(str(folder)), [])
    rule = max(r.spread.needed for r in rows)
    assert rule == next(r.spread.needed for r in rows if r.finding.id == "noisy") == 62
    override, entry = plan_topup(study, folder, "auto", [])
    assert entry["to"] == entry["rule"] == rule and override == "seed=" + ",".join(map(str, range(rule)))
    sections, _ = page_sections(study, load_runs(str(folder)), [], topups=[{**entry, "at": "t"}])
    assert (
        f"Topped up from 3 to {rule} seeds per arm (--seeds auto (the rule)); the rule then asked for {rule}."
        in next(s for s in sections if s.key == "topup").text
    )
    for seeds, overrides, message in [
        ("2", [], "--seeds 2: study synthetic already has 3 seeds per arm; a top-up only adds"),
        ("x", [], "--seeds 'x': give a number of seeds per arm (2 or more) or auto (the top-up rule)"),
        ("5", ["seed=0,1"], "--seeds chooses the seeds itself; leave out the seed= override"),
    ]:
        with pytest.raises(ConfigError) as err:
            plan_topup(study, folder, seeds, overrides)
        assert str(err.value) == message
    with pytest.raises(ConfigError, match=r"^--seeds tops up a study that has run: no runs of study synthetic under "):
        plan_topup(study, tmp_path / "elsewhere", "5", [])
    (folder / "topups.json").write_text(json.dumps([{**entry, "at": "t"}]))  # the rule has topped it up once
    with pytest.raises(ConfigError) as err:
        plan_topup(study, folder, "auto", [])
    assert str(err.value) == (
        "--seeds auto: study synthetic was topped up by the rule already; the rule tops up once (a "
        "second look at the same data would spend its error rate again)"
    )
    assert plan_topup(study, folder, "40", [])[1]["to"] == 40  # a number fixed beforehand is the user's to give
    with pytest.raises(SystemExit) as ex:
        main(["study", str(study_file(tmp_path)), "--out", str(tmp_path / "studies"), "--seeds", "5", "--no-run"])
    assert (
        ex.value.code == 2
        and capsys.readouterr().err == "error: --seeds runs the added seeds; it cannot go with --no-run\n"
    )


def test_an_unresolved_finding_says_what_more_seeds_would_do():
    """Two counts in words: the plan at the observed difference with its range, and the seeds a
    difference of Δ needs; "more than 200" alone only where it answers both."""
    from dalle_ablate.report.findings import verdict_text

    plan = (5, 5, 7)
    assert verdict_text(V.NOT_RESOLVED, 12, 3, plan=plan) == (
        "not resolved: a plan of 5 seeds per arm if the true difference is the one observed (5 to 7 across its "
        "95 % interval); 12 to tell a difference of Δ from 0"
    )
    assert verdict_text(V.NOT_RESOLVED, V.MAX_SEEDS + 1, 4, plan=plan) == (
        "not resolved: a plan of 5 seeds per arm if the true difference is the one observed (5 to 7 across its "
        f"95 % interval); more than {V.MAX_SEEDS} to tell a difference of Δ from 0"
    )
    assert verdict_text(V.NOT_RESOLVED, V.MAX_SEEDS + 1, 4, plan=(V.MAX_SEEDS + 1, 9, V.MAX_SEEDS + 1)) == (
        f"not resolved: more than {V.MAX_SEEDS} seeds per arm, whether the true difference is the one observed or Δ"
    )
    assert verdict_text(V.NOT_RESOLVED, 0, 3, plan=(6, 6, 6)) == (
        "not resolved: a plan of 6 seeds per arm if the true difference is the one observed (the same across its "
        "95 % interval)"
    )
    assert verdict_text(V.NOT_RESOLVED, 3, 5, plan=(40, 6, V.MAX_SEEDS + 1)) == (
        "not resolved at 5 seeds, enough for an effect of Δ: the effect is likely smaller; a plan of 40 seeds per "
        f"arm if the true difference is the one observed (6 to more than {V.MAX_SEEDS} across its 95 % interval)"
    )
    assert verdict_text(V.NOT_RESOLVED, 0, 3, plan=(0, 0, 0)) == "not resolved: no seed spread to judge it on"
    assert verdict_text(V.CONTRADICTED, 12, 3, plan=plan) == "contradicted (reversed)"
    assert verdict_text(V.UNTESTABLE, 12, 3, "neither arm trains", plan=plan) == "untestable here: neither arm trains"
    assert verdict_text(V.UNTESTABLE, 0, 3, plan=plan) == "untestable here: both arms give the same value on every seed"


def test_the_forest_plot_draws_every_finding_with_its_verdict_in_short(tmp_path):
    import io

    from PIL import Image

    from dalle_ablate.report.figures import _short_verdict, forest_figure

    for arm, finals in ARMS.items():
        for seed, final in enumerate(finals):
            write_store(tmp_path / "runs", arm, seed, final)
    _, rows = page_sections(load_study(study_file(tmp_path)), load_runs(str(tmp_path / "runs")), [])
    assert [_short_verdict(r) for r in rows] == [
        "reproduced",
        "contradicted",
        "reproduced",
        f"plan: {rows[3].spread.plan[0]} seeds",  # the plan at its observed difference, its verdict's first count
        "equivalent within ±Δ",
        "reproduced, maybe < Δ",
    ]
    small, large = (Image.open(io.BytesIO(forest_figure(rows[:k]))) for k in (2, 6))
    assert large.height > small.height  # a line per finding: the figure grows with the study


def test_a_caption_finding_s_course_reads_every_evaluation_s_pareto_table(tmp_path):
    from dalle_ablate.report.findings import _arms_by, course

    rates = {"base": {5: [0.1, 0.2, 0.15], 10: [0.5, 0.6, 0.4]}, "worse": {5: [0.05, 0.1, 0.1], 10: [0.2, 0.3, 0.3]}}
    for arm, by_step in rates.items():
        for seed in range(3):
            write_store(tmp_path / "runs", arm, seed, 1.0)
            tables = tmp_path / "runs" / f"{arm}-seed{seed}" / "run" / "tables"
            tables.mkdir()
            for step, values in by_step.items():
                rows = [["r", step, scale, 32, values[seed] if scale == 2 else 0.0] for scale in (1, 2)]
                (tables / f"eval_pareto_{step}.json").write_text(
                    json.dumps({"columns": ["run", "step", "scale", "n", "shapes/all"], "line": None, "rows": rows})
                )
    study = load_study(
        study_file(
            tmp_path,
            findings=[
                {
                    "id": "cap",
                    "claim": "c",
                    "arm": "worse",
                    "against": "base",
                    "metric": "shapes_all",
                    "expect": "lower",
                }
            ],
        )
    )
    by_arm = _arms_by(load_runs(str(tmp_path / "runs")))
    steps, d, lo, hi = course(study, by_arm, claims_tables(study, by_arm)[0])["cap"]
    assert list(steps) == [5.0, 10.0]
    for i, step in enumerate((5, 10)):
        a, b = np.array(rates["worse"][step]), np.array(rates["base"][step])
        ci = st.ttest_rel(a, b).confidence_interval(0.95)
        assert (d[i], lo[i], hi[i]) == pytest.approx(((a - b).mean(), ci.low, ci.high))


def test_the_noise_floor_shows_the_shapes_evaluations_own_noise_apart_from_the_seeds(tmp_path):
    """A caption finding's page gives the baseline's seed sd beside one run's binomial noise over its
    N prompts, sqrt(p (1 - p) / N) averaged over the seeds (issue 37: the evaluator's noise apart)."""
    finals = {"base": [0.5, 0.6, 0.4], "worse": [0.2, 0.3, 0.3]}
    for arm, values in finals.items():
        for seed in range(3):
            write_store(tmp_path / "runs", arm, seed, 1.0)
            tables = tmp_path / "runs" / f"{arm}-seed{seed}" / "run" / "tables"
            tables.mkdir()
            rows = [["r", 10, 2, 100, 400, values[seed]]]
            (tables / "eval_pareto_10.json").write_text(
                json.dumps(
                    {"columns": ["run", "step", "scale", "shapes/n", "n", "shapes/all"], "line": None, "rows": rows}
                )
            )
    study = load_study(
        study_file(
            tmp_path,
            findings=[
                {
                    "id": "cap",
                    "claim": "c",
                    "arm": "worse",
                    "against": "base",
                    "metric": "shapes_all",
                    "expect": "lower",
                }
            ],
        )
    )
    sections, _ = page_sections(study, load_runs(str(tmp_path / "runs")), [])
    cols, rows = next(s for s in sections if s.key == "noise").all_tables()[-1]
    (row,) = [r for r in rows if r[2] == "all tiers"]
    got = dict(zip(cols, row))
    p = np.array(finals["base"])
    assert got["variant"] == "base" and got["seeds"] == 3 and got["prompts per run"] == 100
    assert got["seed SD"] == pytest.approx(np.std(p, ddof=1))
    assert got["prompt SD (one run)"] == pytest.approx(np.mean(np.sqrt(p * (1 - p) / 100)))


def test_the_noise_floor_splits_the_spread_by_the_source_each_run_varies(tmp_path):
    """Baseline runs that vary a data-order seed with the initialisation fixed, and the reverse:
    each source's spread is the sd among runs that differ only in it."""
    from dalle_ablate.report.findings import _arms_by, noise_sources

    plan = {  # (data_seed, init_seed) -> final loss
        (0, 0): 1.00,
        (1, 0): 1.10,
        (2, 0): 0.96,  # data order alone
        (0, 1): 1.04,
        (0, 2): 1.01,  # initialisation alone (with (0, 0))
    }
    for i, ((data, init), final) in enumerate(plan.items()):
        write_store(tmp_path / "runs", "base", i, final)
        cfg = tmp_path / "runs" / f"base-seed{i}" / "run" / "config.yaml"
        cfg.write_text(
            yaml.safe_dump({"seed": 0, "data_seed": data, "model": {"init_seed": init}, "eval": {"seed": 7}})
        )
    runs = _arms_by(load_runs(str(tmp_path / "runs")))["base"]
    got = noise_sources(runs, lambda r: float(r.metrics["eval/valid/loss"].dropna().iloc[-1]))
    # data_seed varies within init 0 (three runs); init_seed within data 0 (three runs); the others are singletons
    assert [(k, df) for k, _, df in got] == [("data_seed", 2), ("model.init_seed", 2)]
    assert got[0][1] == pytest.approx(np.std([1.00, 1.10, 0.96], ddof=1))
    assert got[1][1] == pytest.approx(np.std([1.00, 1.04, 1.01], ddof=1))
    # a field that follows `seed` (its default) varies with every source: nothing to split
    for i, r in enumerate(runs):
        r.config.update({"seed": i, "data_seed": i})
        r.config.pop("model.init_seed")
    assert noise_sources(runs, lambda r: 1.0 + r.config["seed"]) == []


def test_a_metric_from_elsewhere_without_a_default_margin_needs_one_declared(tmp_path, monkeypatch):
    from dalle_ablate import metrics

    monkeypatch.setitem(
        metrics.STUDY,
        "max_trainable_lr",
        metrics.Metric(
            "max_trainable_lr",
            "the largest rate that trains, per seed",
            "log10 lr",
            "higher",
            source="report",
            study="max_trainable_lr",
            reads="given",
        ),
    )
    spec = {"id": "x", "claim": "c", "arm": "a", "against": "b", "metric": "max_trainable_lr", "expect": "lower"}
    path = study_file(tmp_path, findings=[spec])
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert str(err.value) == (
        f"{path}: finding 'x' has no margin and metric 'max_trainable_lr' no default one; give margin: "
        "a positive number in the metric's units (0.01) or a percentage of the baseline's mean (2%)"
    )
    assert load_study(study_file(tmp_path, findings=[{**spec, "margin": "0.05"}])).findings[0].margin == V.Margin(0.05)


def test_a_missing_or_non_yaml_study_file_is_named_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_study(tmp_path / "nosuch.yaml")
    assert str(err.value) == f"{tmp_path / 'nosuch.yaml'}: no such file"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [x\n")
    with pytest.raises(ConfigError) as err:
        load_study(bad)
    assert str(err.value) == f"{bad}: not valid YAML (line 2 column 1: expected ',' or ']', but got '<stream end>')"
    bad.write_text("just some words\n")
    with pytest.raises(ConfigError) as err:
        load_study(bad)
    assert str(err.value) == (
        f"{bad}: not a study file (a YAML mapping with name, title, source, experiment, baseline, "
        "findings); it holds a str"
    )


# A study's run store torn or incomplete: `dalle-ablate study` names the file in one line (exit 2).
BROKEN = [
    (
        "summary.json",
        '{"status": "fin',
        "not valid JSON, half-written or corrupt (Unterminated string starting at: line 1 column 12)",
    ),
    (
        "metrics.jsonl",
        '{"step": 1}\n{"step": 2, "train/lo',
        "line 2 is not valid JSON, half-written or corrupt (Unterminated string starting at: column 13)",
    ),
    ("config.yaml", "seed: [0\n", "not valid YAML (line 2 column 1: expected ',' or ']', but got '<stream end>')"),
    (
        "meta.json",
        None,
        "no such file, so the study cannot tell which arm the run is; delete {job} and run the study again "
        "to train it anew",
    ),
]


@pytest.mark.parametrize("mode", ["--no-run", "run"])
@pytest.mark.parametrize("name, text, why", BROKEN, ids=[b[0] for b in BROKEN])
def test_the_study_command_names_a_broken_run_store_in_one_line(tmp_path, capsys, monkeypatch, name, text, why, mode):
    """In --no-run mode, and before anything runs when it runs (the stores already there are read
    first: no run starts, to crash on the file or to be compared at the end)."""
    from dalle_ablate.cli import main
    from dalle_ablate.study import runner

    folder = tmp_path / "studies" / "synthetic"
    for arm in ("baseline", "bias"):
        for seed in range(2):
            write_store(folder, arm, seed, ARMS["base" if arm == "baseline" else "worse"][seed])
    path = folder / "bias-seed1" / "run" / name
    path.unlink() if text is None else path.write_text(text)
    monkeypatch.setattr(runner, "call_child", nothing_starts)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "study",
                str(real_study(tmp_path)),
                *([mode] if mode == "--no-run" else ["+arm=baseline,bias"]),
                "--no-stress",
                "--out",
                str(tmp_path / "studies"),
                "--report-out",
                str(tmp_path / "reports"),
                "--page-out",
                str(tmp_path / "results"),
            ]
        )
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {path}: {why.format(job=path.parents[1])}\n"


def nothing_starts(*args, **kwargs):
    raise AssertionError(f"a run was started: {args}")


ARM_NAMES = sorted(p.stem for p in (Path(__file__).parents[2] / "dalle_ablate/conf/arm").glob("*.yaml"))


def real_study(tmp_path: Path, **changes) -> Path:
    """A study file of arms that exist (conf/arm/), one finding, and a stress claim with its runs."""
    spec = {
        "name": "synthetic",
        "title": "t",
        "source": "s",
        "experiment": "study_mega",
        "baseline": "baseline",
        "findings": [
            {
                "id": "bias",
                "claim": "biases hurt",
                "arm": "bias",
                "against": "baseline",
                "metric": "eval_loss",
                "expect": "higher",
            },
            {
                "id": "st",
                "claim": "swish is stabler",
                "arm": "swish",
                "against": "baseline",
                "metric": "lr_sensitivity",
                "expect": "lower",
                "margin": 0.05,
            },
        ],
        "stress": {"claims": ["st"], "lr": [1e-3, 3e-3, 1e-2], "seeds": [0], "steps": 6},
    }
    spec.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _finding(**f) -> list[dict]:
    return [
        {"id": "x", "claim": "c", "arm": "bias", "against": "baseline", "metric": "eval_loss", "expect": "higher", **f}
    ]


VALID_ARMS = f"valid: {', '.join(ARM_NAMES)}"
BEFORE = [  # (the study file's changes, the command's overrides, the line less "error: " with {file})
    (
        {"findings": _finding(arm="no_gluu")},
        [],
        f"{{file}}: finding 'x' has arm 'no_gluu': not an arm (dalle_ablate/conf/arm/); did you mean 'no_glu'? {VALID_ARMS}",
    ),
    (
        {"findings": _finding(against="baselne")},
        [],
        f"{{file}}: finding 'x' has against 'baselne': not an arm (dalle_ablate/conf/arm/); did you mean 'baseline'? "
        f"{VALID_ARMS}",
    ),
    (
        {"baseline": "baselne"},
        [],
        f"{{file}}: baseline 'baselne': not an arm (dalle_ablate/conf/arm/); did you mean 'baseline'? {VALID_ARMS}",
    ),
    ({}, ["+arm=baseline,nosuch"], f"+arm=nosuch: not an arm (dalle_ablate/conf/arm/); {VALID_ARMS}"),
    ({}, ["+arm=baseline", "trainer.stepz=5"], "unknown field 'trainer.stepz'; valid fields of trainer: "),
    (
        {
            "stress": {
                "claims": ["st"],
                "lr": [1e-3, 3e-3, 1e-2],
                "seeds": [0],
                "steps": 6,
                "overrides": ["optim.betaz=1"],
            }
        },
        ["+arm=baseline"],
        "{file}: stress run of baseline at lr 0.001: unknown field 'optim.betaz'; valid fields of optim: ",
    ),
]


@pytest.mark.parametrize(
    "change, overrides, message",
    BEFORE,
    ids=["arm", "against", "baseline", "command-line arm", "bad override", "stress plan"],
)
def test_a_study_is_checked_before_anything_runs(tmp_path, capsys, monkeypatch, change, overrides, message):
    """Every arm the study file and the command line name exists (a typo names the closest), each
    job of its multirun and each stress run composes: otherwise one line, exit 2, and nothing has
    started -- no run, no stress run, no folder."""
    from dalle_ablate.cli import main
    from dalle_ablate.study import runner

    monkeypatch.setattr(runner, "call_child", nothing_starts)
    path = real_study(tmp_path, **change)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "study",
                str(path),
                "--out",
                str(tmp_path / "studies"),
                "--report-out",
                str(tmp_path / "reports"),
                "--page-out",
                str(tmp_path / "results"),
                *overrides,
            ]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message.format(file=path)}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


def _study_until(cmd: list[str], cwd: Path, marker: str) -> tuple[int, str]:
    """Run a `dalle-ablate study` command in a process group of its own until a line of its output
    (its runs' too) contains `marker`, then press Ctrl-C as a terminal does: SIGINT to the whole
    group, the study and its runs. (exit code, stderr)."""
    import signal

    with open(cwd / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            seen = []
            for line in proc.stdout:
                seen.append(line)
                if marker in line:
                    os.killpg(proc.pid, signal.SIGINT)
                    break
            assert marker in "".join(seen), "".join(seen)[-3000:]
            proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        err.seek(0)
        return proc.returncode, err.read()


@pytest.mark.slow
def test_ctrl_c_stops_a_study_between_its_arms_and_in_its_stress_runs_with_the_command_that_continues_it(tmp_path):
    """Ctrl-C once the first arm's run has finished: the study stops (the second arm's job taking
    the interrupt as it starts, or in its steps) with one line -- not an error, not one of each
    process -- and exit 130. The command it gives leaves the first arm as it is, trains the second
    and goes on to the stress runs; Ctrl-C as the first of those starts says so, with the same command."""
    out = tmp_path / "studies"
    argv = [
        "study",
        str(real_study(tmp_path)),
        "--out",
        str(out),
        "--report-out",
        str(tmp_path / "reports"),
        "--page-out",
        str(tmp_path / "results"),
        "--no-members",
        "+arm=baseline,bias",
        "seed=0",
        *SMALL_DATA,
        *LEAN_TRAIN,
        "tracker=none",
    ]
    cmd = [sys.executable, "-m", "dalle_ablate.cli", *argv]
    again = f"resume with: dalle-ablate {shlex.join(argv)}"
    kept = "the runs that finished are kept, a stopped one continues from its checkpoint"
    code, err = _study_until(cmd, tmp_path, f"run store {out / 'synthetic' / 'baseline-seed0' / 'run'}")
    assert code == 130, err[-3000:]
    assert err.strip() == f"study synthetic interrupted during its runs (the multirun of its arms); {kept}; {again}"
    summary = json.loads((out / "synthetic" / "baseline-seed0" / "run" / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert not (out / "synthetic-stress").exists()
    words = shlex.split(again.removeprefix("resume with: dalle-ablate "))
    code, err = _study_until([sys.executable, "-m", "dalle_ablate.cli", *words], tmp_path, "stress job 1 of 6: ")
    assert code == 130, err[-3000:]
    assert err.strip() == f"study synthetic interrupted during its stress runs; {kept}; {again}"
    assert json.loads((out / "synthetic" / "bias-seed0" / "run" / "summary.json").read_text())["status"] == "finished"
    assert (
        json.loads((out / "synthetic" / "baseline-seed0" / "run" / "summary.json").read_text()) == summary
    )  # left as it is


def test_a_relative_margin_on_a_stress_measure_needs_the_baseline_among_the_stress_arms(tmp_path):
    spec = {
        "id": "st",
        "claim": "worse is stabler",
        "arm": "worse",
        "against": "better",
        "metric": "lr_sensitivity",
        "expect": "lower",
    }
    stress = {"claims": ["st"], "lr": [1e-3, 1e-2, 1e-1], "seeds": [0], "steps": 10}
    path = study_file(tmp_path, findings=[spec], stress=stress)
    with pytest.raises(ConfigError) as err:
        load_study(path)
    assert str(err.value) == (
        f"{path}: finding 'st' has margin 10% of the baseline's lr_sensitivity, but the baseline "
        "'base' is in no stress claim, so it has none; give an absolute margin (0.05) or a stress "
        "claim with the baseline"
    )
    assert load_study(study_file(tmp_path, findings=[{**spec, "margin": 0.05}], stress=stress)).findings[
        0
    ].margin == V.Margin(0.05)
    assert load_study(study_file(tmp_path, findings=[{**spec, "against": "base"}], stress=stress)).findings[
        0
    ].margin == V.Margin(0.1, relative=True)


def test_a_study_trains_each_arms_seeds_as_members_of_one_job():
    from dalle_ablate.study.jobs import as_members

    # the seeds the preset sweeps (study_mega: hydra.sweeper.params.seed 5000-5003), or those a seed= override sweeps
    assert as_members("study_mega", ["+arm=baseline"]) == [
        "+arm=baseline",
        "seed=5000",
        "seeds=[5000,5001,5002,5003]",
        "members.impl=map",
    ]
    assert as_members("study_mega", ["seed=3,1,4", "trainer.steps=5"]) == [
        "trainer.steps=5",
        "seed=3",
        "seeds=[3,1,4]",
        "members.impl=map",
    ]
    assert as_members("study_mega", ["seed=range(0,2)", "members.impl=vmap"]) == [
        "members.impl=vmap",
        "seed=0",
        "seeds=[0,1]",
    ]
    assert as_members("study_mega", ["seed=5"]) == ["seed=5"]  # one seed: a job of its own
    assert as_members("quick", ["x=1"]) == ["x=1"]  # a preset that sweeps no seed
    for arms in ("baseline", "shampoo"):  # what the study launches composes and passes the checks, Shampoo's arm too
        cfg = to_run_config(compose(["experiment=study_mega", f"+arm={arms}", *as_members("study_mega", [])]))
        assert (cfg.seed, cfg.seeds, cfg.members.impl) == (5000, [5000, 5001, 5002, 5003], "map")


def test_the_arms_a_study_times_train_as_jobs_of_their_own_seed_by_seed(tmp_path):
    """A study file's `timing: {arms: [...]}`: those arms' seeds are jobs of their own, every timed
    arm's seed k beside the others' (one multirun per seed), the other arms members as before."""
    import dataclasses as dc

    from dalle_ablate.study.jobs import stage1_commands

    study = dc.replace(load_study(study_path("mega-variants")), timed=("baseline", "bias"))
    commands = [c[4:] for c in stage1_commands(study, tmp_path, ["+arm=baseline,bias,swish", "seed=7,8"], True)]
    assert commands == [
        [
            "experiment=study_mega",
            f"hydra.sweep.dir={tmp_path}",
            "+arm=swish",
            "seed=7",
            "seeds=[7,8]",
            "members.impl=map",
        ],
        ["experiment=study_mega", f"hydra.sweep.dir={tmp_path}", "+arm=baseline,bias", "seed=7"],
        ["experiment=study_mega", f"hydra.sweep.dir={tmp_path}", "+arm=baseline,bias", "seed=8"],
    ]
    untimed = dc.replace(study, timed=())
    assert [c[4:] for c in stage1_commands(untimed, tmp_path, ["seed=7,8"], False)] == [
        ["experiment=study_mega", f"hydra.sweep.dir={tmp_path}", "seed=7,8"]
    ]
    with pytest.raises(
        ConfigError, match=r"timing must be \{arms: \[arm, ...\]\}, the arms timed as jobs of their own"
    ):
        load_study(study_file(tmp_path, timing=["baseline"]))
