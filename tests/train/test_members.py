"""Seeds as members of one job (train/members.py, issue 40): each member is its separate run --
exactly under `members.impl=map`, within float32 rounding under `vmap` -- in a run store, W&B run
and checkpoints of its own; a member that diverges is frozen and ended while the others go on;
Ctrl-C saves every member and `resume=auto` continues each, from the newest step all of them have.

One module fixture trains the tiny job three ways (3 members under map, under vmap, and the 3
separate runs) with the sampling evaluation and W&B (offline) on (the vmap members without W&B:
only their numbers are read); the tests read those stores."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from conftest import AS_HERE, EVAL_ON, SMALL_DATA, TINY_TRAIN, run_config
from wandb_records import summary as wandb_summary

from dalle_ablate.job import outcome
from dalle_ablate.registry import Interrupted, RunFailed
from dalle_ablate.report.load import load_runs
from dalle_ablate.track.runstore import read_metrics
from dalle_ablate.train import program
from dalle_ablate.train.loop import JobInfo, train, train_members
from dalle_ablate.train.records import member_folder

SEEDS = [0, 1, 2]
# The sampling evaluation on 4 prompts per guidance scale (the suite's 8; the same compiled
# programs, whose batches are padded to eval.batch_size): every metric, table and grid is still
# computed for each member and compared, with half the drawn images to parse (measured: parsing
# was ~30 % of a members job once its programs were compiled).
EVAL = [*EVAL_ON, "eval.num_samples=4"]
CFG = ["tracker=wandb", *EVAL]  # W&B offline: the members' runs live side by side in one process
# The 4-step runs of the other optimizers: one validation and one checkpoint, at the last step
# (their comparison reads every logged value, the validation loss included; the checkpoints are
# not read): each of their trainings skips a validation pass and a save.
AT_THE_LAST = ["trainer.eval_every=4", "trainer.save_every=4"]


def members_job(root: Path, impl: str, *extra: str, tracker: str = "wandb") -> list:
    cfg = run_config(f"tracker={tracker}", *EVAL, f"seeds={SEEDS}".replace(" ", ""), f"members.impl={impl}", *extra)
    jobs = [JobInfo(root / f"seed{s}", name=f"seed={s}", overrides=[f"seed={s}"]) for s in SEEDS]
    return train_members(cfg, JobInfo(root), jobs)


def rows(store: Path) -> dict[tuple[int, str], object]:
    """(step, key) -> value of a run store's metrics, timing left out (it never reproduces)."""
    return {
        (r["step"], k): v
        for r in read_metrics(store)
        for k, v in r.items()
        if k != "step" and not k.startswith("perf/")
    }


def params_at(store: Path, step: int) -> dict:
    """The parameters of a checkpoint as saved, flattened to path -> numpy array."""
    restored = ocp.StandardCheckpointer().restore((store / "checkpoints" / str(step) / "default").absolute())
    import jax

    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(restored["params"])[0]
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("members")
    # The vmap members' test reads their numbers only: no W&B runs for them.
    results = {"map": members_job(root / "map", "map"), "vmap": members_job(root / "vmap", "vmap", tracker="none")}
    for s in SEEDS:
        train(
            run_config(*CFG, f"seed={s}"),
            JobInfo(root / "separate" / f"seed{s}", name=f"seed={s}", overrides=[f"seed={s}"]),
        )
    return root, results


def test_members_under_map_are_their_separate_runs_bit_for_bit(trained):
    root, results = trained
    assert [r.status for r in results["map"]] == ["finished"] * 3
    for s in SEEDS:
        member, alone = root / "map" / f"seed{s}" / "run", root / "separate" / f"seed{s}" / "run"
        got, want = rows(member), rows(alone)
        assert got.keys() == want.keys()
        # every logged value: losses, norms, the validation loss, every sampling-evaluation metric
        assert {k: v for k, v in got.items() if v != want[k]} == {}
        assert any(k[1].startswith("eval/pareto/") for k in want) and any(k[1] == "eval/valid/loss" for k in want)
        a, b = params_at(member, 6), params_at(alone, 6)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        grid = "media/samples_grid_6.png"
        assert (member / grid).read_bytes() == (alone / grid).read_bytes()
        tables = sorted(p.relative_to(alone) for p in (alone / "tables").rglob("*") if p.is_file())
        assert tables  # the Pareto table, the prompt grids' table and its images
        assert all((member / p).read_bytes() == (alone / p).read_bytes() for p in tables)


