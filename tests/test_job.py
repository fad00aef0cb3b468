"""`python run.py -m ...` end to end: one run store and one offline W&B run per job, in one group,
with the logged metrics read back from W&B's own files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import SMALL_DATA, TINY_TRAIN, run_py
from dalle_ablate.track.runstore import read_metrics
from wandb_records import history, run_info


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
        assert info["job_type"] == layout and f"model={layout}" in info["name"]
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
