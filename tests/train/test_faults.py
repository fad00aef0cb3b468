"""Fault injection: a full disk, a read-only checkpoint folder, kill -9 mid-run and mid-checkpoint,
a diverged run, W&B online without a network. Each ends in one `error:` line and its exit code
(docs/guides/troubleshooting.md), the run store says how the run ended, and nothing written
before the fault is lost: `resume=auto` continues and reproduces the uninterrupted run.
Ctrl-C at every stage -- imports, the config, the tokenizer's fit, rendering the data, compiling,
training, saving, the evaluation, between a multirun's jobs -- ends in one line that is not an
error (what it stopped, what it kept, the command that continues) and exit 130."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, SMALL_DATA, TINY_TRAIN, run_config, run_py
from dalle_ablate.registry import RunFailed
from dalle_ablate.track.runstore import read_metrics
from dalle_ablate.train.logger import SCALARS
from wandb_records import history, run_info

# 6 steps, a checkpoint every 3 (~0.8 MB each); a constant rate, so that a run made longer (to be
# killed at leisure) takes the same first steps as the 6-step reference.
TINY = [*SMALL_DATA, *TINY_TRAIN, "schedule=constant"]


def job_dir(tmp_path: Path) -> Path:
    return tmp_path / "outputs" / "run"


def error_line(proc) -> str:
    """The one `error:` line of a failed run; no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def interrupt_line(stderr: str, word: str = "interrupted") -> str:
    """The one line a Ctrl-C (`word`: "terminated (SIGTERM)" for a SIGTERM) ends a process with:
    not an `error:` line, no traceback, and no KeyboardInterrupt that Python dropped ("Exception
    ignored in")."""
    lines = [line for line in stderr.splitlines() if line.startswith(word)]
    assert len(lines) == 1, stderr[-3000:]
    assert not any(bad in stderr for bad in ("error:", "Traceback", "Exception ignored", "Segmentation")), stderr[
        -3000:
    ]
    return lines[0]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r}


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def train_here(*args: str, job: Path):
    """`python run.py *args hydra.run.dir=<job>` for the tiny job, trained in this process: for
    the runs whose own process adds nothing to what a test checks (a resume after the fault under
    test: no signal, kill or exit code of its own). Its Result; a failure raises RunFailed."""
    from dalle_ablate.train.loop import JobInfo, train

    overrides = [a for a in args if a not in SMALL_DATA and not a.startswith("hydra.")]
    return train(run_config(*overrides), JobInfo(job))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every resumed one is compared with, step by step (trained in this
    process: the same numbers as a `run.py` child's, which compiles as this process does)."""
    tmp = tmp_path_factory.mktemp("reference")
    assert train_here(*TINY, "tracker=none", job=job_dir(tmp)).status == "finished"
    return job_dir(tmp) / "run"


@contextlib.contextmanager
def filesystem(path: Path, size: str, readonly: bool = False):
    """A small tmpfs at path (root only); yields False where mounting is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield False
        return
    opts = f"size={size}" + (",ro" if readonly else "")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_stops_the_run_at_that_save_in_one_line_and_resume_continues(tmp_path, reference, monkeypatch):
    ckpt = job_dir(tmp_path) / "run" / "checkpoints"
    expected = (
        f"checkpoint of step 6 could not be written to {ckpt} (ENOSPC: No space left on device); "
        f"checkpoints [3] are intact, resume=auto continues from step 3"
    )
    with filesystem(ckpt, "1200k") as mounted:  # room for one checkpoint, not two
        if mounted:
            proc = run_py(*TINY, "tracker=none", cwd=tmp_path)
            assert proc.returncode == RunFailed.FAILED
            assert error_line(proc) == f"error: {expected}"
        else:  # not root: the checkpoint writer raises what a full disk raises
            import orbax.checkpoint as ocp

            from dalle_ablate.train.loop import JobInfo, train

            real = ocp.CheckpointManager.save

            def save(self, step, *a, **kw):
                if step == 6:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real(self, step, *a, **kw)

            monkeypatch.setattr(ocp.CheckpointManager, "save", save)
            with pytest.raises(RunFailed) as err:
                train(run_config(*TINY[len(SMALL_DATA) :], "tracker=none"), JobInfo(job_dir(tmp_path)))
            assert str(err.value) == expected
            monkeypatch.undo()
        run = job_dir(tmp_path) / "run"
        assert summary(run)["status"] == "failed" and summary(run)["reason"] == f"RunFailed: {expected}"
        kept = losses(run)
        assert kept == {s: v for s, v in losses(reference).items() if s <= max(kept)}  # metrics intact
        assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["3"]
        if mounted:  # the disk gets room: the same files on a disk that is not full
            shutil.copytree(ckpt, tmp_path / "saved")
    if mounted:
        shutil.rmtree(ckpt)
        shutil.copytree(tmp_path / "saved", ckpt)
    spent = summary(run)["wall_time"]
    t0 = time.perf_counter()
    assert train_here(*TINY, "tracker=none", "resume=auto", job=job_dir(tmp_path)).status == "finished"
    assert json.loads((run / "meta.json").read_text())["resumed_from_step"] == 3
    assert losses(run) == losses(reference)
    assert spent < summary(run)["wall_time"] < spent + time.perf_counter() - t0  # both processes' time
    assert (
        summary(run)["status"] == "finished"
        and summary(run)["train/first_loss"] == summary(reference)["train/first_loss"]
    )


def test_a_failed_background_save_stops_the_run_at_the_next_step(tmp_path):
    """The checkpoint of step 6 fails in orbax's background write (a full disk) and the write has
    ended before step 7: the run stops there -- not at the next save -- with one line and exit 4,
    checkpoint 3 intact and the summary saying why."""
    ckpt = job_dir(tmp_path) / "run" / "checkpoints"
    with filesystem(ckpt, "1200k") as mounted:  # room for one checkpoint, not two
        if not mounted:
            pytest.skip("needs root to mount a small tmpfs (CI runs as root)")
        proc = killed(tmp_path, "settle:6", "tracker=none", "trainer.steps=30")
        assert proc.returncode == RunFailed.FAILED, proc.stderr[-3000:]
        expected = (
            f"checkpoint of step 6 could not be written to {ckpt} (ENOSPC: No space left on device); "
            f"checkpoints [3] are intact, resume=auto continues from step 3"
        )
        assert error_line(proc) == f"error: {expected}"
        run = job_dir(tmp_path) / "run"
        assert max(losses(run)) == 6  # no step after the failure was known
        assert (summary(run)["status"], summary(run)["reason"]) == ("failed", f"RunFailed: {expected}")
        assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["3"]


def test_a_read_only_checkpoint_folder_fails_before_the_first_step(tmp_path):
    ckpt = job_dir(tmp_path) / "run" / "checkpoints"
    with filesystem(ckpt, "1m", readonly=True) as mounted:
        if not mounted:
            ckpt.chmod(0o555)
        t0 = time.perf_counter()
        proc = run_py(*TINY, "tracker=none", cwd=tmp_path)
        elapsed = time.perf_counter() - t0
        assert proc.returncode == RunFailed.FAILED
        why = "Read-only file system" if mounted else "Permission denied"
        assert error_line(proc) == f"error: checkpoints cannot be written to {ckpt}: {why}"
        run = job_dir(tmp_path) / "run"
        assert summary(run)["status"] == "failed" and not losses(run)  # stopped before any step
        assert elapsed < 120  # never the 5-minute stall of orbax waiting on a folder it cannot write


def truncate_largest_file(folder: Path) -> Path:
    """Cut a checkpoint's largest file to a third (a copy or a disk that lost its end)."""
    biggest = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 3)
    return biggest


