"""The cluster launchers on real engines on this machine: a Ray cluster of two nodes on loopback
(ray.cluster_utils.Cluster: a head and a worker node, separate raylets), submitit's local executor
(`slurm_local`, the SLURM launcher's code path without a scheduler), each driving an Optuna sweep
of a tiny config whose every trial is one JAX run of two processes (a 2-device mesh, one device
each); a worker killed mid-trial fails that trial only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest

from conftest import ROOT, SMALL_DATA, TINY_TRAIN

ray = pytest.importorskip("ray", reason="the cluster extra: pip install -c constraints.txt -e '.[cluster]'")
pytest.importorskip("submitit", reason="the cluster extra: pip install -c constraints.txt -e '.[cluster]'")

pytestmark = pytest.mark.slow  # end-to-end sweeps
SWEEP = [
    *SMALL_DATA,
    *TINY_TRAIN,
    "schedule=constant",
    "hydra/sweeper=optuna",
    "optim.lr=interval(1e-4,1e-2)",
    "hydra.sweeper.sampler.seed=0",
    "hydra.sweeper.n_trials=2",  # one batch of n_jobs trials, each of two processes
    "hydra.sweeper.n_jobs=2",
    "mesh.data=2",
    # Two steps, one validation and one checkpoint (the last step's), one decoder layer: a trial's
    # value, run store, W&B run and 2-process mesh are all there, and a trial stays "running" through
    # its start-up and compiles, long enough to be killed mid-trial. Most of a trial's cost is its
    # processes' start-up, which these do not change (about 7 % less CPU for this file).
    "trainer.steps=2",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "model.decoder_layers=1",
]


def sweep(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", *SWEEP, *args, f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    one_device = {"XLA_FLAGS": ""}  # each process its own CPU device: the mesh spans the two processes
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**os.environ, **one_device, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stores(tmp_path: Path) -> dict[str, dict]:
    """Each run store's summary, by trial folder."""
    return {p.parent.parent.name: json.loads(p.read_text()) for p in (tmp_path / "multirun").glob("*/run/summary.json")}


def two_process_runs(tmp_path: Path) -> bool:
    """Every run store was written by process 0 of a 2-process run with one device per process."""
    devices = [json.loads(p.read_text())["device"] for p in (tmp_path / "multirun").glob("*/run/meta.json")]
    return bool(devices) and all((d["processes"], d["count"], d["local_count"]) == (2, 2, 1) for d in devices)


