"""Sweeps that train several seeds per trial (`seeds=[...]`, members of one job): the trial's value
is the declared statistic of its members' values, the pruner sees their mean, every trial uses the
same seeds, and the best trials are re-checked on seeds the sweep never used, judged by the verdict
engine. One sweep of the tiny trainer (three trials, two seeds, the best two re-checked on three
fresh seeds) is shared by the tests that read it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
import yaml
from scipy import stats

from conftest import ROOT, SMALL_DATA, TINY_TRAIN, run_py
from dalle_ablate.train.records import member_folder
from dalle_ablate.registry import ConfigError

S = optuna.trial.TrialState
# An OptunaSweeper made by hand, as Hydra makes it from hydra.sweeper (the unit tests' own).
SWEEPER = dict(
    study_name="s", storage=None, direction="minimize", n_trials=3, n_jobs=1, sampler={}, pruner={}, params={}
)
# Every sweep here trains two steps of a one-decoder-layer model, validated and saved at each: a
# trial's value, its members' run stores, a pruner's report before the last step, a checkpoint
# written mid-run (the kill's moment) all still happen, and each job's compiles are smaller.
STEPS = 2
SWEEP = [
    f"trainer.steps={STEPS}",
    "trainer.eval_every=1",
    "trainer.save_every=1",
    "model.decoder_layers=1",
    "hydra/sweeper=optuna",
    "hydra.sweeper.sampler.name=random",
    "hydra.sweeper.sampler.seed=0",
    "optim.lr=tag(log, interval(1e-4, 1e-2))",
    "tracker=none",
]
# The sweeps whose tests read only each run's final value validate and save at the last step
# alone: a job's mid-run validation and checkpoint are what the pruning and the kill tests need.
AT_THE_END = (f"trainer.eval_every={STEPS}", f"trainer.save_every={STEPS}")
RECHECKED = ["seeds=[0,1]", "hydra.sweeper.n_trials=3", "hydra.sweeper.recheck.top=2", *AT_THE_END]


def sweep(cwd: Path, *args: str) -> str:
    """`python run.py -m` of the tiny trainer's learning-rate sweep with `args`, its folder
    `cwd/multirun`; what it printed."""
    proc = run_py("-m", *SMALL_DATA, *TINY_TRAIN, *SWEEP, *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def study_of(folder: Path) -> optuna.Study:
    return optuna.load_study(study_name="dalle-ablate", storage=f"sqlite:///{folder / 'optuna.db'}")


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def config_seed(run_dir) -> int:
    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())["seed"]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """Three trials of seeds [0, 1] each, the best two re-checked (default: fresh seeds 2, 3, 4)."""
    tmp = tmp_path_factory.mktemp("seeds")
    return tmp / "multirun", sweep(tmp, *RECHECKED)


@pytest.mark.slow
def test_a_trial_is_the_mean_of_its_members_on_the_same_seeds_as_every_other_trial(swept):
    folder, _ = swept
    got = study_of(folder).get_trials()
    assert [t.state for t in got] == [S.COMPLETE] * 3
    for t in got:
        record = t.user_attrs["members"]
        assert record["seeds"] == [0, 1] and record["statistic"] == "mean"
        # the members really trained seeds 0 and 1, in the trial's own folder, at the trial's rate
        assert [config_seed(d) for d in record["run_dirs"]] == [0, 1]
        assert all(Path(d).is_relative_to(folder / str(t.number)) for d in record["run_dirs"])
        values = [summary(d)["eval/valid/loss"] for d in record["run_dirs"]]
        assert record["values"]["eval/valid/loss"] == pytest.approx(values)
        assert record["sd"]["eval/valid/loss"] == pytest.approx(np.std(values, ddof=1))
        assert t.value == pytest.approx(np.mean(values))
        # one job per trial, its members in it; the sweep folder is every member's W&B group
        metas = [json.loads((Path(d) / "meta.json").read_text()) for d in record["run_dirs"]]
        assert [m["members"]["job_dir"] for m in metas] == [str(folder / str(t.number))] * 2
        assert {m["wandb_group"] for m in metas} == {str(folder)}


@pytest.mark.slow
def test_the_best_trials_are_rechecked_on_unused_seeds_by_the_verdict_engine(swept):
    folder, out = swept
    got = study_of(folder).get_trials()
    results = yaml.safe_load((folder / "optimization_results.yaml").read_text())
    record = results["recheck"]
    best, second = sorted(got, key=lambda t: t.value)[:2]
    assert [t["number"] for t in record["trials"]] == [best.number, second.number]
    assert record["seeds"] == [2, 3, 4]  # as many as a trial trained, at least 3, none the sweep used
    values = []
    for t in (best, second):
        members = json.loads((folder / "recheck" / f"trial{t.number}" / "members.json").read_text())
        assert [m["seed"] for m in members["members"]] == [2, 3, 4]
        job = folder / "recheck" / f"trial{t.number}"
        row = [summary(member_folder(job, m["job_dir"]) / "run")["eval/valid/loss"] for m in members["members"]]
        assert [config_seed(member_folder(job, m["job_dir"]) / "run") for m in members["members"]] == [2, 3, 4]
        values.append(row)
    a, b = np.array(values)
    assert [t["recheck_values"] for t in record["trials"]] == [pytest.approx(a), pytest.approx(b)]
    assert record["trials"][0]["selection_bias"] == pytest.approx(best.value - a.mean())
    # best - runner-up, paired by seed: scipy's paired t test and interval are the oracle
    (vs,) = record["against"]
    test = stats.ttest_rel(a, b)
    low, high = test.confidence_interval(0.95)
    assert vs["trial"] == second.number and vs["paired"] and vs["seeds"] == 3
    assert (vs["difference"], vs["p"], vs["low"], vs["high"]) == (
        pytest.approx((a - b).mean()),
        pytest.approx(test.pvalue),
        pytest.approx(low),
        pytest.approx(high),
    )
    side = "better" if (a - b).mean() < 0 else "worse"
    assert vs["outcome"] == (f"{side} than trial {second.number}" if test.pvalue < 0.05 else "not resolved")
    assert f"re-check on 3 fresh seeds: trial {best.number} (the sweep's best) is {vs['outcome']}" in out


@pytest.mark.slow
def test_a_sweep_run_again_after_its_recheck_trains_nothing_more(swept):
    folder, _ = swept
    before = yaml.safe_load((folder / "optimization_results.yaml").read_text())["recheck"]
    out = sweep(folder.parent, *RECHECKED)  # the same sweep folder
    assert out.count(f"finished before at step {STEPS} of {STEPS}; left as it is (resume=auto)") == 6, out
    assert yaml.safe_load((folder / "optimization_results.yaml").read_text())["recheck"] == before


@pytest.mark.slow
def test_pruning_acts_on_the_members_mean_and_stops_every_member(tmp_path):
    sweep(
        tmp_path,
        "seeds=[0,1]",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.pruner.name=threshold",
        "+hydra.sweeper.pruner.kwargs.upper=0.0",
    )
    (t,) = study_of(tmp_path / "multirun").get_trials()
    assert t.state == S.PRUNED and list(t.intermediate_values) == [1]  # at the first validation, step 1 of 2
    losses = []
    for d in t.user_attrs["members"]["run_dirs"]:
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        losses += [r["eval/valid/loss"] for r in rows if "eval/valid/loss" in r]
        assert summary(d)["status"] == "pruned" and (Path(d) / "checkpoints" / "1").is_dir()  # kept, resumable
    assert len(losses) == 2 and t.intermediate_values[1] == pytest.approx(np.mean(losses))


@pytest.mark.slow
def test_an_upper_bound_statistic_on_seeds_of_each_trial_s_own(tmp_path):
    sweep(
        tmp_path,
        "seeds=[0,1]",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.statistic=upper",
        "hydra.sweeper.common_seeds=false",
        *AT_THE_END,
    )
    for t in study_of(tmp_path / "multirun").get_trials():
        dirs = t.user_attrs["members"]["run_dirs"]
        mine = [2 * t.number, 2 * t.number + 1]  # trial i: seeds [0, 1] shifted by i * 2
        assert t.user_attrs["members"]["seeds"] == mine and [config_seed(d) for d in dirs] == mine
        v = np.array([summary(d)["eval/valid/loss"] for d in dirs])
        # the one-sided 90 % t bound on the mean, as the sweeps guide defines it
        assert t.value == pytest.approx(v.mean() + stats.t.ppf(0.9, 1) * v.std(ddof=1) / math.sqrt(2))


@pytest.mark.slow
def test_kill_9_of_a_multi_seed_sweep_resumes_as_a_one_seed_sweep_does(tmp_path):
    """Killed (SIGKILL) while trial 0's members save step 1 of 2: the next start finds its process gone,
    marks the trial FAILED and each member's run store failed, and runs the trial it still owes."""
    args = [
        "-m",
        *SMALL_DATA,
        *TINY_TRAIN,
        *SWEEP,
        "seeds=[0,1]",
        "hydra.sweeper.n_trials=1",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "KILL_AT": "save:1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    killed = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kill_worker.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (t,) = study_of(tmp_path / "multirun").get_trials()
    assert t.state == S.RUNNING and len(t.user_attrs["members"]["run_dirs"]) == 2
    again = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    got = study_of(tmp_path / "multirun").get_trials()
    assert [t.state for t in got] == [S.FAIL, S.COMPLETE]  # the dead one does not count: one more ran
    for d in got[0].user_attrs["members"]["run_dirs"]:
        assert summary(d)["status"] == "failed" and summary(d)["reason"].startswith("killed: its process died")


def test_a_statistic_the_sweeper_does_not_know_and_a_recheck_of_one_trial_are_refused():
    from dalle_ablate.sweep.sweeper import OptunaSweeper

    with pytest.raises(ConfigError, match="hydra.sweeper.statistic"):
        OptunaSweeper(**SWEEPER, statistic="mode")
    with pytest.raises(ConfigError, match=r"hydra.sweeper.recheck.top=1: 0 \(no re-check\) or the best N >= 2 trials"):
        OptunaSweeper(**SWEEPER, recheck={"top": 1})
    with pytest.raises(ConfigError, match="hydra.sweeper.recheck.top needs one objective"):
        OptunaSweeper(**{**SWEEPER, "direction": ["minimize", "minimize"]}, recheck={"top": 2})


def test_recheck_seeds_are_new_to_the_sweep():
    from dalle_ablate.sweep.recheck import RecheckConf, fresh_seeds

    assert fresh_seeds(RecheckConf(top=2), [0, 1], 2) == [2, 3, 4]  # at least 3
    assert fresh_seeds(RecheckConf(top=2), [5, 0, 1, 2, 3], 5) == [6, 7, 8, 9, 10]  # as many as a trial trained
    assert fresh_seeds(RecheckConf(top=2), [0]) == [1, 2, 3]  # a one-seed sweep
    # trials on seeds of their own (common_seeds=false): after all of them, as many as one trial's
    assert fresh_seeds(RecheckConf(top=2), [0, 1, 2, 3, 4, 5, 6, 7], 4) == [8, 9, 10, 11]
    assert fresh_seeds(RecheckConf(top=2, seeds=[9, 7]), [0, 1]) == [9, 7]
    with pytest.raises(
        ConfigError,
        match=r"hydra.sweeper.recheck.seeds=\[1, 7\]: give at least 2 different seeds the "
        r"sweep did not use \(it used \[0, 1\]\)",
    ):
        fresh_seeds(RecheckConf(top=2, seeds=[1, 7]), [0, 1])


@pytest.mark.slow
def test_a_bound_needs_two_seeds_per_trial(tmp_path):
    proc = run_py("-m", *SMALL_DATA, *TINY_TRAIN, *SWEEP, "hydra.sweeper.statistic=upper", cwd=tmp_path)
    assert proc.returncode != 0
    assert (
        "hydra.sweeper.statistic=upper is a bound on the members' mean: give each trial at least 2 seeds "
        "(seeds=[0,1,2]), or hydra.sweeper.statistic=mean"
    ) in proc.stderr


def test_a_recheck_job_that_fails_is_named_and_the_others_still_judged(tmp_path):
    """Three trials re-checked; the third's job fails before it trains (no members recorded, and
    like a cluster's lost worker no config on its return): the best is judged against the second
    alone, and the failure is on the record with its reason."""
    from hydra.core.utils import JobReturn, JobStatus

    from dalle_ablate.sweep.sweeper import OptunaSweeper

    study = optuna.create_study()
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for x, v in ((0.1, 1.0), (0.2, 1.1), (0.3, 1.2)):
        study.add_trial(optuna.trial.create_trial(params={"x": x}, distributions=space, value=v))
    seeds, rng = [2, 3, 4], np.random.default_rng(0)
    recheck = {0: 1.0 + rng.normal(0, 0.01, 3), 1: 1.1 + rng.normal(0, 0.01, 3)}

    def launch(batch, initial_job_idx):
        out = []
        for number, overrides in enumerate(batch):
            assert f"hydra.sweep.subdir=recheck/trial{number}" in overrides
            ret = JobReturn(overrides=overrides)
            if number not in recheck:
                ret.status, ret._return_value = JobStatus.FAILED, RuntimeError("no space left on device")
                out.append(ret)
                continue
            job, members = tmp_path / "recheck" / f"trial{number}", []
            for value, s in zip(recheck[number], seeds):
                (job / f"seed{s}" / "run").mkdir(parents=True)
                (job / f"seed{s}" / "run" / "summary.json").write_text(json.dumps({"eval/valid/loss": value}))
                members.append({"seed": s, "job_dir": str(job / f"seed{s}"), "status": "finished", "reason": ""})
            (job / "members.json").write_text(json.dumps({"seeds": seeds, "members": members}))
            ret.status, ret._return_value = JobStatus.COMPLETED, 1.0
            out.append(ret)
        return out

    sweeper = OptunaSweeper(
        **SWEEPER,
        recheck={"top": 3, "seeds": seeds},
    )
    sweeper.launcher, sweeper.sweep_dir = SimpleNamespace(launch=launch), tmp_path
    sweeper.validate_batch_is_legal = lambda batch: None
    sweeper.objectives, sweeper.seeds, sweeper.config = ["eval/valid/loss"], [0, 1], {}
    record = sweeper._recheck(study, SimpleNamespace(overrides=lambda p: [f"x={p['x']}"]))
    assert record["failed"] == {2: "raised RuntimeError: no space left on device"}
    assert [t["number"] for t in record["trials"]] == [0, 1] and [a["trial"] for a in record["against"]] == [1]
    assert record["against"][0]["p"] == pytest.approx(stats.ttest_rel(recheck[0], recheck[1]).pvalue)
    # the selection bias: the trial's value in the sweep (one run here) minus its re-checked mean
    assert record["trials"][0]["selection_bias"] == pytest.approx(1.0 - recheck[0].mean())


def test_own_seeds_never_overlap_a_recheck_waits_for_running_trials_and_the_bias_is_on_the_mean():
    from dalle_ablate.sweep.recheck import sweep_mean
    from dalle_ablate.sweep.sweeper import OptunaSweeper

    sweeper = OptunaSweeper(
        **SWEEPER,
        common_seeds=False,
        recheck={"top": 2},
    )
    sweeper.seeds = [0, 3, 6]  # not consecutive: trial i's seeds shifted by their range, 7
    assert [sweeper._seeds(i)[1] for i in range(3)] == ["seeds=[0,3,6]", "seeds=[7,10,13]", "seeds=[14,17,20]"]
    study = optuna.create_study()
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for v in (1.0, 2.0):
        study.add_trial(optuna.trial.create_trial(params={"x": v / 4}, distributions=space, value=v))
    study.ask()  # a trial another process runs: the re-check is left to whoever finishes last
    assert sweeper._recheck(study, None) is None
    # a trial valued by a bound on its members' mean: its selection bias starts from their mean
    bound = optuna.trial.create_trial(
        params={"x": 0.5},
        distributions=space,
        value=2.4,
        user_attrs={"members": {"values": {"eval/valid/loss": [1.0, 2.0]}}},
    )
    assert sweep_mean(bound, "eval/valid/loss") == 1.5


def test_a_staged_recheck_plans_stage_2_once_and_judges_both_looks_as_the_combination_test_says(tmp_path):
    """hydra.sweeper.recheck.stages: the best two trials on seeds 2-4 (stage 1), the rule's stage 2
    on seeds from 10 (recheck/trial<N>-stage2), planned once and kept in recheck/stages.json; the
    best against the runner-up by look 2 is the oracle's verdict -- scipy's paired t test per stage,
    the inverse-normal combination and the published boundaries at α/2 a side -- with the
    repeated confidence interval; a rerun plans nothing again."""
    from hydra.core.utils import JobReturn, JobStatus

    from dalle_ablate.stats import stages as S
    from dalle_ablate.sweep.sweeper import OptunaSweeper

    study = optuna.create_study()
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for x, v in ((0.1, 1.0), (0.2, 1.1)):
        study.add_trial(optuna.trial.create_trial(params={"x": x}, distributions=space, value=v))
    values = {  # trial 1 above trial 0 by about 0.03, with noise: not settled on 3 seeds
        ("trial0", 2): 1.00, ("trial0", 3): 1.05, ("trial0", 4): 0.98,
        ("trial1", 2): 1.04, ("trial1", 3): 1.07, ("trial1", 4): 1.02,
        ("trial0-stage2", 10): 1.01, ("trial0-stage2", 11): 0.97,
        ("trial1-stage2", 10): 1.05, ("trial1-stage2", 11): 1.00,
    }  # fmt: skip
    launched, fail = [], set()

    def launch(batch, initial_job_idx):
        out = []
        for overrides in batch:
            launched.append(overrides)
            sub = next(o for o in overrides if o.startswith("hydra.sweep.subdir=")).split("/")[-1]
            if sub in fail:
                ret = JobReturn(overrides=overrides)
                ret.status, ret._return_value = JobStatus.FAILED, RuntimeError("preempted")
                out.append(ret)
                continue
            seeds = json.loads(next(o for o in overrides if o.startswith("seeds=")).split("=", 1)[1])
            job, members = tmp_path / "recheck" / sub, []
            for s in seeds:
                (job / f"seed{s}" / "run").mkdir(parents=True, exist_ok=True)
                (job / f"seed{s}" / "run" / "summary.json").write_text(json.dumps({"eval/valid/loss": values[sub, s]}))
                members.append({"seed": s, "job_dir": str(job / f"seed{s}"), "status": "finished", "reason": ""})
            (job / "members.json").write_text(json.dumps({"seeds": seeds, "members": members}))
            ret = JobReturn(overrides=overrides)
            ret.status, ret._return_value = JobStatus.COMPLETED, 1.0
            out.append(ret)
        return out

    stages = {"declared": "2026-12-02, before the sweep", "budget": {"runs": 4}, "seeds_from": 10, "cap": 2}
    sweeper = OptunaSweeper(**SWEEPER, recheck={"top": 2, "seeds": [2, 3, 4], "stages": stages})
    sweeper.launcher, sweeper.sweep_dir = SimpleNamespace(launch=launch), tmp_path
    sweeper.validate_batch_is_legal = lambda batch: None
    sweeper.objectives, sweeper.seeds, sweeper.config = ["eval/valid/loss"], [0, 1], {}
    trial_space = SimpleNamespace(overrides=lambda p: [f"x={p['x']}"])
    record = sweeper._recheck(study, trial_space)
    plan = json.loads((tmp_path / "recheck" / "stages.json").read_text())
    assert record["stages"] == plan and plan["stage1"] == [2, 3, 4]
    assert plan["stage2"] == {"trial 0": [10, 11], "trial 1": [10, 11]} and plan["spent"] == 4
    assert [o for o in launched[2] if o.startswith(("seeds=", "hydra.sweep.subdir="))] == [
        "seeds=[10,11]",
        "hydra.sweep.subdir=recheck/trial0-stage2",
    ]

    def z(job_a, job_b, seeds):  # the best's one-sided score of being lower than the runner-up
        a, b = (np.array([values[j, s] for s in seeds]) for j in (job_a, job_b))
        return float(stats.norm.isf(stats.ttest_rel(b, a, alternative="greater").pvalue)), b - a

    z1, d1 = z("trial0", "trial1", [2, 3, 4])
    z2, d2 = z("trial0-stage2", "trial1-stage2", [10, 11])
    combination = S.Combination(w1=math.sqrt(0.5))
    c1, c2 = S.boundaries(0.025, combination.w1**2, combination.kind)
    assert z1 < c1 and combination.w1 * z1 + combination.w2 * z2 >= c2  # the oracle: settled by look 2, not at look 1
    against = record["against"][0]
    assert (against["look1"], against["outcome"]) == ("not resolved", "better than trial 1")
    (_, want) = S.repeated_interval(
        -d1.mean(), d1.std(ddof=1) / math.sqrt(3), 2, -d2.mean(), d2.std(ddof=1) / math.sqrt(2), 1, combination, 0.025
    )
    assert (against["low"], against["high"]) == pytest.approx(want) and against["stage_n"] == [3, 2]
    assert [t["stage2_values"] for t in record["trials"]] == [[1.01, 0.97], [1.05, 1.00]]

    (tmp_path / "recheck" / "stages.json").write_text(json.dumps({**plan, "stage2": {"trial 0": [10, 11]}}))
    again = sweeper._recheck(study, trial_space)  # the kept plan, not a new one: stage 2 on trial 0 alone
    assert again["stages"]["stage2"] == {"trial 0": [10, 11]} and again["against"][0]["stage_n"] == [3, 0]
    fail.add("trial0-stage2")  # a stage-2 job that fails is named, its trial judged on what it has
    assert sweeper._recheck(study, trial_space)["stages"]["failed"] == {0: "raised RuntimeError: preempted"}
    (tmp_path / "recheck" / "stages.json").write_text(json.dumps({**plan, "stage1": [5, 6, 7]}))
    with pytest.raises(ConfigError) as err:  # a plan kept for another stage 1 is not this re-check's
        sweeper._recheck(study, trial_space)
    assert str(err.value) == (
        f"{tmp_path / 'recheck' / 'stages.json'}: stage 2 was planned for the re-check of ['trial 0', 'trial 1'] on "
        "stage-1 seeds [5, 6, 7], this one re-checks ['trial 0', 'trial 1'] on [2, 3, 4]; move the file away to plan anew"
    )


def test_a_bad_recheck_stages_declaration_is_named_before_the_sweep_runs():
    from dalle_ablate.sweep.sweeper import OptunaSweeper

    stages = {"declared": "d", "budget": {"runs": 4}, "seeds_from": 10, "cap": 1}
    with pytest.raises(ConfigError) as err:
        OptunaSweeper(**SWEEPER, recheck={"top": 2, "stages": stages})
    assert str(err.value) == "hydra.sweeper.recheck: stages.cap is 1; give a whole number >= 2"
    with pytest.raises(ConfigError) as err:
        OptunaSweeper(**SWEEPER, recheck={"stages": {**stages, "cap": 2}})
    assert str(err.value) == "hydra.sweeper.recheck.stages needs hydra.sweeper.recheck.top: the trials it re-checks"
