"""Seeds as members of one job on a mesh (issue 40): a `member` mesh axis spreads the members over
devices, each member on its own group of devices with its run's data x fsdp x model mesh inside,
and every member trains as its separate run `seed=k` would. Fake CPU devices in subprocesses
(XLA_FLAGS must be set before jax starts), as test_parallel.py runs its meshes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

WORKER = str(Path(__file__).resolve().parents[1] / "members_worker.py")
# Four fake devices: four members show each on a device of its own as eight did, and each member
# fewer is one separate run, one initialisation and one checkpoint less (and four device threads
# fewer to share two cores).
DEVICES = 4
SEEDS = list(range(DEVICES))
# (a) every member on its own device; (b) members x data: each member's batch split over 2 devices.
# Two members in (b) are enough for it (each on its own group, their losses told apart); each member
# more is one more initialisation and checkpoint.
JOBS = {
    "a": ["seeds=[0,1,2,3]", "mesh.member=4", "mesh.data=1"],
    "b": ["seeds=[0,1]", "mesh.member=2", "mesh.data=2"],
}


def start(n_devices: int, out: Path, kind: str, jobs: dict) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n_devices}"}
    return subprocess.Popen(
        [sys.executable, WORKER, str(out), kind, json.dumps(jobs)],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :])


def separate_runs(out: Path, jobs: dict) -> dict:
    """What `members_worker.py OUT runs JOBS` prints, computed here: this process has the suite's one
    CPU device, which is what the separate runs train on; a child would add only its start-up (JAX's
    import and initialisation, ~2 s of CPU). members_worker's own function, so the runs cannot drift
    from it."""
    import jax

    from members_worker import run_separate

    return {"devices": jax.device_count(), "jobs": {name: run_separate(out, name, o) for name, o in jobs.items()}}


def logged(run_dir, key: str) -> list[tuple[int, float]]:
    from dalle_ablate.track.runstore import read_metrics

    return [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r]


@pytest.mark.slow
@pytest.mark.long
def test_members_on_a_member_mesh_axis_match_their_separate_runs(tmp_path, small_dataset):
    # small_dataset: the data cache, built here once for the references and the worker. The
    # references: each seed's separate run on one device, in this process. Members x data (b) is held
    # to the same one-device runs: a batch split over data changes only the order of float32 sums
    # (test_parallel.py holds a data-split run to one device at the same tolerance). The references
    # before the worker, not beside it: an 8-device worker, run beside another on two cores, was
    # seen to abort on a CPU collective's 40 s rendezvous timeout (one of 8 device threads never arriving).
    refs = separate_runs(tmp_path / "runs", {f"seed{k}": [f"seed={k}", "mesh.data=1"] for k in SEEDS})
    got = result(start(DEVICES, tmp_path / "members", "members", JOBS))
    assert refs["devices"] == 1 and got["devices"] == DEVICES
    assert {r["status"] for r in refs["jobs"].values()} == {"finished"}

    worst = {}
    for name, groups, data in (("a", 4, 1), ("b", 2, 2)):
        job = got["jobs"][name]
        n = len(job["status"])
        assert job["status"] == ["finished"] * n
        assert job["mesh"] == {"member": groups, "data": data, "fsdp": 1, "model": 1}
        # Spread over the devices: every parameter split on its member axis, each member on its own
        # group of `data` devices (replicated over data, its run's layout), no two members sharing
        # one; each member's batch on the same group.
        groups_of = [[g * data + j for j in range(data)] for g in range(groups)]
        for path, p in job["params"].items():
            assert p["spec"][0] == "member", (name, path, p["spec"])
            assert p["holders"] == groups_of, (name, path, p["holders"])
        assert job["batch"]["spec"][0] == "member" and job["batch"]["holders"] == groups_of, job["batch"]
        # Each member is its separate run: the same losses and gradient norms at every step, the
        # same validation loss, a checkpoint of its own.
        for k, run_dir, eval_loss in zip(SEEDS[:n], job["run_dirs"], job["eval_loss"]):
            ref = refs["jobs"][f"seed{k}"]
            assert Path(run_dir) == tmp_path / "members" / name / f"seed{k}" / "run"
            for key in ("train/loss", "train/grad_norm", "eval/valid/loss"):
                mine, theirs = logged(run_dir, key), logged(ref["run_dir"], key)
                assert [s for s, _ in mine] == [s for s, _ in theirs] == ([1, 2, 3] if key.startswith("train") else [3])
                assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=1e-5), (name, k, key)
                worst[name, key] = max(
                    [worst.get((name, key), 0.0)] + [abs(a - b) for (_, a), (_, b) in zip(mine, theirs)]
                )
            assert eval_loss == pytest.approx(ref["eval_loss"], abs=1e-5)
            assert (Path(run_dir) / "checkpoints" / "3").is_dir()
        # Not one member trained n times: the members' losses differ.
        assert len({logged(d, "train/loss")[-1][1] for d in job["run_dirs"]}) == n
    print("largest |member - separate run|:", {f"{n}/{k}": v for (n, k), v in worst.items()})
    # One member of a model-split stack keeps its run's split (not a whole copy on every device).
    assert got["slice"] == {"spec": [None, "model"], "shards": [[6, 4]], "equal": True}