def test_a_checkpoint_that_cannot_be_restored_is_named_and_resume_falls_back_to_the_one_before(
    tmp_path, reference, capsys
):
    """Both checkpoints truncated: one line naming the newest, exit 4, nothing changed. Only the
    newest truncated: resume=auto says so, sets it aside, continues from the one before (the
    uninterrupted run's losses) and writes that step again."""
    shutil.copytree(reference.parent, job_dir(tmp_path))
    run = job_dir(tmp_path) / "run"
    ckpt = run / "checkpoints"
    intact = tmp_path / "intact3"
    shutil.copytree(ckpt / "3", intact)
    # Both cut in their metadata: the restore fails before any array read starts. (Cut in an array
    # file, TensorStore's other reads still in flight can print tracebacks under the line; see
    # checkpoint._quiet_stray_reads: not yet silenced in every case.)
    for step in ("6", "3"):
        os.truncate(ckpt / step / "default" / "_METADATA", (ckpt / step / "default" / "_METADATA").stat().st_size // 2)
    proc = run_py(*TINY, "tracker=none", "resume=auto", "trainer.steps=9", cwd=tmp_path)
    assert proc.returncode == RunFailed.FAILED
    line = error_line(proc)
    assert line.startswith(f"error: checkpoint {ckpt / '6'} cannot be restored (") and line.endswith(
        "); nor can any earlier one (3): remove the run folder to start over, or resume= another checkpoint"
    )
    assert "line 1 column" in line  # the JSON decoder's own words on where the file ends
    assert sorted(p.name for p in ckpt.iterdir()) == ["3", "6"]
    shutil.rmtree(ckpt / "3")
    shutil.copytree(intact, ckpt / "3")
    shutil.rmtree(ckpt / "6")
    shutil.copytree(reference / "checkpoints" / "6", ckpt / "6")
    truncate_largest_file(ckpt / "6")  # the newest cut in an array file: resume falls back past it
    capsys.readouterr()
    assert (
        train_here(*TINY, "tracker=none", "resume=auto", "trainer.steps=9", job=job_dir(tmp_path)).status == "finished"
    )
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and warning[0].startswith(f"warning: checkpoint {ckpt / '6'} cannot be restored (")
    assert warning[0].endswith("); resuming from step 3, the newest intact one")
    assert json.loads((run / "meta.json").read_text())["resumed_from_step"] == 3
    assert {s: v for s, v in losses(run).items() if s <= 6} == pytest.approx(losses(reference), rel=1e-6)
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 10))
    assert sorted(p.name for p in ckpt.iterdir()) == ["6", "6.unrestorable", "9"]


HOLD = """
import sys
from dalle_ablate.track.runstore import StoreLock
lock = StoreLock(sys.argv[1])
print("held", flush=True)
sys.stdin.read()  # until the test closes it (or kills this process)
"""


def test_a_second_writer_on_a_run_store_is_refused_in_one_line_naming_the_holder(tmp_path, reference):
    """While another process writes the store (here one that holds its lock and waits), a run on
    it is refused with exit 4 and nothing of the store touched; once the holder is gone -- killed
    with -9, so the lock dies with its process -- the same command runs."""
    shutil.copytree(reference.parent, job_dir(tmp_path))
    run = job_dir(tmp_path) / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline() == "held\n"
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".writer.lock"}
        proc = run_py(*TINY, "tracker=none", "resume=auto", "trainer.steps=9", cwd=tmp_path)
        assert proc.returncode == RunFailed.FAILED
        assert error_line(proc) == (
            f"error: run store {run} is being written by another process (pid {holder.pid} on "
            f"{socket.gethostname()}: -c {run}); wait for it to end or stop it, then run again "
            f"(one writer per run store)"
        )
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".writer.lock"} == before
    finally:
        holder.kill()
        holder.wait()
    assert (
        train_here(*TINY, "tracker=none", "resume=auto", "trainer.steps=9", job=job_dir(tmp_path)).status == "finished"
    )
    assert summary(run)["steps"] == 9 and summary(run)["status"] == "finished"


def lock_free(run: Path) -> bool:
    from dalle_ablate.track.runstore import StoreLock

    try:
        StoreLock(run).release()
        return True
    except RunFailed:
        return False


def test_kill_9_of_the_study_process_ends_its_multirun_too(tmp_path):
    """`dalle-ablate study` killed with -9 while its multirun trains: the multirun's process dies
    with it (its run store's lock is free for the next writer), not training on beside a rerun."""
    cmd = [
        sys.executable,
        "-m",
        "dalle_ablate.cli",
        "study",
        "mega-variants",
        "--out",
        str(tmp_path / "studies"),
        "--report-out",
        str(tmp_path / "reports"),
        "--page-out",
        str(tmp_path / "results"),
        "+arm=baseline",
        "seed=0",
        *SMALL_DATA,
        *TINY_TRAIN,
        "trainer.steps=100000",
        "tracker=none",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "studies" / "mega-variants" / "baseline-seed0" / "run"
    with open(tmp_path / "study.log", "w") as log:
        study = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):  # until its multirun trains (a run store with metrics)
                if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text():
                    break
                assert study.poll() is None, (tmp_path / "study.log").read_text()[-3000:]
                time.sleep(0.5)
            assert not lock_free(run)  # the multirun holds it
            study.kill()
            study.wait()
        finally:
            study.kill()
    for _ in range(120):  # the kernel kills the child at once; give it time to be reaped
        if lock_free(run):
            break
        time.sleep(0.5)
    assert lock_free(run), "the multirun outlived the study process"


