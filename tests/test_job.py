"""`python run.py -m ...` end to end: one run store and one offline W&B run per job, in one group,
with the logged metrics read back from W&B's own files. And the members of a `seeds=[...]` job
(`member_jobs`), each what Hydra gives the separate run `seed=k`."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest

from conftest import SMALL_DATA, TINY_TRAIN, run_py
from dalle_ablate.job import job_info, member_jobs
from dalle_ablate.registry import ConfigError
from dalle_ablate.track.naming import run_naming
from dalle_ablate.track.runstore import read_metrics
from wandb_records import artifacts, history, metric_definitions, run_info, summary


@pytest.mark.slow
def test_two_job_multirun_writes_two_run_stores_and_two_wandb_runs(tmp_path):
    proc = run_py("-m", "model=normformer,deepnet", *SMALL_DATA, *TINY_TRAIN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == (
        f"multirun finished: {tmp_path / 'multirun'}; compare its runs with: "
        f"dalle-ablate report {tmp_path / 'multirun'}"
    )
    jobs = sorted(p for p in (tmp_path / "multirun").iterdir() if p.is_dir() and (p / "run").is_dir())
    assert len(jobs) == 2
    wandb_files = sorted(Path(os.environ["WANDB_DIR"]).glob("wandb/offline-run-*/run-*.wandb"))
    by_id = {}
    for job in jobs:
        meta = json.loads((job / "run" / "meta.json").read_text())
        by_id[meta["wandb_id"]] = job
    found = {}
    for f in wandb_files:  # other tests' runs share WANDB_DIR (some killed, with empty files): pick ours by id
        if f.stem.removeprefix("run-") in by_id:
            info = run_info(f)
            found[info["id"]] = (f, info)
    assert set(found) == set(by_id), "each job has its own W&B run"
    groups = {info["group"] for _, info in found.values()}
    assert groups == {str(tmp_path / "multirun")}
    for run_id, (f, info) in found.items():
        job = by_id[run_id]
        layout = info["config"]["model"]["layout"]
        # Named by what the multirun varies, not by the overrides every job shares.
        assert info["name"] == info["job_type"] == f"model={layout}"
        store = {r["step"]: r for r in read_metrics(job / "run") if "train/loss" in r}
        logged = {r["_step"]: r for r in history(f) if "train/loss" in r}
        assert sorted(logged) == sorted(store) == list(range(1, 7))
        for step, row in store.items():
            assert logged[step]["train/loss"] == pytest.approx(row["train/loss"], rel=1e-7)
            assert logged[step]["train/grad_norm"] == pytest.approx(row["train/grad_norm"], rel=1e-7)
        evals = [r for r in history(f) if "eval/valid/loss" in r]
        assert [r["_step"] for r in evals] == [3, 6]
        images = [r for r in history(f) if r.get("samples/grid/_type") == "image-file"]
        assert [r["_step"] for r in images] == [6] and images[0]["samples/grid/caption"] == "a red circle"


def test_runs_are_named_by_what_their_multirun_varies_seed_included():
    shared = ["optim=shampoo", "trainer.steps=200"]
    names = [
        run_naming([f"model={m}", f"seed={s}", *shared], {"model", "seed"}, m)
        for m in ("normformer", "deepnet")
        for s in (0, 1, 2)
    ]
    assert len({n for n, _ in names}) == 6  # every seed its own name
    assert names[1] == ("model=normformer,seed=1", "model=normformer")  # seeds of a variant share the job type
    # An Optuna trial: the sampled rate to 3 significant digits, the trial's bookkeeping left out.
    trial = ["optim.lr=0.0012345678901234567", "optuna.storage='sqlite:///x.db'", "optuna.trial=3", *shared]
    assert run_naming(trial, {"optim.lr"}, "preln") == ("optim.lr=0.00123", "optim.lr=0.00123")
    # Only the seed varies: the job type is the layout.
    assert run_naming(["seed=2", *shared], {"seed"}, "preln") == ("seed=2", "preln")
    # The data-order and init seeds are seeds too: replicates of one variant share its job type.
    assert run_naming(
        ["model=deepnet", "data_seed=1", "init_seed=4"], {"model", "data_seed", "init_seed"}, "deepnet"
    ) == ("model=deepnet,data_seed=1,init_seed=4", "model=deepnet")
    # A single run: all its overrides (seed included), or "run".
    assert run_naming(["trainer.steps=5", "seed=3", "resume=auto"], set(), "deepnet") == (
        "trainer.steps=5,seed=3",
        "deepnet",
    )
    assert run_naming([], set(), "preln") == ("run", "preln")
    # A study's run shows its arm and its seed whichever of them its job varies (issue 70): the
    # members job of one arm varies the seed, the timed arms' job of one seed the arm.
    study = ["experiment=study_mega", "+arm=bias", "seed=5001"]
    assert (
        run_naming(study, {"seed"}, "preln")
        == run_naming(study, {"arm"}, "preln")
        == ("+arm=bias,seed=5001", "+arm=bias")
    )


@pytest.mark.slow
def test_wandb_names_can_be_set_metrics_are_declared_and_checkpoints_kept(tmp_path):
    proc = run_py(
        *SMALL_DATA,
        *TINY_TRAIN,
        "eval.metrics=[shapes]",
        "eval.guidance_scales=[1,3]",
        "eval.num_samples=8",
        "eval.batch_size=8",
        "eval.grids=[]",
        "tracker.wandb.group=g1",
        "tracker.wandb.name=first try",
        "tracker.wandb.job_type=probe",
        "tracker.wandb.notes=why not",
        "tracker.wandb.log_checkpoints=true",
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "WANDB_SILENT"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = tmp_path / "outputs" / "run" / "run"
    meta = json.loads((store / "meta.json").read_text())
    (f,) = Path(os.environ["WANDB_DIR"]).glob(f"wandb/offline-run-*/run-{meta['wandb_id']}.wandb")
    # W&B's own output silent (WANDB_SILENT unset), its checkpoint artifacts' lines too: one line per W&B
    # run saying where it is, this run's last (before it, the tokenizer run's when the data's tokenizer was fitted).
    said = (proc.stdout + proc.stderr).splitlines()
    assert not [line for line in said if line.startswith("wandb:")], said
    runs = [line for line in said if "W&B" in line]
    assert runs[-1] == f"W&B run (offline): {f.parent}; upload it with wandb sync" and len(runs) <= 2, runs
    assert all(line.startswith("W&B run (offline): ") and line.endswith("; upload it with wandb sync") for line in runs)
    info = run_info(f)
    assert (info["group"], info["name"], info["job_type"], info["notes"]) == ("g1", "first try", "probe", "why not")
    assert meta["wandb_group"] == "g1"  # where `dalle-ablate eval` files its jobs
    defs = metric_definitions(f)
    for pattern in ("train/*", "eval/*", "perf/*", "optim/*"):
        assert defs[pattern]["step_metric"] == "tokens"
    assert defs["train/loss"] == {"step_metric": "tokens", "hidden": False, "summary": {"min", "last"}}
    assert defs["eval/valid/loss"]["summary"] == {"min", "last"}
    for s in ("1", "3"):
        assert defs[f"eval/pareto/s{s}/shapes/all"]["summary"] == {"max", "last"}
        assert defs[f"eval/pareto/s{s}/n"]["hidden"] and defs[f"eval/pareto/s{s}/shapes/n"]["hidden"]
    hidden = {k for k, d in defs.items() if d["hidden"]}
    assert hidden and all(k.endswith(("/n", "_n", "/floor")) for k in hidden), hidden  # counts only
    assert any("eval/pareto/s1/shapes/color" in row for row in history(f))  # logged, charted, not hidden
    # The summary keeps the best as well as the last: the last eval loss is not all there is.
    evals = [r["eval/valid/loss"] for r in history(f) if "eval/valid/loss" in r]
    best = summary(f)["eval/valid/loss"]
    assert best == {"min": pytest.approx(min(evals)), "last": pytest.approx(evals[-1])}
    # Each checkpoint, once complete on disk, as a model artifact with every file orbax wrote.
    logged = [a for a in artifacts(f) if a["type"] == "model"]
    assert [(a["name"], set(a["aliases"]), a["metadata"]) for a in logged] == [
        (f"checkpoint-{meta['wandb_id']}", {f"step-{s}", "latest"}, {"step": s}) for s in (3, 6)
    ]
    on_disk = sorted(
        str(p.relative_to(store / "checkpoints" / "6")) for p in (store / "checkpoints" / "6").rglob("*") if p.is_file()
    )
    assert logged[-1]["files"] == on_disk


# -- seeds as members of one job (issue 40) -----------------------------------------------------


def hydra_jobs(*overrides: str, task, multirun: bool = True) -> list:
    """`task(cfg)` of each job of `python run.py [-m] <overrides> tracker=none`, run by Hydra itself
    in this process (its sweeper, its folders, the overrides it records) with `task` in place of
    training."""
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    state = copy.deepcopy(Singleton.get_state())
    results = []
    try:
        hydra_ = Hydra.create_main_hydra_file_or_module(
            calling_file=None, calling_module="dalle_ablate.job", config_path="conf", job_name="run"
        )
        launch = hydra_.multirun if multirun else hydra_.run
        mode = "hydra.mode=MULTIRUN" if multirun else "hydra.mode=RUN"  # as the command line's -m sets it
        # A job that raises raises here (Hydra reads each job's return value), as it fails `python run.py`.
        launch(
            config_name="config",
            task_function=lambda cfg: results.append(task(cfg)),
            overrides=[*overrides, "tracker=none", mode],
            with_log_configuration=False,
        )
    finally:
        GlobalHydra.instance().clear()
        Singleton.set_state(state)
    return results


def members_of(cfg):
    job = job_info(cfg)
    return job, member_jobs(cfg, job, list(cfg.seeds))


def described(job) -> dict:
    """A JobInfo's fields but its hooks (an object each)."""
    return {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name != "hooks"}