def test_members_under_vmap_match_their_separate_runs_within_float32_rounding(trained):
    root, results = trained
    assert [r.status for r in results["vmap"]] == ["finished"] * 3
    for s in SEEDS:
        got, want = rows(root / "vmap" / f"seed{s}" / "run"), rows(root / "separate" / f"seed{s}" / "run")
        assert got.keys() == want.keys()
        for (step, key), v in want.items():
            if key in ("train/loss", "train/grad_norm", "train/param_norm", "eval/valid/loss"):
                assert got[step, key] == pytest.approx(v, rel=1e-5), (step, key)
            elif key.startswith("eval/caption_sensitivity/"):  # a difference of two NLLs: absolute
                assert got[step, key] == pytest.approx(v, abs=1e-4), (step, key)


def test_a_members_run_store_is_the_separate_runs_store(trained):
    root, _ = trained
    wandb_ids = set()
    for s in SEEDS:
        member, alone = root / "map" / f"seed{s}" / "run", root / "separate" / f"seed{s}" / "run"
        # the resolved config of `seed=k` itself: seeds unset, members and mesh.member at their defaults
        assert yaml.safe_load((member / "config.yaml").read_text()) == yaml.safe_load(
            (alone / "config.yaml").read_text()
        )
        m_meta, a_meta = (json.loads((p / "meta.json").read_text()) for p in (member, alone))
        assert m_meta["members"] == {"seeds": SEEDS, "index": s, "job_dir": str(root / "map"), "impl": "map"}
        assert m_meta.keys() - {"members"} == a_meta.keys() and m_meta["mesh"] == a_meta["mesh"]
        wandb_ids.add(m_meta["wandb_id"])
        m_sum, a_sum = (json.loads((p / "summary.json").read_text()) for p in (member, alone))
        assert m_sum.keys() == a_sum.keys() and m_sum["status"] == "finished" and m_sum["steps"] == 6
        # each member is charged a third of the job's step: its share, and the job's own step time beside it
        perf = [r for r in read_metrics(member) if "perf/step_time" in r]
        assert perf and all(r["perf/step_time"] == pytest.approx(r["perf/job_step_time"] / 3) for r in perf)
    assert len(wandb_ids) == 3  # a W&B run of its own each
    record = json.loads((root / "map" / "members.json").read_text())
    # where each member lives from the job's parent folder: the same on every host (issue 72)
    assert [(m["seed"], m["job_dir"], m["status"]) for m in record["members"]] == [
        (s, f"map/seed{s}", "finished") for s in SEEDS
    ]
    assert [member_folder(root / "map", m["job_dir"]) for m in record["members"]] == [
        root / "map" / f"seed{s}" for s in SEEDS
    ]
    # the report reads members as runs: one variant, its three seeds
    runs = load_runs(str(root / "map"))
    assert sorted(r.seed for r in runs) == SEEDS and len({r.variant for r in runs}) == 1