def test_a_run_store_unwritable_from_the_start_is_one_line(tmp_path):
    """The run store's folder is immutable (root) or mode 555 before the run: refused at once
    in one line naming it, exit 4, no traceback."""
    run = job_dir(tmp_path) / "run"
    run.mkdir(parents=True)
    lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else (["chmod", "555"], ["chmod", "755"])
    subprocess.run([*lock, str(run)], check=True)
    try:
        proc = run_py(*TINY, "tracker=none", cwd=tmp_path)
    finally:
        subprocess.run([*unlock, str(run)], check=True)
    assert proc.returncode == RunFailed.FAILED
    why = "EPERM: Operation not permitted" if os.geteuid() == 0 else "EACCES: Permission denied"
    assert error_line(proc) == (
        f"error: run store {run} cannot be written (.writer.lock): {why}; free space or fix the folder, "
        "then resume=auto"
    )
    assert list(run.iterdir()) == []


def killed(
    tmp_path: Path, at: str, *overrides: str, sig: str = "SIGKILL", env: dict = {}
) -> subprocess.CompletedProcess:  # noqa: B006
    """Run the tiny job until it sends itself `sig` at `at` (tests/kill_worker.py)."""
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "kill_worker.py"),
        *TINY,
        *overrides,
        f"hydra.run.dir={job_dir(tmp_path)}",
    ]
    env = {
        **os.environ,
        "KILL_AT": at,
        "KILL_SIGNAL": sig,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        **env,
    }
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("folder", ["run/checkpoints", "run"])
def test_a_folder_made_unwritable_mid_run_stops_it_at_once_in_one_line(tmp_path, folder):
    """After checkpoint 3, the checkpoints folder (or the run store itself) becomes unwritable:
    immutable (`chattr +i`) as root, mode 555 otherwise. The run stops at its next write with
    one line and exit 4 -- no traceback, no "coroutine was never awaited", and no wait for
    orbax's threads (they once held the exit for 330 s; the 300 s limit of the run fails that)."""
    run = job_dir(tmp_path) / "run"
    target = job_dir(tmp_path) / folder
    lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else (["chmod", "555"], ["chmod", "755"])
    try:
        proc = killed(
            tmp_path,
            "shell:3",
            "tracker=none",
            "trainer.steps=30",
            env={"AFTER_SAVE": shlex.join([*lock, str(target)])},
        )
    finally:
        subprocess.run([*unlock, str(target)], check=True)
    assert proc.returncode == RunFailed.FAILED, proc.stderr[-3000:]
    why = "EPERM: Operation not permitted" if os.geteuid() == 0 else "EACCES: Permission denied"
    ckpt = run / "checkpoints"
    if folder == "run/checkpoints":
        expected = (
            f"checkpoint of step 6 could not be written to {ckpt} ({why}); "
            f"checkpoints [3] are intact, resume=auto continues from step 3"
        )
        assert (summary(run)["status"], summary(run)["reason"]) == ("failed", f"RunFailed: {expected}")
    else:
        expected = (
            f"run store {run} cannot be written (summary.json): {why}; free space or fix the folder, then resume=auto"
        )
        assert summary(run)["status"] == "running"  # what it said before the folder became unwritable
    assert error_line(proc) == f"error: {expected}"
    assert "was never awaited" not in proc.stderr
    # the next write: checkpoint 6, or the summary written right after checkpoint 3
    assert max(losses(run)) == (6 if folder == "run/checkpoints" else 3)
    assert "3" in [p.name for p in ckpt.iterdir()]


def test_a_run_store_made_unwritable_between_checkpoints_is_noticed_within_seconds(tmp_path):
    """The run store becomes unwritable (immutable as root, mode 555 otherwise) after step 3 of a
    run whose next checkpoint is its last step, 20000 steps on: appending to metrics.jsonl (a file
    already open) still works there, and the run stops at summary.json's next write, seconds
    later -- long before that checkpoint -- in one line, exit 4."""
    run = job_dir(tmp_path) / "run"
    lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else (["chmod", "555"], ["chmod", "755"])
    try:
        proc = killed(
            tmp_path,
            "shell_step:4",
            "tracker=none",
            "trainer.steps=20000",
            "trainer.save_every=20000",
            "trainer.eval_every=20000",
            env={"AFTER_SAVE": shlex.join([*lock, str(run)])},
        )
    finally:
        subprocess.run([*unlock, str(run)], check=True)
    assert proc.returncode == RunFailed.FAILED, proc.stderr[-3000:]
    why = "EPERM: Operation not permitted" if os.geteuid() == 0 else "EACCES: Permission denied"
    assert error_line(proc) == (
        f"error: run store {run} cannot be written (summary.json): {why}; free space or fix the "
        "folder, then resume=auto"
    )
    assert "was never awaited" not in proc.stderr and "Logging error" not in proc.stderr
    assert 3 < max(losses(run)) < 20000


def test_a_job_folder_read_only_from_the_start_fails_in_one_line_before_anything_is_built(tmp_path):
    """Hydra writes the job's log and config into its folder before the job starts: a folder it
    cannot write is one line naming it, exit 4 -- not Hydra's traceback."""
    job = job_dir(tmp_path)
    job.mkdir(parents=True)
    lock, unlock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else (["chmod", "555"], ["chmod", "755"])
    subprocess.run([*lock, str(job)], check=True)
    try:
        proc = run_py(*TINY, "tracker=none", cwd=tmp_path)
    finally:
        subprocess.run([*unlock, str(job)], check=True)
    assert proc.returncode == RunFailed.FAILED, proc.stderr[-3000:]
    why = "EPERM: Operation not permitted" if os.geteuid() == 0 else "EACCES: Permission denied"
    assert error_line(proc) == (
        f"error: folder {job} cannot be written (run.log: {why}); fix it, or, for the job's own "
        "folder, choose another with hydra.run.dir= (hydra.sweep.dir= for a multirun)"
    )
    assert proc.stderr.count("\n") == 1 and list(job.iterdir()) == []