def test_members_of_a_study_mega_job_are_its_separate_runs(tmp_path):
    sweep = tmp_path / "mega"
    [(job, members)] = hydra_jobs(
        "experiment=study_mega", "+arm=baseline", "seeds=[0,1,2]", "seed=0", f"hydra.sweep.dir={sweep}", task=members_of
    )
    separate = hydra_jobs(
        "experiment=study_mega", "+arm=baseline", "seed=0,1,2", f"hydra.sweep.dir={sweep}", task=job_info
    )
    assert (
        [m.job_dir for m in members]
        == [sweep / f"baseline-seed{k}" for k in (0, 1, 2)]
        == [s.job_dir for s in separate]
    )
    # The sweeper's params come first (seed: the preset sweeps no arm), then the command line:
    # seed=k where Hydra records it.
    assert [m.overrides for m in members] == [
        [f"seed={k}", "experiment=study_mega", "+arm=baseline", "tracker=none"] for k in (0, 1, 2)
    ]
    # a study's run named by its arm and its seed (the multirun varies the seed alone); the job type its arm
    assert [(m.name, m.job_type) for m in members] == [(f"seed={k},+arm=baseline", "+arm=baseline") for k in (0, 1, 2)]
    assert [described(m) for m in members] == [described(s) for s in separate]
    assert [m.config["seed"] for m in members] == [0, 1, 2] and {m.config["seeds"] for m in members} == {None}
    assert all(m.hooks is job.hooks for m in members) and members[0].group == str(sweep)


