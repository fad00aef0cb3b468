"""A sweep's crash recovery: what happens to a trial whose process died or was stopped.

- Died (its sweep process gone from this host, its heartbeat silent for longer than the grace
  period, or its cluster worker lost): the trial is FAILED, recorded on the study as died, not
  counted toward n_trials, its run stores marked failed, and retried if
  hydra.sweeper.retry_failed allows.
- Stopped (Ctrl-C or SIGTERM; its job saved its last step): FAILED -- optuna cannot take back a
  trial it asked -- but recorded as stopped, not counted, and queued again to continue from its
  checkpoint when the sweep resumes.
- A retried or continued trial resumes from the newest checkpoint of the trial it takes over."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import optuna

from dalle_ablate.fileio import is_url
from dalle_ablate.registry import ConfigError
from dalle_ablate.sweep.optuna_study import MEMBERS_ATTR, RUN_DIR_ATTR
from dalle_ablate.track.runstore import mark_failed

log = logging.getLogger("dalle_ablate.sweep.sweeper")  # the sweeper's log: one voice for a sweep

# The study's record of FAILED trials whose process died, {number: why} (a finished trial takes no
# more attributes): they do not count toward n_trials.
STALE_ATTR = "dalle_ablate.died"
# A trial's sweep process (which sends its heartbeat and launches its job): {host, pid, start}.
OWNER_ATTR = "dalle_ablate.sweep_process"
# The study's record of trials a Ctrl-C or SIGTERM stopped, {number: why}: FAILED (optuna cannot
# take back a trial it asked) but not counted toward n_trials, each queued again to continue.
STOPPED_ATTR = "dalle_ablate.stopped"
# A queued trial's system attribute: the number of the stopped trial whose checkpoint it continues.
CONTINUES_ATTR = "dalle_ablate.continues"


def _start_time(pid: int) -> Optional[str]:
    """When a process started (clock ticks since boot, /proc/<pid>/stat field 22): with its pid, it
    names one process, not a later one given the same pid; None where /proc cannot tell."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _host() -> str:
    """This machine, and the pid namespace its pids mean something in (containers on one host share
    a hostname at times, never a pid namespace)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}".strip()


def this_process() -> dict:
    return {"host": _host(), "pid": os.getpid(), "start": _start_time(os.getpid())}


# Launchers whose jobs run inside the sweep's process or in workers that end with it: a trial of
# theirs is dead once its sweep process is. A cluster launcher's jobs (Ray, SLURM) outlive the
# sweep process, so theirs are known dead only by their heartbeat.
LOCAL_LAUNCHERS = ("BasicLauncher", "JoblibLauncher")


def process_gone(owner: Any) -> bool:
    """Whether a trial's sweep process, recorded as `this_process()` gave it, is known dead with its
    jobs: it ran on this host, launched its jobs locally, and its pid is free, or taken by a
    process started later. Otherwise: not known (its heartbeat tells)."""
    if not isinstance(owner, dict) or owner.get("host") != _host() or not isinstance(owner.get("pid"), int):
        return False
    if not owner.get("local", True):  # a cluster launcher's job may still be running
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    start = _start_time(owner["pid"])
    return owner.get("start") is not None and start is not None and start != owner["start"]


@dataclass
class Recovery:
    """A sweep's handling of the trials that died or were stopped: `grace_period` (s) without a
    heartbeat marks a trial dead (hydra.sweeper.grace_period); `retry` enqueues a died trial again
    (optuna's RetryFailedTrialCallback; None: hydra.sweeper.retry_failed=0)."""

    grace_period: int
    retry: Optional[Callable] = None

    def fail_gone(self, study: optuna.Study) -> None:
        """RUNNING trials whose sweep process ran on this host, launched its jobs locally and is gone
        (its jobs with it): FAILED now, as their heartbeat would make them after the grace period."""
        for trial in study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.RUNNING]):
            owner = trial.user_attrs.get(OWNER_ATTR)
            if not process_gone(owner):
                continue
            try:
                if not study._storage.set_trial_state_values(trial._trial_id, state=optuna.trial.TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:  # another process got there first
                continue
            self.died(
                study,
                study._storage.get_trial(trial._trial_id),
                f"its process died: its sweep (pid {owner['pid']}) on this host is gone, found by a later sweep start",
            )

    def stale(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """A trial whose process died unseen (the sweep's own process with it)."""
        self.died(
            study,
            trial,
            f"its process died: no heartbeat for over {self.grace_period} s "
            f"(hydra.sweeper.grace_period), found by a later sweep start",
        )

    def died(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial, why: str, job_dir: Optional[str] = None
    ) -> None:
        """A FAILED trial whose process died (found by its heartbeat, or a launcher's lost worker):
        say why, mark its run store, and queue a retry if asked; it does not count toward n_trials.
        A job lost before it recorded its run store on the trial has it in its folder (`run`, as
        train/loop.py names it)."""
        study.set_user_attr(STALE_ATTR, {**study.user_attrs.get(STALE_ATTR, {}), str(trial.number): why})
        log.warning(f"trial {trial.number} FAIL: {why}")
        members = trial.user_attrs.get(MEMBERS_ATTR, {}).get("run_dirs")
        for run_dir in members or [trial.user_attrs.get(RUN_DIR_ATTR) or (job_dir and str(Path(job_dir) / "run"))]:
            if run_dir and (is_url(run_dir) or Path(run_dir).is_dir()):
                mark_failed(run_dir, f"killed: {why}")
        if self.retry is not None:
            self.retry(study, trial)  # enqueues the same parameters, remembering this trial's number

    def requeue(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, why: str) -> None:
        """A trial a Ctrl-C or SIGTERM stopped (its job saved its last step and said so): not
        counted toward n_trials, and queued again with the same parameters, to continue from that
        checkpoint when the sweep resumes -- whatever hydra.sweeper.retry_failed says: it did not
        fail. Its FAIL state is optuna's only way to end a trial that is not complete."""
        study.set_user_attr(STOPPED_ATTR, {**study.user_attrs.get(STOPPED_ATTR, {}), str(trial.number): why})
        log.warning(
            f"trial {trial.number} stopped: queued again, to continue from its checkpoint when the sweep resumes"
        )
        study.add_trial(
            optuna.create_trial(
                state=optuna.trial.TrialState.WAITING,
                params=trial.params,
                distributions=trial.distributions,
                system_attrs={**trial.system_attrs, CONTINUES_ATTR: trial.number},
            )
        )

    def resume(self, study: optuna.Study, trial: optuna.trial.Trial) -> list[str]:
        """For a retried trial: continue from the last checkpoint of the trial it retries -- the
        newest of the stopped one it continues and the failed one it retries (a trial of several
        seeds, which records no one run store, trains again from the start)."""
        frozen = study._storage.get_trial(trial._trial_id)
        numbers = [
            n
            for n in (
                frozen.system_attrs.get(CONTINUES_ATTR),
                optuna.storages.RetryFailedTrialCallback.retried_trial_number(frozen),
            )
            if n is not None
        ]
        if not numbers:
            return []
        number = max(numbers)
        run_dir = study.get_trials(deepcopy=False)[number].user_attrs.get(RUN_DIR_ATTR)
        from dalle_ablate.train.checkpoint import find_checkpoints  # orbax: not at Hydra's start (this is a plugin)

        try:
            find_checkpoints(run_dir) if run_dir else None
        except ConfigError:  # it died before its first checkpoint: start over
            return []
        return [f"resume='{run_dir}'"] if run_dir else []