def wandb_groups(trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """The W&B group of each trial's run (its id recorded on the trial), read back from the offline
    run file; other tests' runs share WANDB_DIR."""
    from wandb_records import run_info

    files = {
        f.stem.removeprefix("run-"): f for f in Path(os.environ["WANDB_DIR"]).glob("wandb/offline-run-*/run-*.wandb")
    }
    return [run_info(files[t.user_attrs["wandb_id"]])["group"] for t in trials]


def worker_pids(title: str) -> list[int]:
    """Processes whose title Ray set to `ray::<task>` while they run that task."""
    out = subprocess.run(["pgrep", "-f", f"^{title}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    # Ray's CPUs are a count it schedules by, not cores: two trials of two processes fit at once.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)  # a second raylet: the trials of a batch run on two nodes
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def postgres_url() -> str:
    url = os.environ.get("DALLE_ABLATE_TEST_POSTGRES")
    if not url:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must provide a PostgreSQL server: .ci/run sets DALLE_ABLATE_TEST_POSTGRES from .ci/postgres.sh"
            )
        pytest.skip("no PostgreSQL server: set DALLE_ABLATE_TEST_POSTGRES (see .ci/postgres.sh)")
    return url


def test_a_ray_sweep_on_postgresql_runs_its_trials_and_a_killed_worker_fails_only_its_trial(tmp_path, ray_cluster):
    url, name = postgres_url(), f"ray-{uuid.uuid4().hex[:8]}"
    proc = sweep(
        tmp_path,
        "hydra/launcher=ray",
        "hydra.launcher.processes=2",
        "hydra.launcher.strategy=STRICT_SPREAD",
        f"hydra.sweeper.storage={url}",
        f"hydra.sweeper.study_name={name}",
        env={"RAY_ADDRESS": ray_cluster.address},
    )
    killed = None
    deadline = time.time() + 300
    while killed is None and proc.poll() is None and time.time() < deadline:
        running = [d for d, s in stores(tmp_path).items() if s.get("status") == "running"]
        pids = worker_pids("ray::run_one")
        if running and len(pids) == 2 * len(running):  # every trial under way has its run store: kill a process
            killed = pids[-1]  # of one, as a lost node would; the launcher stops its other process
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=600)
    assert killed is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    study = optuna.load_study(study_name=name, storage=url)
    states = sorted(t.state.name for t in study.trials)
    assert states == ["COMPLETE"] * 2 + ["FAIL"]  # the lost trial does not count: another ran in its place
    lost = next(t for t in study.trials if t.state.name == "FAIL")
    assert "was lost: " in lost.user_attrs["why"]
    done = stores(tmp_path)
    assert sorted(s["status"] for s in done.values()) == ["failed"] + ["finished"] * 2
    failed = next(s for s in done.values() if s["status"] == "failed")
    assert failed["reason"].startswith("killed: process ") and " was lost: " in failed["reason"]
    assert two_process_runs(tmp_path)
    assert not worker_pids("ray::run_one")  # no process of the lost trial left waiting for its partner
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert wandb_groups(complete) == [str(tmp_path / "multirun")] * 2  # a W&B run each, grouped by the sweep
    assert "Ray cluster: 4 CPUs on 2 nodes" in out
    optuna.delete_study(study_name=name, storage=url)


def test_a_slurm_local_sweep_on_sqlite_runs_two_trials_each_a_submitit_job_of_two_tasks(tmp_path):
    proc = sweep(
        tmp_path, "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10"
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    study = optuna.load_study(study_name="dalle-ablate", storage=f"sqlite:///{tmp_path / 'multirun' / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    assert sorted(s["status"] for s in stores(tmp_path).values()) == ["finished"] * 2
    assert wandb_groups(study.trials) == [str(tmp_path / "multirun")] * 2  # a W&B run each, grouped by the sweep
    # one submitit job (its own folder of logs and pickles) per trial, as on SLURM
    assert len([p for p in (tmp_path / "multirun" / ".submitit").iterdir() if p.name.isdigit()]) == 2
    assert all(Path(t.user_attrs["run_dir"]).is_dir() for t in study.trials)
    assert two_process_runs(tmp_path)
    for t in study.trials:  # the trial's value is process 0's: its run store's
        assert t.value == json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())["eval/valid/loss"]


def launch_error(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, str]:
    """(exit code, stderr) of a multirun of one job through a launcher that cannot start it."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "-m",
            *SMALL_DATA,
            *TINY_TRAIN,
            *args,
            f"hydra.sweep.dir={tmp_path / 'multirun'}",
        ],
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )  # a launcher that hung would fail here
    return proc.returncode, proc.stderr


def test_ray_at_an_address_nothing_answers_fails_at_once_in_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port of this machine that nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    assert launch_error(tmp_path, "hydra/launcher=ray", f"hydra.launcher.address={address}") == (
        4,
        f"error: hydra.launcher.address={address}: no Ray cluster can be reached there (ConnectionRefusedError: [Errno "
        "111] Connection refused); start one with `ray start --head`, or leave the address unset to start Ray on this "
        "machine\n",
    )


def test_slurm_without_slurm_and_a_zero_timeout_are_one_line(tmp_path):
    no_slurm = {"PATH": str(Path(sys.executable).parent)}  # python, and no srun
    assert launch_error(tmp_path, "hydra/launcher=slurm", env=no_slurm) == (
        4,
        "error: hydra/launcher=slurm needs SLURM, and this machine has no srun on its PATH: start the sweep on a SLURM "
        "login node, or run its jobs here with hydra/launcher=slurm_local\n",
    )
    assert launch_error(tmp_path, "hydra/launcher=slurm_local", "hydra.launcher.timeout_min=0") == (
        2,
        "error: hydra.launcher.timeout_min=0 must be > 0 (the minutes a job may run before it is stopped)\n",
    )