def test_kill_9_mid_run_and_mid_checkpoint_then_resume_matches_step_by_step_one_wandb_run(tmp_path, reference, capsys):
    """Killed before step 5 (checkpoint 3 written), resumed and killed again while checkpoint 6
    is being written (and in the middle of a metrics line), resumed to the end: the same losses
    as the uninterrupted run, each step once in the run store, one W&B run with every step
    logged once over its processes' run files -- the steps a killed process had not flushed to
    W&B included, sent again from metrics.jsonl."""
    before = set(new_wandb_runs(set()))
    run = job_dir(tmp_path) / "run"
    assert killed(tmp_path, "step:5").returncode == -signal.SIGKILL
    first_id = json.loads((run / "meta.json").read_text())["wandb_id"]
    assert (run / "checkpoints" / "3").is_dir() and max(losses(run)) < 5
    assert killed(tmp_path, "save:6", "resume=auto").returncode == -signal.SIGKILL
    assert max(losses(run)) == 6
    with open(run / "metrics.jsonl", "a") as f:  # what a kill in the middle of a write leaves
        f.write('{"step": 7, "train/lo')
    torn = (run / "metrics.jsonl").read_text().count("\n") + 1
    capsys.readouterr()
    assert train_here(*TINY, "resume=auto", job=job_dir(tmp_path)).status == "finished"  # in this process
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert (
        f"{run / 'metrics.jsonl'}: its last line (line {torn}) was cut off mid-write; dropped it and resuming" in stderr
    )
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 7))
    for key in ("train/first_loss", "train/loss", "eval/valid/loss"):
        assert summary(run)[key] == pytest.approx(summary(reference)[key], rel=1e-6), key
    assert json.loads((run / "meta.json").read_text())["wandb_id"] == first_id
    # W&B: all three processes logged to the same run (offline folders end in the run id).
    runs = new_wandb_runs(before)
    assert len(runs) == 3 and {d.name.rsplit("-", 1)[1] for d in runs} == {first_id}
    assert run_info(next(runs[-1].glob("run-*.wandb")))["id"] == first_id
    files = [next(d.glob("run-*.wandb")) for d in runs]
    sent = [row["_step"] for f in files for row in history(f) if "train/loss" in row]
    assert sent == list(range(1, 7))  # each step once, in order, whatever each killed process had flushed
    rows = {row["_step"]: row["train/loss"] for f in files for row in history(f) if "train/loss" in row}
    assert rows == pytest.approx(losses(reference), rel=1e-6)
    evals = [row["_step"] for f in files for row in history(f) if "eval/valid/loss" in row]
    assert evals == [3, 6]


@pytest.fixture(scope="module")
def killed_in_the_first_save(tmp_path_factory, reference) -> SimpleNamespace:
    """A W&B-tracked run (group g42) killed while its first checkpoint (step 3) is being written,
    then resumed with resume=auto to its end: what each of its processes left, for the two tests
    that read it -- the kill and resume (test_kill_9_during_the_first_save_...) and `dalle-ablate
    eval` of the finished run (test_eval_of_a_checkpoint_..., on a copy): one W&B-tracked training
    for both (each child here is ~6 s of start-up, W&B's included, whatever it trains). After
    `reference`, which fits the data's tokenizer (a stage of its own, with a W&B run of its own
    where W&B is on): the W&B runs here are this run's alone."""
    tmp = tmp_path_factory.mktemp("first-save")
    before = set(new_wandb_runs(set()))
    run = job_dir(tmp) / "run"
    out = SimpleNamespace(job=job_dir(tmp), run=run)
    out.killed = killed(tmp, "save:3", "tracker.wandb.group=g42")
    out.saved_after_kill = [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    out.first_id = json.loads((run / "meta.json").read_text())["wandb_id"]
    out.resumed = run_py(*TINY, "tracker.wandb.group=g42", "resume=auto", cwd=tmp)
    out.wandb_runs = new_wandb_runs(before)
    return out


def test_kill_9_during_the_first_save_then_resume_starts_again_in_the_same_wandb_run(
    killed_in_the_first_save, reference
):
    """Killed while the first checkpoint (step 3) is being written: no complete checkpoint, so
    resume=auto starts again from step 0 -- in the same run store and W&B run, each step once."""
    k = killed_in_the_first_save
    run, first_id, proc = k.run, k.first_id, k.resumed
    assert k.killed.returncode == -signal.SIGKILL
    assert not k.saved_after_kill  # the first save was cut off
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["wandb_id"] == first_id and meta["resumed_from_step"] == 0
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 7))
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)
    runs = k.wandb_runs
    assert len(runs) == 2 and {d.name.rsplit("-", 1)[1] for d in runs} == {first_id}
    assert [row["_step"] for d in runs for row in history(next(d.glob("run-*.wandb"))) if "train/loss" in row] == list(
        range(1, 7)
    )


def test_ctrl_c_saves_the_last_step_says_how_to_resume_in_one_line_and_exits_130(tmp_path, reference):
    """SIGINT before step 5 (the last checkpoint was step 3): step 4 is saved, the summary is
    whole, and the command the line gives continues to the uninterrupted run's losses."""
    run = job_dir(tmp_path) / "run"
    proc = killed(tmp_path, "step:5", "tracker=none", sig="SIGINT")
    assert proc.returncode == 130, proc.stderr[-3000:]
    line = interrupt_line(proc.stderr)
    head = "interrupted at step 4 of 6; checkpoint saved; resume with: python run.py "
    assert line.startswith(head), line
    again = shlex.split(line.removeprefix(head))
    assert again == [*TINY, "tracker=none", "resume=auto", f"hydra.run.dir={job_dir(tmp_path)}"]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [3, 4]
    s = summary(run)
    assert (s["status"], s["steps"], s["reason"]) == ("interrupted", 4, "interrupted at step 4 of 6")
    assert s["train/loss"] == pytest.approx(losses(reference)[4], rel=1e-6)
    assert s["train/first_loss"] == pytest.approx(losses(reference)[1], rel=1e-6)
    assert train_here(*again, job=job_dir(tmp_path)).status == "finished"  # the command given, in this process
    assert json.loads((run / "meta.json").read_text())["resumed_from_step"] == 4
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 7))


def new_wandb_runs(before: set) -> list[Path]:
    """The offline W&B run folders made since `before`, oldest first."""
    return sorted(set(Path(os.environ["WANDB_DIR"]).glob("wandb/offline-run-*")) - before)


def wandb_steps(runs: list[Path], key: str = "train/loss") -> list[int]:
    """The steps that logged `key`, over the offline runs in order, each run's rows as W&B's
    server keeps them on a sync: a resumed run's rows below the step it reached are dropped."""
    out: list[int] = []
    for folder in runs:
        for row in history(next(folder.glob("run-*.wandb"))):
            if key in row and (not out or row["_step"] > out[-1]):
                out.append(row["_step"])
    return out