def test_members_of_a_default_multirun_go_under_its_job_folder(tmp_path):
    jobs = hydra_jobs(
        "seeds=[0,1,2]",
        "model=postln,deepnet",
        "trainer.steps=5",
        "members.impl=map",
        "mesh.member=3",
        f"hydra.sweep.dir={tmp_path / 'members'}",
        task=members_of,
    )
    separate = hydra_jobs(
        "seed=0,1,2", "model=postln,deepnet", "trainer.steps=5", f"hydra.sweep.dir={tmp_path / 'runs'}", task=job_info
    )
    for (job, members), num in zip(jobs, (0, 1)):
        assert job.job_dir == tmp_path / "members" / str(num)  # ${hydra.job.num}: the seed does not name it
        assert [m.job_dir for m in members] == [job.job_dir / f"seed{k}" for k in (0, 1, 2)]
    # `seeds=[...]` written as `seed=k`: in its place, as `-m seed=0,1,2 model=...` records it.
    assert jobs[1][1][2].overrides == ["seed=2", "model=deepnet", "trainer.steps=5", "tracker=none"]
    assert jobs[1][1][2].name == "seed=2,model=deepnet" and jobs[1][1][2].job_type == "model=deepnet"
    by_run = {(s.config["model"]["layout"], s.config["seed"]): s for s in separate}
    for _, members in jobs:
        for m in members:
            s = by_run[m.config["model"]["layout"], m.config["seed"]]
            assert (m.overrides, m.name, m.job_type, m.config) == (s.overrides, s.name, s.job_type, s.config)
            assert m.config["members"] == {"impl": "vmap"} and m.config["mesh"]["member"] == 1


