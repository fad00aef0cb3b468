"""`python run.py -m ...` end to end: one run store and one offline W&B run per job, in one group,
with the logged metrics read back from W&B's own files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import SMALL_DATA, TINY_TRAIN, run_py
from dalle_ablate.track.naming import run_naming
from dalle_ablate.track.runstore import read_metrics
from wandb_records import artifacts, history, metric_definitions, run_info, summary


@pytest.mark.slow
def test_two_job_multirun_writes_two_run_stores_and_two_wandb_runs(tmp_path):
    proc = run_py("-m", "model=normformer,deepnet", *SMALL_DATA, *TINY_TRAIN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == (f"multirun finished: {tmp_path / 'multirun'}; compare its runs with: "
                                            f"dalle-ablate report {tmp_path / 'multirun'}")
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
    names = [run_naming([f"model={m}", f"seed={s}", *shared], {"model", "seed"}, m) for m in ("normformer", "deepnet")
             for s in (0, 1, 2)]
    assert len({n for n, _ in names}) == 6  # every seed its own name
    assert names[1] == ("model=normformer,seed=1", "model=normformer")  # seeds of a variant share the job type
    # An Optuna trial: the sampled rate to 3 significant digits, the trial's bookkeeping left out.
    trial = ["optim.lr=0.0012345678901234567", "optuna.storage='sqlite:///x.db'", "optuna.trial=3", *shared]
    assert run_naming(trial, {"optim.lr"}, "preln") == ("optim.lr=0.00123", "optim.lr=0.00123")
    # Only the seed varies: the job type is the layout.
    assert run_naming(["seed=2", *shared], {"seed"}, "preln") == ("seed=2", "preln")
    # The data-order and init seeds are seeds too: replicates of one variant share its job type.
    assert run_naming(["model=deepnet", "data_seed=1", "init_seed=4"], {"model", "data_seed", "init_seed"}, "deepnet") == (
        "model=deepnet,data_seed=1,init_seed=4", "model=deepnet")
    # A single run: all its overrides (seed included), or "run".
    assert run_naming(["trainer.steps=5", "seed=3", "resume=auto"], set(), "deepnet") == ("trainer.steps=5,seed=3", "deepnet")
    assert run_naming([], set(), "preln") == ("run", "preln")


@pytest.mark.slow
def test_wandb_names_can_be_set_metrics_are_declared_and_checkpoints_kept(tmp_path):
    proc = run_py(*SMALL_DATA, *TINY_TRAIN, "eval.metrics=[shapes]", "eval.guidance_scales=[1,3]", "eval.num_samples=8",
                  "eval.batch_size=8", "eval.grids=[]", "tracker.wandb.group=g1", "tracker.wandb.name=first try",
                  "tracker.wandb.job_type=probe", "tracker.wandb.notes=why not", "tracker.wandb.log_checkpoints=true",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = tmp_path / "outputs" / "run" / "run"
    meta = json.loads((store / "meta.json").read_text())
    (f,) = Path(os.environ["WANDB_DIR"]).glob(f"wandb/offline-run-*/run-{meta['wandb_id']}.wandb")
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
        (f"checkpoint-{meta['wandb_id']}", {f"step-{s}", "latest"}, {"step": s}) for s in (3, 6)]
    on_disk = sorted(str(p.relative_to(store / "checkpoints" / "6")) for p in (store / "checkpoints" / "6").rglob("*")
                     if p.is_file())
    assert logged[-1]["files"] == on_disk