def test_ctrl_c_in_the_fetch_of_a_step_loses_neither_it_nor_the_step_after_it(tmp_path, reference):
    """SIGINT while step 4's metrics are fetched (step 5 trained and queued behind it): both
    reach metrics.jsonl and the W&B run once each, and step 5 is the checkpoint saved. Step 5,
    logged after the Ctrl-C, has no timing: the time since step 4 is no step's time."""
    before = set(new_wandb_runs(set()))
    run = job_dir(tmp_path) / "run"
    proc = killed(tmp_path, "fetch:4", sig="SIGINT")
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert interrupt_line(proc.stderr).startswith("interrupted at step 5 of 6; checkpoint saved; resume with: ")
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == [1, 2, 3, 4, 5]
    timed = [r["step"] for r in read_metrics(run) if "perf/step_time" in r]
    assert timed == [2, 3, 4] and not any(k.startswith("perf/") for k in read_metrics(run)[-1])
    assert losses(run) == pytest.approx({s: v for s, v in losses(reference).items() if s <= 5}, rel=1e-6)
    assert summary(run)["train/loss"] == pytest.approx(losses(reference)[5], rel=1e-6)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [3, 5]
    runs = new_wandb_runs(before)
    assert len(runs) == 1
    assert [row["_step"] for row in history(next(runs[0].glob("run-*.wandb"))) if "train/loss" in row] == [
        1,
        2,
        3,
        4,
        5,
    ]


# Ctrl-C at each stage before and around the steps, sent by the process itself at that point
# (tests/kill_worker.py): (KILL_AT, the line's head up to "resume with: ").
STAGES = [
    ("compose:1", "interrupted while starting; no step trained; "),
    # in a garbage-collection callback, where Python drops the KeyboardInterrupt it raises: the run
    # trained on to the end (issue 54); three iterations of the fit, three tries
    *(
        (f"fit:{n}", "interrupted while fitting the image tokenizer (data.tokenizer=kmeans); no step trained; ")
        for n in (2, 5, 9)
    ),
    ("render:10", "interrupted while rendering the data; no step trained; "),
    ("compile:1", "interrupted at step 1 of 6; checkpoint saved; "),
    ("save:3", "interrupted at step 3 of 6; checkpoint saved; "),
]


@pytest.mark.parametrize("at, head", STAGES, ids=[s[0] for s in STAGES])
def test_ctrl_c_at_each_stage_is_one_line_saying_what_it_stopped_and_how_to_resume_and_exit_130(tmp_path, at, head):
    """Nothing left to chance: the line, exit 130 (not 139), what the run store says. The tokenizer
    and the data are not cached yet (a cache of the test's own), so the run fits and renders them."""
    env = {"DALLE_ABLATE_CACHE": str(tmp_path / "cache")} if at.startswith(("fit", "render")) else {}
    proc = killed(tmp_path, at, "tracker=none", sig="SIGINT", env=env)
    assert proc.returncode == 130, proc.stderr[-3000:]
    line = interrupt_line(proc.stderr)
    assert line.startswith(f"{head}resume with: python run.py "), line
    again = shlex.split(line.removeprefix(f"{head}resume with: python run.py "))
    assert again == [*TINY, "tracker=none", "resume=auto", f"hydra.run.dir={job_dir(tmp_path)}"]
    run = job_dir(tmp_path) / "run"
    if at.startswith(("fit", "render")):  # stage 1's own run store says so, and why; no run store of the steps yet
        s = summary(job_dir(tmp_path) / "tokenizer")
        assert (s["status"], s["reason"]) == ("interrupted", head.split("; ")[0]) and not run.exists()
    if at == "compile:1":  # step 1 saved, logged without timing; no validation yet: no eval loss, not NaN
        s = summary(run)
        assert (s["status"], s["steps"], "eval/valid/loss" in s) == ("interrupted", 1, False)
        assert "interrupted at step 1 of 6 in " in proc.stdout and ", eval/valid/loss not measured yet" in proc.stdout
        assert [sorted(r) for r in read_metrics(run)] == [sorted(["samples", "step", "tokens", *SCALARS])]
    if at.startswith(("compile", "save")):
        step = int(at.split(":")[1])
        assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [step]


