"""The Optuna sweeper (hydra/sweeper=optuna): search spaces from overrides, trial states, resume
and shared storages with exact trial counts, pruning (of the test app's job and of the trainer),
parallel jobs through the joblib launcher, and the sweeps/ config group."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import optuna.distributions as D
import yaml
import pytest
from hydra.core.utils import JobReturn, JobStatus

from conftest import CONF, SMALL_DATA, TINY_TRAIN, run_py
from dalle_ablate.registry import ConfigError
from dalle_ablate.sweep.space import parse
from dalle_ablate.sweep.sweeper import outcome

APP = Path(__file__).parent / "sweep_app" / "app.py"
S = optuna.trial.TrialState


def test_each_override_form_becomes_its_distribution():
    space = parse(
        [
            "optim.lr=tag(log, interval(1e-4, 1e-2))",
            "model=choice(normformer,deepnet)",
            "seed=0,1,2",
            "k=range(1,7,2)",
            "w=tag(int, interval(2, 9))",
            "x=interval(0, 1)",
            "trainer.steps=3",
        ],
        {"optim.b1": "interval(0.8, 0.95)", "x": "choice(5,6)"},
    )
    d = space.distributions
    assert d["optim.lr"] == D.FloatDistribution(1e-4, 1e-2, log=True)
    assert d["model"] == D.CategoricalDistribution(["normformer", "deepnet"])
    assert d["seed"] == D.CategoricalDistribution([0, 1, 2])
    assert d["k"] == D.IntDistribution(1, 5, step=2)
    assert d["w"] == D.IntDistribution(2, 9)
    assert d["x"] == D.FloatDistribution(0.0, 1.0)  # the command line wins over the params block
    assert d["optim.b1"] == D.FloatDistribution(0.8, 0.95)
    assert space.fixed == ["trainer.steps=3"]
    assert space.overrides({"optim.lr": 0.001, "model": "deepnet", "k": 3}) == [
        "trainer.steps=3",
        "optim.lr=0.001",
        "model=deepnet",
        "k=3",
    ]
    assert parse(["seed=0,1", "k=range(1,4)"]).grid() == {"seed": [0, 1], "k": [1, 2, 3]}
    assert parse(["+extra.rate=interval(0, 1)"]).overrides({"extra.rate": 0.5}) == [
        "+extra.rate=0.5"
    ]  # a new field keeps its +
    # A field fixed with + in the params block and searched on the command line is searched only
    # (the job must not get both `+extra.rate=0.1` and `+extra.rate=...`), and the other way round.
    searched = parse(["+extra.rate=interval(0, 1)"], {"+extra.rate": "0.1"})
    assert searched.fixed == [] and searched.overrides({"extra.rate": 0.5}) == ["+extra.rate=0.5"]
    fixed = parse(["+extra.rate=0.1"], {"+extra.rate": "interval(0, 1)"})
    assert fixed.distributions == {} and fixed.fixed == ["+extra.rate=0.1"]


@pytest.mark.parametrize(
    "override,message",
    [
        ("x=tag(log, interval(0, 1))", r"x: tag\(log, interval\(0.0, 1.0\)\) needs a positive lower bound"),
        ("x=interval(2, 1)", r"x: interval\(2.0, 1.0\) is empty"),
        ("x=tag(sqrt, interval(1, 2))", r"x: unknown tag sqrt; valid tags: log, int"),
        (
            "x=tag(log, choice(1, 2))",
            r"x: tag\(log, \.\.\.\) applies to interval\(\.\.\.\) and range\(\.\.\.\), not to choice",
        ),
        ("x=interval(1,", r"cannot parse sweep override"),
    ],
)
def test_bad_search_spaces_name_the_parameter(override, message):
    with pytest.raises(ConfigError, match=message):
        parse([override])


def test_grid_needs_discrete_parameters():
    with pytest.raises(
        ConfigError,
        match=r"hydra.sweeper.sampler.name=grid needs discrete parameters; x is an interval "
        r"\[0.0, 1.0\] \(use choice",
    ):
        parse(["x=interval(0, 1)"]).grid()


def _ret(status, value):
    r = JobReturn()
    r.status, r._return_value = status, value
    return r


def test_job_outcomes_become_trial_states():
    assert outcome(_ret(JobStatus.COMPLETED, 0.5), 1) == (S.COMPLETE, [0.5], "")
    assert outcome(_ret(JobStatus.COMPLETED, [0.5, 2]), 2) == (S.COMPLETE, [0.5, 2.0], "")
    assert outcome(_ret(JobStatus.FAILED, RuntimeError("boom")), 1) == (S.FAIL, None, "raised RuntimeError: boom")
    assert outcome(_ret(JobStatus.FAILED, optuna.TrialPruned("at 3")), 1) == (S.PRUNED, None, "at 3")
    assert outcome(_ret(JobStatus.COMPLETED, math.nan), 1) == (S.FAIL, None, "returned [nan] (not finite)")
    assert outcome(_ret(JobStatus.COMPLETED, 0.5), 2) == (S.FAIL, None, "returned 1 values for 2 directions")
    assert outcome(_ret(JobStatus.COMPLETED, None), 1)[0] == S.FAIL


def sweep(tmp_path: Path, *args: str, sweep_dir: Path | None = None, wait: bool = True):
    cmd = [sys.executable, str(APP), "-m", f"hydra.sweep.dir={sweep_dir or tmp_path / 'sweep'}", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def trials(url: str, name: str = "dalle-ablate") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=url).get_trials()


def test_a_resumed_study_counts_its_total_and_does_not_repeat_trials(tmp_path):
    new = sweep(
        tmp_path, "x=interval(0, 1)", "y=choice(a, b)", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=0"
    )
    assert "A new study created" not in new.stderr and "finished with value" not in new.stderr  # optuna's INFO lines
    first = trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    proc = sweep(
        tmp_path, "x=interval(0, 1)", "y=choice(a, b)", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0"
    )
    assert (proc.stdout + proc.stderr).count("Launching 1 jobs") == 1  # 3 in all: one more, not three more
    after = trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.number for t in after] == [0, 1, 2] and all(t.state == S.COMPLETE for t in after)
    assert [t.params for t in after[:2]] == [t.params for t in first]  # finished trials are kept, not rerun
    assert after[2].params not in [t.params for t in first]  # the same seed, yet a new point in the resumed sweep
    for t in after:  # each value is the job's function of its parameters
        assert t.value == pytest.approx((t.params["x"] - 0.3) ** 2 + (0.5 if t.params["y"] == "b" else 0.0) + 0.01)
    results = (tmp_path / "sweep" / "optimization_results.yaml").read_text()
    assert "COMPLETE: 3" in results and f"value: {min(t.value for t in after)}" in results


def test_a_failing_job_is_a_failed_trial_and_the_sweep_goes_on(tmp_path):
    proc = sweep(
        tmp_path, "mode=choice(raise, nonfinite, ok)", "hydra.sweeper.sampler.name=grid", "hydra.sweeper.n_trials=10"
    )
    got = {
        t.params["mode"]: (t.state, t.user_attrs.get("why"))
        for t in trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    }
    assert got == {
        "raise": (S.FAIL, "raised RuntimeError: job failed on purpose"),
        "nonfinite": (S.FAIL, "returned [nan] (not finite)"),
        "ok": (S.COMPLETE, None),
    }  # grid: 3 points, not 10
    assert "FAIL: raised RuntimeError: job failed on purpose" in proc.stdout + proc.stderr


def test_a_bad_override_fails_the_asked_trials_instead_of_leaving_them_running(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(APP),
            "-m",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "x=interval(0, 1)",
            "no_such_field=choice(1, 2)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "no_such_field" in proc.stderr
    (t,) = trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert t.state == S.FAIL and t.user_attrs["why"].startswith("sweep stopped: ConfigCompositionException")


def test_the_pruner_stops_a_job_and_records_it_pruned(tmp_path):
    sweep(
        tmp_path,
        "x=interval(0, 1)",
        "mode=report",
        "steps=5",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.pruner.name=threshold",
        "+hydra.sweeper.pruner.kwargs.upper=0.5",
    )
    got = trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.state for t in got] == [S.PRUNED, S.PRUNED]
    # the job reported value + 1/step > 0.5 at step 1 and stopped there
    assert [json.loads((tmp_path / "sweep" / str(t.number) / "steps.json").read_text()) for t in got] == [1, 1]
    assert all(list(t.intermediate_values) == [1] for t in got)


def test_parallel_jobs_through_joblib_and_several_objectives(tmp_path):
    sweep(
        tmp_path,
        "x=interval(0, 1)",
        "two_objectives=true",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.direction=[minimize,maximize]",
        "hydra.sweeper.sampler.name=nsgaii",
        "hydra.sweeper.sampler.seed=1",
    )
    got = trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert [t.number for t in got] == [0, 1, 2, 3] and all(t.state == S.COMPLETE for t in got)
    assert all(t.values == pytest.approx([(t.params["x"] - 0.3) ** 2 + 0.01, t.params["x"]]) for t in got)
    assert "pareto_front:" in (tmp_path / "sweep" / "optimization_results.yaml").read_text()


def two_processes(tmp_path: Path, url: str, name: str, n: int, *args: str) -> list[optuna.trial.FrozenTrial]:
    procs = [
        sweep(
            tmp_path,
            "x=interval(0, 1)",
            "sleep=0.3",
            f"hydra.sweeper.n_trials={n}",
            f"hydra.sweeper.storage='{url}'",
            f"hydra.sweeper.study_name={name}",
            *args,
            sweep_dir=tmp_path / f"p{i}",
            wait=False,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return trials(url, name)


def test_two_processes_on_one_sqlite_study_run_exactly_n_trials(tmp_path):
    # Both seeded alike: each process draws from its own seed (study.sampler_seed), 6 points, not 3 twice.
    got = two_processes(
        tmp_path,
        f"sqlite:///{tmp_path / 'shared.db'}",
        "shared",
        6,
        "hydra.sweeper.sampler.name=random",
        "hydra.sweeper.sampler.seed=0",
    )
    assert sorted(t.number for t in got) == list(range(6)) and all(t.state == S.COMPLETE for t in got)
    assert len({t.params["x"] for t in got}) == 6
    ran = sorted(p.name for d in ("p0", "p1") for p in (tmp_path / d).iterdir() if p.is_dir())
    assert ran == [str(i) for i in range(6)]  # each trial ran once, in one of the two processes


def killed_sweep(tmp_path: Path, *args: str) -> optuna.trial.FrozenTrial:
    """A sweep killed (its whole process group, as kill -9 of a terminal's job) while trial 0 runs:
    the trial it leaves RUNNING."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(APP),
            "-m",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            "x=interval(0, 1)",
            "sleep=120",
            "hydra.sweeper.n_trials=2",
            *args,
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "sweep" / "0").is_dir():  # trial 0's job has started
            time.sleep(0.1)
        time.sleep(1.5)  # its heartbeat is recorded
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (t,) = trials(f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}")
    assert t.state == S.RUNNING  # what a killed sweep leaves behind
    assert t.user_attrs["dalle_ablate.sweep_process"]["pid"] == proc.pid
    return t