def test_members_of_a_single_run_whose_folder_names_the_seed(tmp_path):
    run_dir = f"hydra.run.dir={tmp_path}/r/s${{seed}}"
    [(job, members)] = hydra_jobs("seeds=[1,2]", "seed=1", "trainer.steps=5", run_dir, task=members_of, multirun=False)
    separate = [hydra_jobs(f"seed={k}", "trainer.steps=5", run_dir, task=job_info, multirun=False)[0] for k in (1, 2)]
    assert [m.job_dir for m in members] == [tmp_path / "r" / "s1", tmp_path / "r" / "s2"]
    assert members[1].overrides == ["seed=2", "trainer.steps=5", "tracker=none"]
    assert (members[1].name, members[1].job_type, members[1].group) == (
        "seed=2,trainer.steps=5,tracker=none",
        "preln",
        None,
    )
    assert [described(m) for m in members] == [described(s) for s in separate]


def test_a_members_job_refuses_a_folder_named_by_a_seed_not_among_its_seeds(tmp_path):
    with pytest.raises(ConfigError) as err:
        hydra_jobs(
            "experiment=study_mega",
            "+arm=baseline",
            "seeds=[1,2]",
            "seed=0",
            f"hydra.sweep.dir={tmp_path}",
            task=members_of,
        )
    assert str(err.value) == (
        f"seeds=[1, 2] leaves out seed=0, and hydra.sweep.subdir names this job's folder "
        f"{tmp_path}/baseline-seed0 by its seed: it would hold a run that is not a member; "
        f"pass seed=1 (the first of seeds)"
    )


def test_a_resumed_members_job_finds_its_members_where_it_recorded_them(tmp_path):
    # The resume hint names the job's folder literally: only its members.json knows where the members went.
    job_dir = tmp_path / "mega" / "baseline-seed0"
    recorded = [str(tmp_path / "mega" / f"baseline-seed{k}") for k in (0, 1, 2)]
    job_dir.mkdir(parents=True)
    (job_dir / "members.json").write_text(
        json.dumps({"seeds": [0, 1, 2], "members": [{"seed": k, "job_dir": d} for k, d in zip((0, 1, 2), recorded)]})
    )
    again = (
        "experiment=study_mega",
        "+arm=baseline",
        "seeds=[0,1,2]",
        "seed=0",
        "resume=auto",
        f"hydra.run.dir={job_dir}",
    )
    [(_, members)] = hydra_jobs(*again, task=members_of, multirun=False)
    assert [str(m.job_dir) for m in members] == recorded
    # A record of other seeds is not this job's: its members go under its folder.
    (job_dir / "members.json").write_text(
        json.dumps({"seeds": [0, 1], "members": [{"seed": k, "job_dir": d} for k, d in zip((0, 1), recorded)]})
    )
    [(_, members)] = hydra_jobs(*again, task=members_of, multirun=False)
    assert [m.job_dir for m in members] == [job_dir / f"seed{k}" for k in (0, 1, 2)]