def test_ctrl_c_while_python_imports_is_taken_once_they_have(tmp_path):
    """SIGINT while `python run.py` imports jax (Python's own import-time log says so): the
    imports finish, then the run stops before anything is composed or built: one line, exit 130
    -- not a traceback out of the middle of an import."""
    # SIGINT back to its default (a background shell's children start with it ignored) by an exec
    # wrapper, not preexec_fn: this module's in-process runs leave JAX threads that a fork could
    # copy mid-lock.
    cmd = [
        sys.executable,
        "-c",
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])",
        sys.executable,
        "-X",
        "importtime",
        str(ROOT / "run.py"),
        *TINY,
        "tracker=none",
        f"hydra.run.dir={job_dir(tmp_path)}",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:
            if line.rstrip().split("|")[-1].strip() == "jax":  # jax's import ended; the rest of the imports go on
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    err = "\n".join(line for line in err.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 130, err[-3000:]
    assert interrupt_line(err) == "interrupted while starting; no step trained; run the same command again"
    assert not job_dir(tmp_path).exists()


def test_ctrl_c_between_the_jobs_of_a_multirun_gives_the_command_that_continues_all_of_it(tmp_path):
    """SIGINT as job 1 of `-m seed=0,1` is about to start: one line whose command continues the
    multirun -- job 1, never started, included -- and that command leaves job 0 as it finished and
    trains job 1."""
    sweep = tmp_path / "multirun"
    args = ["-m", *TINY, "tracker=none", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    env = {
        **os.environ,
        "KILL_AT": "job:2",
        "KILL_SIGNAL": "SIGINT",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kill_worker.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    head = "interrupted before job 1 of the multirun started; no step trained; resume with: python run.py "
    line = interrupt_line(proc.stderr)
    assert line.startswith(head), line
    again = shlex.split(line.removeprefix(head))
    assert again == [*args[:-1], "resume=auto", f"hydra.sweep.dir={sweep}"]
    assert summary(sweep / "0" / "run")["status"] == "finished" and not (sweep / "1" / "run").exists()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *again], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{sweep / '0' / 'run'}: finished before at step 6 of 6; left as it is (resume=auto)" in proc.stdout
    assert summary(sweep / "1" / "run")["status"] == "finished"


@pytest.mark.slow
def test_ctrl_c_during_the_final_evaluation_then_resume_runs_it(tmp_path, capsys):
    """SIGINT while the last step's sampling evaluation draws its Pareto plot: exit 130 with the
    resume line (no traceback from the plot); the evaluation is not recorded as done, and the
    resume runs it before it says finished (its table, and its headline in the closing lines)."""
    run = job_dir(tmp_path) / "run"
    # One guidance scale: the Pareto plot is drawn for any number of them, and each scale is a
    # sampling pass of its own in both processes (~1.5 s of CPU each).
    proc = killed(tmp_path, "plot:6", "tracker=none", "eval.metrics=[shapes]", "eval.guidance_scales=[1]", sig="SIGINT")
    assert proc.returncode == 130, proc.stderr[-3000:]
    line = interrupt_line(proc.stderr)
    assert line.startswith(
        "interrupted at step 6 of 6, during the sampling evaluation; checkpoint saved; resume with: python run.py "
    )
    assert summary(run)["status"] == "interrupted" and "evaluated_step" not in summary(run)
    again = shlex.split(line.split("resume with: python run.py ", 1)[1])
    capsys.readouterr()
    assert train_here(*again, job=job_dir(tmp_path)).status == "finished"  # the command given, in this process
    stdout = capsys.readouterr().out
    assert (run / "tables" / "eval_pareto_6.json").exists() and (run / "media" / "eval_pareto_plot_6.png").exists()
    assert summary(run)["status"] == "finished" and summary(run)["evaluated_step"] == 6
    closing = stdout[stdout.index("finished at step 6 of 6") :].splitlines()
    assert closing[1].startswith("  shapes/all (n=8 per scale): s1 ")
    assert [r["step"] for r in read_metrics(run) if "train/loss" in r] == list(range(1, 7))


TERM = "terminated (SIGTERM)"  # what a SIGTERM's line and summary say where a Ctrl-C's say "interrupted"


def saved_steps(run: Path) -> list[int]:
    return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def test_sigterm_saves_the_last_step_says_terminated_and_how_to_resume_and_exits_143(tmp_path, reference):
    """SIGTERM (a scheduler's preemption notice) before step 5: handled as Ctrl-C is -- step 4
    saved, the run `interrupted` with the reason saying SIGTERM, the lock released, one line with
    the command that continues -- and exit 143; that command continues to the uninterrupted losses."""
    run = job_dir(tmp_path) / "run"
    proc = killed(tmp_path, "step:5", "tracker=none", sig="SIGTERM")
    assert proc.returncode == 143, proc.stderr[-3000:]
    head = f"{TERM} at step 4 of 6; checkpoint saved; resume with: python run.py "
    line = interrupt_line(proc.stderr, TERM)
    assert line.startswith(head), line
    again = shlex.split(line.removeprefix(head))
    assert again == [*TINY, "tracker=none", "resume=auto", f"hydra.run.dir={job_dir(tmp_path)}"]
    assert f"{TERM} at step 4 of 6 in " in proc.stdout
    assert saved_steps(run) == [3, 4]
    s = summary(run)
    assert (s["status"], s["steps"], s["reason"]) == ("interrupted", 4, f"{TERM} at step 4 of 6")
    assert s["train/loss"] == pytest.approx(losses(reference)[4], rel=1e-6)
    assert lock_free(run)
    assert train_here(*again, job=job_dir(tmp_path)).status == "finished"  # the command given, in this process
    assert json.loads((run / "meta.json").read_text())["resumed_from_step"] == 4
    assert losses(run) == pytest.approx(losses(reference), rel=1e-6)


SIGTERM_STAGES = [
    # the tokenizer's fit (a cache of the test's own: the run fits it), from inside a gc callback
    ("fit:2", (), f"{TERM} while fitting the image tokenizer (data.tokenizer=kmeans); no step trained; "),
    # the last step's sampling evaluation, half way through its Pareto plot
    (
        "plot:6",
        ("eval.metrics=[shapes]", "eval.guidance_scales=[1]"),  # one scale: its plot is drawn all the same
        f"{TERM} at step 6 of 6, during the sampling evaluation; checkpoint saved; ",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("at, overrides, head", SIGTERM_STAGES, ids=[s[0] for s in SIGTERM_STAGES])
def test_sigterm_during_the_tokenizer_fit_or_the_final_evaluation_ends_as_ctrl_c_does(tmp_path, at, overrides, head):
    """SIGTERM while stage 1 fits the image tokenizer, or while the final evaluation draws: the
    line Ctrl-C gives there, saying SIGTERM, and exit 143; the stage's run store says interrupted
    (the final evaluation's: not recorded as done, a resume runs it)."""
    env = {"DALLE_ABLATE_CACHE": str(tmp_path / "cache")} if at.startswith("fit") else {}
    proc = killed(tmp_path, at, "tracker=none", *overrides, sig="SIGTERM", env=env)
    assert proc.returncode == 143, proc.stderr[-3000:]
    line = interrupt_line(proc.stderr, TERM)
    assert line.startswith(f"{head}resume with: python run.py "), line
    again = shlex.split(line.removeprefix(f"{head}resume with: python run.py "))
    assert again == [*TINY, "tracker=none", *overrides, "resume=auto", f"hydra.run.dir={job_dir(tmp_path)}"]
    run = job_dir(tmp_path) / "run"
    if at.startswith("fit"):
        s = summary(job_dir(tmp_path) / "tokenizer")
        assert (s["status"], s["reason"]) == ("interrupted", head.split("; ")[0]) and not run.exists()
    else:
        s = summary(run)
        assert (s["status"], s["reason"], "evaluated_step" in s) == (
            "interrupted",
            f"{TERM} at step 6 of 6, during the sampling evaluation",
            False,
        )
        assert saved_steps(run) == [3, 6] and lock_free(run)


def test_sigterm_to_a_members_job_saves_every_member_at_the_same_step(tmp_path):
    """`seeds=[0,1]` gets SIGTERM before step 5 (the kill worker counts each member's checkpoint
    check: the 9th is step 5's first): each member saves step 4 in its own store, says SIGTERM,
    and the job's one line names both members and the command that continues the job; exit 143."""
    job = job_dir(tmp_path)
    proc = killed(tmp_path, "step:9", "tracker=none", "seeds=[0,1]", sig="SIGTERM")
    assert proc.returncode == 143, proc.stderr[-3000:]
    head = f"{TERM} at step 4 of 6 (members seed=0, seed=1); checkpoints saved; resume with: python run.py "
    line = interrupt_line(proc.stderr, TERM)
    assert line.startswith(head), line
    assert shlex.split(line.removeprefix(head)) == [
        *TINY,
        "tracker=none",
        "seeds=[0,1]",
        "resume=auto",
        f"hydra.run.dir={job}",
    ]
    for seed in (0, 1):
        run = job / f"seed{seed}" / "run"
        s = summary(run)
        assert (s["status"], s["steps"], s["reason"]) == ("interrupted", 4, f"{TERM} at step 4 of 6"), seed
        assert saved_steps(run) == [3, 4] and lock_free(run), seed
    assert [m["status"] for m in json.loads((job / "members.json").read_text())["members"]] == ["interrupted"] * 2


def test_sigterm_in_a_multirun_stops_it_with_the_command_that_continues_all_of_it(tmp_path):
    """`-m seed=0,1` gets SIGTERM before job 0's step 5: job 0 saves step 4, job 1 never starts,
    and the one line (exit 143) gives the command that continues the whole multirun."""
    sweep = tmp_path / "multirun"
    args = ["-m", *TINY, "tracker=none", "seed=0,1", f"hydra.sweep.dir={sweep}"]
    env = {
        **os.environ,
        "KILL_AT": "step:5",
        "KILL_SIGNAL": "SIGTERM",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kill_worker.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    head = f"{TERM} at step 4 of 6; checkpoint saved; resume with: python run.py "
    line = interrupt_line(proc.stderr, TERM)
    assert line.startswith(head), line
    assert shlex.split(line.removeprefix(head)) == [*args[:-1], "resume=auto", f"hydra.sweep.dir={sweep}"]
    s = summary(sweep / "0" / "run")
    assert (s["status"], s["reason"]) == ("interrupted", f"{TERM} at step 4 of 6")
    assert saved_steps(sweep / "0" / "run") == [3, 4] and not (sweep / "1").exists()


@pytest.mark.slow
def test_eval_of_a_checkpoint_logs_a_wandb_run_of_its_own_in_the_training_runs_group(
    tmp_path, killed_in_the_first_save
):
    """`dalle-ablate eval` on a W&B-tracked run: a new W&B run (job type eval) in the training
    run's group; the training run's id, meta.json and W&B files are left alone. The training run:
    the module's W&B-tracked run of group g42 (killed once, resumed to its end: its W&B run in two
    processes' files), copied here."""
    trained_run = killed_in_the_first_save
    assert trained_run.resumed.returncode == 0, trained_run.resumed.stderr[-3000:]
    shutil.copytree(trained_run.job, job_dir(tmp_path))
    run = job_dir(tmp_path) / "run"
    meta = (run / "meta.json").read_text()
    trained_id = json.loads(meta)["wandb_id"]
    trained = [d for d in trained_run.wandb_runs if d.name.endswith(trained_id)]
    assert trained
    before = set(new_wandb_runs(set()))
    trained_bytes = [next(d.glob("run-*.wandb")).read_bytes() for d in trained]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dalle_ablate.cli",
            "eval",
            str(job_dir(tmp_path)),
            "eval.metrics=[caption_sensitivity]",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (ev,) = new_wandb_runs(before)
    info = run_info(next(ev.glob("run-*.wandb")))
    assert info["id"] != trained_id and (info["group"], info["job_type"]) == ("g42", "eval")
    assert info["config"]["meta"]["trained_wandb_id"] == trained_id
    assert json.loads((run / "evals" / "default_step6" / "meta.json").read_text())["wandb_id"] == info["id"]
    assert (run / "meta.json").read_text() == meta
    assert [next(d.glob("run-*.wandb")).read_bytes() for d in trained] == trained_bytes


def test_a_diverged_run_exits_3_naming_the_step_and_the_last_finite_loss(tmp_path):
    proc = run_py(
        *TINY,
        "tracker=none",
        "optim.lr=1e9",
        "optim.clip_grad_norm=null",
        "schedule.warmup_steps=0",
        "trainer.steps=20",
        cwd=tmp_path,
    )
    assert proc.returncode == RunFailed.DIVERGED
    line = error_line(proc)
    run = job_dir(tmp_path) / "run"
    rows = [r for r in read_metrics(run) if "train/loss" in r]
    bad = rows[-1]
    finite = [r for r in rows if isinstance(r["train/loss"], float)]
    assert bad["train/loss"] in ("nan", "inf", "-inf")
    reason = f"diverged at step {bad['step']}: train/loss={bad['train/loss']}; " + (
        f"last finite loss {finite[-1]['train/loss']:.4f} at step {finite[-1]['step']}"
        if finite
        else "no finite loss before it"
    )
    assert line.startswith("error: ") and f": {reason} (run store {run})" in line
    assert summary(run)["status"] == "diverged" and summary(run)["reason"] == reason
    # one step number for it everywhere: the error line's, the closing line's, the summary's
    assert f"\ndiverged at step {bad['step']} of 20 in " in "\n" + proc.stdout
    assert summary(run)["steps"] == bad["step"]


def _online(tmp_path, env_extra: dict, *overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update({"HOME": str(tmp_path / "home"), **env_extra})  # no ~/.netrc with a key
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        *TINY,
        "tracker.wandb.mode=online",
        *overrides,
        f"hydra.run.dir={job_dir(tmp_path)}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - t0


# A closed port on loopback: nothing leaves the machine.
OFFLINE_SERVER = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "0" * 40}


@pytest.mark.parametrize(
    "case,env,why",
    [
        ("no key", {}, "no W&B API key (run `wandb login` or set WANDB_API_KEY)"),
        ("no network", OFFLINE_SERVER, "cannot reach http://127.0.0.1:9 (Connection refused)"),
    ],
)
def test_wandb_online_that_cannot_connect_fails_fast_in_one_line(tmp_path, case, env, why):
    proc, elapsed = _online(tmp_path, env)
    assert proc.returncode == RunFailed.FAILED
    assert error_line(proc) == (
        f"error: tracker.wandb.mode=online: {why}; run offline with tracker.wandb.mode=offline "
        f"(`wandb sync` uploads it later) or set tracker.wandb.fallback=offline"
    )
    assert elapsed < 60  # the check itself takes at most 25 s; the rest is starting Python and JAX
    # The failure is on record in the store of the stage that met it: the tokenizer's where this job
    # had to fit one (a cold data cache, as when this test runs alone; the run never starts), else the
    # run's (the cache warmed by the tests before it).
    job = job_dir(tmp_path)
    cold = (job / "tokenizer").is_dir()
    failed = summary(job / ("tokenizer" if cold else "run"))
    assert failed["status"] == "failed" and why in failed["reason"]
    assert not (cold and (job / "run").exists())


def test_wandb_online_with_a_key_the_server_refuses_fails_fast_in_one_line(tmp_path):
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):  # a W&B server on loopback that knows no key
        def do_POST(self):
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"errors": [{"message": "user is not logged in"}]}')

        do_GET = do_POST

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        proc, elapsed = _online(tmp_path, {"WANDB_BASE_URL": url, "WANDB_API_KEY": "0" * 40})
    finally:
        server.shutdown()
    assert proc.returncode == RunFailed.FAILED
    assert error_line(proc).startswith(f"error: tracker.wandb.mode=online: {url} did not accept the API key (")
    assert "user is not logged in" in error_line(proc) and elapsed < 60


def test_wandb_online_falls_back_to_offline_when_asked(tmp_path):
    proc, _ = _online(tmp_path, OFFLINE_SERVER, "tracker.wandb.fallback=offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = job_dir(tmp_path) / "run"
    assert summary(run)["status"] == "finished"
    assert (
        json.loads((run / "meta.json").read_text())["wandb_fallback"]
        == "cannot reach http://127.0.0.1:9 (Connection refused)"
    )


def test_a_sweep_killed_mid_trial_retries_it_from_its_checkpoint(tmp_path, reference):
    """The sweep process dies with its trial at step 5; the next start finds the trial by its
    heartbeat, marks it and its run store failed, and (retry_failed=1) runs the same parameters
    again from the dead trial's checkpoint of step 3: the same losses as the uninterrupted run."""
    args = [
        "-m",
        *TINY,
        "tracker=none",
        "hydra/sweeper=optuna",
        "seed=choice(0)",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.heartbeat_interval=1",
        "hydra.sweeper.grace_period=2",
        "hydra.sweeper.retry_failed=1",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
    ]
    cmd = [sys.executable, str(ROOT / "tests" / "kill_worker.py"), *args]
    env = {**os.environ, "KILL_AT": "step:5", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    assert subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=300).returncode == -signal.SIGKILL
    dead = tmp_path / "multirun" / "0" / "run"
    assert summary(dead)["status"] == "running"  # what a kill leaves
    time.sleep(2.5)  # past the grace period
    proc = run_py(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import optuna

    study = optuna.load_study(study_name="dalle-ablate", storage=f"sqlite:///{tmp_path / 'multirun' / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE"]
    assert summary(dead)["status"] == "failed" and summary(dead)["reason"].startswith("killed: its process died")
    retry = tmp_path / "multirun" / "1" / "run"
    assert json.loads((retry / "meta.json").read_text())["resumed_from_step"] == 3
    assert losses(retry) == pytest.approx({s: v for s, v in losses(reference).items() if s > 3}, rel=1e-6)
    assert study.trials[1].value == pytest.approx(summary(reference)["eval/valid/loss"], rel=1e-6)


def test_sigterm_to_a_sweep_leaves_its_trial_to_be_continued_not_failed(tmp_path, reference):
    """An Optuna sweep of one trial gets SIGTERM before the trial's step 5: the trial saves step 4,
    the sweep exits 143 with the command that resumes it, and the study holds the stopped trial
    (FAILED, as optuna ends a trial that is not complete, but not counted) and a queued one with
    its parameters -- with no hydra.sweeper.retry_failed. That command runs the queued trial from
    the stopped one's checkpoint of step 4, to the uninterrupted run's losses; one trial counted."""
    import optuna

    sweep = tmp_path / "multirun"
    args = ["-m", *TINY, "tracker=none", "hydra/sweeper=optuna", "seed=choice(0)", "hydra.sweeper.n_trials=1"]
    env = {
        **os.environ,
        "KILL_AT": "step:5",
        "KILL_SIGNAL": "SIGTERM",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    }
    cmd = [sys.executable, str(ROOT / "tests" / "kill_worker.py"), *args, f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-3000:]
    head = f"{TERM} at step 4 of 6; checkpoint saved; resume with: python run.py "
    line = [x for x in proc.stderr.splitlines() if x.startswith(TERM)][-1]
    assert line.startswith(head), line
    again = shlex.split(line.removeprefix(head))
    assert again == [*args, f"hydra.sweep.dir={sweep}"]
    stopped = sweep / "0" / "run"
    assert saved_steps(stopped) == [3, 4] and summary(stopped)["reason"] == f"{TERM} at step 4 of 6"

    def study():
        return optuna.load_study(study_name="dalle-ablate", storage=f"sqlite:///{sweep / 'optuna.db'}")

    assert [(t.state.name, t.params) for t in study().trials] == [("FAIL", {"seed": 0}), ("WAITING", {"seed": 0})]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *again], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = study().trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    retry = sweep / "1" / "run"
    assert json.loads((retry / "meta.json").read_text())["resumed_from_step"] == 4
    assert losses(retry) == pytest.approx({s: v for s, v in losses(reference).items() if s > 4}, rel=1e-6)
    assert trials[1].value == pytest.approx(summary(reference)["eval/valid/loss"], rel=1e-6)


def test_after_a_failed_restore_only_the_stray_reads_errors_are_dropped(monkeypatch):
    """TensorStore reads still in flight when orbax's restore fails call back into its closed
    event loop, and that RuntimeError is printed as an unraisable error (or through
    sys.excepthook) under the one error line; the hooks installed on a failed restore drop exactly
    those, and pass every other error on."""
    import asyncio
    import types

    from dalle_ablate.train import checkpoint

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: seen.append(info[1]))
    monkeypatch.setattr(sys, "unraisablehook", lambda args: seen.append(args.exc_value))
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)  # what a late read's callback does
    except RuntimeError as e:
        stray = e
    checkpoint._quiet_stray_reads()
    checkpoint._quiet_stray_reads()  # once is enough: not wrapped twice

    def unraisable(error, obj=None):
        return types.SimpleNamespace(
            exc_type=type(error), exc_value=error, exc_traceback=error.__traceback__, err_msg=None, object=obj
        )

    async def _read_array_index_and_device_put():  # orbax's read coroutine, dropped with its error
        pass

    read = _read_array_index_and_device_put()
    read.close()
    sys.unraisablehook(unraisable(stray))
    sys.unraisablehook(unraisable(ValueError("a read failed"), read))
    sys.excepthook(RuntimeError, stray, stray.__traceback__)
    other = RuntimeError("Event loop is closed")  # the same words raised elsewhere: a real error
    sys.unraisablehook(unraisable(other))
    sys.excepthook(RuntimeError, other, None)
    bug = ValueError("a bug")
    sys.excepthook(ValueError, bug, None)
    sys.unraisablehook(unraisable(bug, object()))
    assert seen == [other, other, bug, bug]