def test_a_trial_whose_sweep_was_killed_on_another_host_is_failed_after_its_grace_period(tmp_path):
    url = f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}"
    beat = ["hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.grace_period=2"]
    t = killed_sweep(tmp_path, *beat)
    # As the sweep of another machine sharing the study records it: its pid means nothing here.
    optuna.storages.RDBStorage(url).set_trial_user_attr(
        t._trial_id, "dalle_ablate.sweep_process", {"host": "elsewhere", "pid": 1, "start": "0"}
    )
    time.sleep(2.5)  # past the grace period
    proc = sweep(tmp_path, "x=interval(0, 1)", "hydra.sweeper.n_trials=2", *beat)
    got = trials(url)
    assert [t.state for t in got] == [S.FAIL, S.COMPLETE, S.COMPLETE]  # the dead one is not one of the 2
    why = "its process died: no heartbeat for over 2 s (hydra.sweeper.grace_period), found by a later sweep start"
    assert optuna.load_study(study_name="dalle-ablate", storage=url).user_attrs["dalle_ablate.died"] == {"0": why}
    assert "died:\n  0: 'its process died" in (tmp_path / "sweep" / "optimization_results.yaml").read_text()
    assert "trial 0 FAIL: its process died" in proc.stdout + proc.stderr


def test_a_trial_whose_sweep_was_killed_on_this_host_is_failed_at_the_next_start(tmp_path):
    # The default heartbeat (60 s) and grace period (120 s): the rerun right after the kill knows the
    # trial dead by its sweep's pid, and runs two trials beside it.
    url = f"sqlite:///{tmp_path / 'sweep' / 'optuna.db'}"
    pid = killed_sweep(tmp_path).user_attrs["dalle_ablate.sweep_process"]["pid"]
    sweep(tmp_path, "x=interval(0, 1)", "hydra.sweeper.n_trials=2")
    assert [t.state for t in trials(url)] == [S.FAIL, S.COMPLETE, S.COMPLETE]
    why = f"its process died: its sweep (pid {pid}) on this host is gone, found by a later sweep start"
    assert optuna.load_study(study_name="dalle-ablate", storage=url).user_attrs["dalle_ablate.died"] == {"0": why}