def test_a_member_that_diverges_is_frozen_and_ended_while_the_others_finish(trained, tmp_path, monkeypatch, capsys):
    root, _ = trained
    batches = program.MemberBatches.__next__
    drawn = []

    def poisoned(self):  # member 1's batch of step 4 has an infinite weight: its loss is not finite
        batch = batches(self)
        drawn.append(1)
        if len(drawn) == 4:
            batch["weights"] = batch["weights"].astype(np.float32)
            batch["weights"][1] = np.inf
        return batch

    monkeypatch.setattr(program.MemberBatches, "__next__", poisoned)
    capsys.readouterr()
    results = members_job(tmp_path, "map")
    assert [r.status for r in results] == ["finished", "diverged", "finished"]
    assert results[1].reason.startswith("diverged at step 4: train/loss=")
    # one step number for it everywhere, as its separate run: the reason's, the result's, the
    # summary's (run store and W&B) and the closing line's
    assert results[1].steps == json.loads((tmp_path / "seed1" / "run" / "summary.json").read_text())["steps"] == 4
    assert "\ndiverged at step 4 of 6 in " in "\n" + capsys.readouterr().out
    wandb_id = json.loads((tmp_path / "seed1" / "run" / "meta.json").read_text())["wandb_id"]
    run_file = next(Path(os.environ["WANDB_DIR"]).glob(f"wandb/offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))
    assert wandb_summary(run_file)["steps"] == 4
    assert results[1].reason.endswith(
        f"last finite loss {rows(tmp_path / 'seed1' / 'run')[3, 'train/loss']:.4f} at step 3"
    )
    diverged = tmp_path / "seed1" / "run"
    assert sorted(int(p.name) for p in (diverged / "checkpoints").iterdir() if p.name.isdigit()) == [3]
    logged = rows(diverged)
    assert max(step for step, _ in logged) == 4 and not math.isfinite(float(logged[4, "train/loss"]))
    assert json.loads((diverged / "summary.json").read_text())["status"] == "diverged"
    for s in (0, 2):  # the others: their separate runs still, bit for bit
        assert rows(tmp_path / f"seed{s}" / "run") == rows(root / "map" / f"seed{s}" / "run")
    record = json.loads((tmp_path / "members.json").read_text())
    assert [m["status"] for m in record["members"]] == ["finished", "diverged", "finished"]
    cfg = run_config("seeds=[0,1,2]")
    with pytest.raises(RunFailed) as err:
        outcome(cfg, JobInfo(tmp_path), results)
    assert err.value.exit_code == RunFailed.DIVERGED
    assert str(err.value) == f"member seed=1 {results[1].reason} (run store {diverged}); seeds 0, 2 finished"
    # resume=auto leaves every member as it ended, the diverged one too (not retrained to diverge again)
    monkeypatch.setattr(program.MemberBatches, "__next__", batches)
    before = {s: rows(tmp_path / f"seed{s}" / "run") for s in SEEDS}
    again = members_job(tmp_path, "map", "resume=auto")
    assert [(r.status, r.steps, r.reason) for r in again] == [(r.status, r.steps, r.reason) for r in results]
    assert {s: rows(tmp_path / f"seed{s}" / "run") for s in SEEDS} == before


def test_ctrl_c_saves_every_member_and_resume_continues_each_from_their_common_step(
    trained, tmp_path, monkeypatch, capsys
):
    root, _ = trained
    batches = program.MemberBatches.__next__
    drawn = []

    def interrupted(self):  # Ctrl-C while the batches of step 5 are read: every member has done 4
        drawn.append(1)
        if len(drawn) == 5:
            raise KeyboardInterrupt
        return batches(self)

    monkeypatch.setattr(program.MemberBatches, "__next__", interrupted)
    results = members_job(tmp_path, "map")
    assert [(r.status, r.steps) for r in results] == [("interrupted", 4)] * 3
    for s in SEEDS:  # step 4, logged after the Ctrl-C, without timing (the time since step 3 is no step's); 3 with it
        logged = [r for r in read_metrics(tmp_path / f"seed{s}" / "run") if "train/loss" in r]
        assert [r["step"] for r in logged if "perf/step_time" in r] == [2, 3] and logged[-1]["step"] == 4
    for s in SEEDS:
        saved = tmp_path / f"seed{s}" / "run" / "checkpoints"
        assert sorted(int(p.name) for p in saved.iterdir() if p.name.isdigit()) == [3, 4]
    cfg = run_config("seeds=[0,1,2]")
    job = JobInfo(tmp_path, overrides=["seeds=[0,1,2]", "trainer.steps=6"])
    with pytest.raises(Interrupted) as err:
        outcome(cfg, job, results)
    assert str(err.value) == (
        f"interrupted at step 4 of 6 (members seed=0, seed=1, seed=2); checkpoints saved; resume "
        f"with: python run.py 'seeds=[0,1,2]' trainer.steps=6 resume=auto hydra.run.dir={tmp_path}"
    )
    ids = [json.loads((tmp_path / f"seed{s}" / "run" / "meta.json").read_text())["wandb_id"] for s in SEEDS]
    # a kill -9 between the members' saves of step 4: member 0's never made it to disk
    shutil.rmtree(tmp_path / "seed0" / "run" / "checkpoints" / "4")
    monkeypatch.setattr(program.MemberBatches, "__next__", batches)
    capsys.readouterr()
    results = members_job(tmp_path, "map", "resume=auto")
    assert [r.status for r in results] == ["finished"] * 3
    assert (
        "members seed=1, seed=2 resume from step 3, the newest step every member has a checkpoint of"
        in capsys.readouterr().err
    )
    for s, wandb_id in zip(SEEDS, ids):
        store = tmp_path / f"seed{s}" / "run"
        assert rows(store) == rows(root / "map" / f"seed{s}" / "run")  # each step once, as if never stopped
        assert [r["step"] for r in read_metrics(store) if "train/loss" in r] == list(range(1, 7))
        assert json.loads((store / "meta.json").read_text())["wandb_id"] == wandb_id  # the same W&B run goes on


def test_shampoo_members_under_map_match_their_separate_runs_within_float32_rounding(tmp_path):
    # Its roots refreshed every 2 steps and used from step 2: the refresh's cond and eighs run in the
    # members' loop. Not bit for bit, unlike Adam's (XLA compiles the preconditioned update inside
    # the loop differently; seen: 1e-7 relative from the first preconditioned step).
    # merge_small_dims=0: the test model's small matrices stay matrices; merged into vectors they
    # would need 1024 x 1024 roots, ~10 s a step here and most of this test's 5 minutes.
    # skip_preconditioning_dim_size_gt=32: the matrices no side of which is longer than d_model keep
    # their roots (37 % of the parameter elements take the Shampoo direction at step 4), the others
    # are grafted only: both paths run in the members' loop, with fewer eighs to compile (~15 % of
    # this test's CPU time).
    shampoo = [
        "optim=shampoo",
        "optim.preconditioning_every=2",
        "optim.start_preconditioning_step=2",
        "optim.merge_small_dims=0",
        "optim.skip_preconditioning_dim_size_gt=32",
        "tracker=none",
        "trainer.steps=4",
        *AT_THE_LAST,
    ]
    cfg = run_config(*shampoo, "seeds=[0,1]", "members.impl=map")
    results = train_members(
        cfg, JobInfo(tmp_path / "members"), [JobInfo(tmp_path / "members" / f"seed{s}") for s in (0, 1)]
    )
    assert [r.status for r in results] == ["finished"] * 2
    for s in (0, 1):
        train(run_config(*shampoo, f"seed={s}"), JobInfo(tmp_path / "separate" / f"seed{s}"))
        got, want = rows(tmp_path / "members" / f"seed{s}" / "run"), rows(tmp_path / "separate" / f"seed{s}" / "run")
        assert any(k.startswith("optim/shampoo/") for _, k in want) and got.keys() == want.keys()
        for k, v in want.items():  # abs: root errors of ~1e-15; "nan"/"inf" are logged as text
            assert got[k] == (v if isinstance(v, str) else pytest.approx(v, rel=1e-5, abs=1e-9)), k


def test_kill_9_between_the_members_saves_then_resume_continues_every_member(trained, tmp_path):
    """`python run.py seeds=[0,1,2]` killed (SIGKILL) right after member 0's save of step 6 was
    handed to orbax: none has checkpoint 6, and a member's checkpoint 3 may be unfinished too.
    `resume=auto` continues all three from the step all of them have, each in its own store and
    W&B run, to the same numbers as the uninterrupted members (the fixture's); the resume is
    trained in this process."""
    root, _ = trained
    tests = Path(__file__).resolve().parents[1]
    job = tmp_path / "job"
    args = [*SMALL_DATA, *TINY_TRAIN, *CFG, "seeds=[0,1,2]", "members.impl=map", f"hydra.run.dir={job}"]
    env = {**os.environ, **AS_HERE}  # held bit for bit to the fixture's members, trained in this process
    env.update(KILL_AT="save:6", PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    proc = subprocess.run(
        [sys.executable, str(tests / "kill_worker.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    stores = [job / f"seed{s}" / "run" for s in SEEDS]
    ids = [json.loads((store / "meta.json").read_text())["wandb_id"] for store in stores]
    # member 0's step-6 write in flight; the others' step-3 writes complete or still in flight too
    # (each member's save is waited for at its next one): their newest complete steps differ or are none
    saved = [{int(p.name) for p in (store / "checkpoints").iterdir() if p.name.isdigit()} for store in stores]
    assert all(s <= {3} for s in saved[1:]) and 6 not in saved[0], saved
    # The resume in this process (the job `args` with resume=auto): no kill to take there, and a
    # child would pay its start-up and three W&B starts again.
    results = members_job(job, "map", "resume=auto")
    assert [r.status for r in results] == ["finished"] * 3
    for s, store, wandb_id in zip(SEEDS, stores, ids):
        assert rows(store) == rows(root / "map" / f"seed{s}" / "run"), s  # each step once, the uninterrupted values
        assert json.loads((store / "meta.json").read_text())["wandb_id"] == wandb_id
        assert json.loads((store / "summary.json").read_text())["status"] == "finished"


def test_adafactor_members_are_their_separate_runs(tmp_path):
    """Adafactor's factored moments as members: bit for bit under map, within 1e-5 under vmap."""
    adafactor = ["optim=adafactor", "tracker=none", "trainer.steps=4", *AT_THE_LAST]
    alone = {}
    for s in (0, 1):
        train(run_config(*adafactor, f"seed={s}"), JobInfo(tmp_path / "separate" / f"seed{s}"))
        alone[s] = rows(tmp_path / "separate" / f"seed{s}" / "run")
    for impl in ("map", "vmap"):
        cfg = run_config(*adafactor, "seeds=[0,1]", f"members.impl={impl}")
        train_members(cfg, JobInfo(tmp_path / impl), [JobInfo(tmp_path / impl / f"seed{s}") for s in (0, 1)])
        for s in (0, 1):
            got = rows(tmp_path / impl / f"seed{s}" / "run")
            assert got.keys() == alone[s].keys()
            if impl == "map":
                assert got == alone[s]
            else:  # "nan"/"inf" are logged as text
                for k, v in alone[s].items():
                    assert got[k] == (v if isinstance(v, str) else pytest.approx(v, rel=1e-5)), k