def test_a_live_sweep_process_on_this_host_is_not_taken_for_dead():
    from dalle_ablate.sweep.recovery import process_gone, this_process

    me = this_process()
    assert not process_gone(me)
    assert process_gone({**me, "start": "1"})  # my pid, but a process started at another time: a reused pid
    assert not process_gone({**me, "host": "elsewhere"})  # another host's pids mean nothing here
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_gone({**me, "pid": child.pid})
    # a cluster launcher's jobs (Ray, SLURM) outlive the sweep process: only their heartbeat tells
    assert not process_gone({**me, "pid": child.pid, "local": False})


def test_two_processes_on_one_postgresql_study_run_exactly_n_trials(tmp_path):
    url = os.environ.get("DALLE_ABLATE_TEST_POSTGRES")
    if not url:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must provide a PostgreSQL server: .ci/run sets DALLE_ABLATE_TEST_POSTGRES from .ci/postgres.sh"
            )
        pytest.skip("no PostgreSQL server: set DALLE_ABLATE_TEST_POSTGRES (see .ci/postgres.sh)")
    name = f"shared-{uuid.uuid4().hex[:8]}"
    got = two_processes(tmp_path, url, name, 6)
    assert sorted(t.number for t in got) == list(range(6)) and all(t.state == S.COMPLETE for t in got)
    optuna.delete_study(study_name=name, storage=url)


@pytest.mark.parametrize("name", ["lr_adam", "lr_adafactor", "lr_shampoo", "layouts_x_seeds"])
def test_the_sweeps_group_composes(name):
    from hydra import compose, initialize_config_dir

    from dalle_ablate import validate  # noqa: F401  (registers every schema)

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"sweeps={name}"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    if name.startswith("lr_"):
        assert cfg.optim.name == name[3:] and sweeper.study_name == name
        assert sweeper._target_.endswith("OptunaSweeper") and sweeper.pruner.name == "median"
        lr = parse([], dict(sweeper.params)).distributions["optim.lr"]
        assert lr.log and 0 < lr.low < lr.high
    else:
        assert set(sweeper.params) == {"model", "seed"} and len(str(sweeper.params.model).split(",")) == 7


def test_an_experiment_preset_applies_over_a_sweep_preset(capsys):
    from dalle_ablate.cli import run_hydra
    from dalle_ablate.validate import compose

    swept = compose(["sweeps=lr_adam"])
    both = compose(["sweeps=lr_adam", "experiment=quick"])
    assert (swept.trainer.steps, swept.trainer.eval_every) == (300, 25)
    assert (both.trainer.steps, both.trainer.eval_every) == (100, 50)  # experiment=quick's
    assert both.optim.name == "adam" and both.trainer.eval_batches == 8  # what quick leaves alone stays the sweep's
    with pytest.raises(SystemExit) as e:
        run_hydra(lambda: compose(["+sweeps=lr_adam"]))
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: sweeps is already in the defaults list: choose it with sweeps=lr_adam, without the '+'\n"
    )


@pytest.mark.slow
def test_the_trainer_reports_eval_loss_and_stops_when_pruned(tmp_path):
    proc = run_py(
        "-m",
        *SMALL_DATA,
        *TINY_TRAIN,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        "optim.lr=tag(log, interval(1e-4, 1e-2))",
        "model=choice(normformer,deepnet)",
        "tracker=none",
        "hydra.sweeper.pruner.name=threshold",
        "+hydra.sweeper.pruner.kwargs.upper=0.0",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (t,) = trials(f"sqlite:///{tmp_path / 'multirun' / 'optuna.db'}")
    assert t.state == S.PRUNED and list(t.intermediate_values) == [
        3
    ]  # first evaluation (trainer.eval_every=3) of 6 steps
    store = tmp_path / "multirun" / "0" / "run"
    rows = [json.loads(line) for line in (store / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [row for row in rows if "eval/valid/loss" in row]  # beside it, its per-example table's line
    assert max(row["step"] for row in rows) == 3 and t.intermediate_values[3] == pytest.approx(
        evaluated["eval/valid/loss"]
    )
    assert json.loads((store / "summary.json").read_text())["status"] == "pruned"


@pytest.mark.slow
def test_a_sweep_of_the_trainer_says_what_it_found(tmp_path):
    proc = run_py(
        "-m",
        *SMALL_DATA,
        *TINY_TRAIN,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        "optim.lr=tag(log, interval(1e-4, 1e-2))",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="dalle-ablate", storage=f"sqlite:///{tmp_path / 'multirun' / 'optuna.db'}")
    (t,) = study.get_trials()
    store = tmp_path / "multirun" / "0" / "run"
    summary = json.loads((store / "summary.json").read_text())
    assert t.state == S.COMPLETE and t.value == pytest.approx(summary["eval/valid/loss"])
    # The trial points at its run store and its W&B run; the dashboard names the metric.
    assert t.user_attrs["run_dir"] == str(store)
    assert t.user_attrs["wandb_id"] == json.loads((store / "meta.json").read_text())["wandb_id"]
    assert study.metric_names == ["eval/valid/loss"]
    results = yaml.safe_load((tmp_path / "multirun" / "optimization_results.yaml").read_text())
    assert results["objectives"] == ["eval/valid/loss"]
    assert results["best"]["run_dir"] == str(store) and results["best"]["value"] == t.value
    out = proc.stdout + proc.stderr
    lr = f"optim.lr={t.params['optim.lr']:.3g}"
    assert f"trial 0 COMPLETE: eval/valid/loss={t.value:.6g} at {lr}" in out
    assert f"best of 1 complete trials: trial 0, eval/valid/loss={t.value:.6g} at {lr}, run store {store}" in out
    # optuna's notes on its heartbeat (experimental; meant for Study.optimize) are not the user's business
    assert "ExperimentalWarning" not in out and "Heartbeat of storage" not in out
