"""The job's side of a sweep trial: the sweeper passes the study's storage, name and the trial's
number as `optuna.*` overrides (a trial object cannot cross into launcher processes); the job
reopens the trial from the storage, reports its eval loss at each evaluation and asks the
study's pruner whether to stop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import optuna

from dalle_ablate.fileio import shown
from dalle_ablate.sweep.study import PRUNER_ATTR, RUN_DIR_ATTR, WANDB_ATTR, make_pruner
from dalle_ablate.train.loop import RunHooks


class Pruning:
    def __init__(self, storage: str, study_name: str, number: int):
        self.study = optuna.load_study(study_name=study_name, storage=storage)
        # The pruner the sweeper configured, as the study recorded it (load_study cannot know it).
        self.study.pruner = make_pruner(self.study.user_attrs.get(PRUNER_ATTR, {"name": "none"}))
        self.trial = optuna.trial.Trial(self.study, _trial_id(self.study, number))
        self.number = number

    def report(self, value: float, step: int) -> bool:
        """Record an intermediate value; True when the pruner says to stop."""
        self.trial.report(value, step)
        return self.trial.should_prune()


class TrialHooks(RunHooks):
    """A job launched by the Optuna sweeper (`optuna.*` set; job.py gives these to its run): its
    run store recorded on the trial at the start, and the study's pruner asked after each
    evaluation -- in a single-process run only, since other processes could not agree with
    process 0 on when to stop."""

    def __init__(self, link):
        self.link = link
        self.pruning = None

    def started(self, run_dir: Path, processes: int) -> None:
        record_run_dir(self.link, run_dir)
        if processes == 1 and self.pruning is None:  # a job of several members starts one run store each
            self.pruning = pruning_for(self.link)

    def should_stop(self, eval_loss: float, step: int) -> bool:
        return self.pruning is not None and self.pruning.report(eval_loss, step)


def pruning_for(link) -> Optional[Pruning]:
    """The trial this job runs for, when a sweeper launched it with pruning possible (one
    objective: optuna prunes single-objective studies only); else None."""
    if link is None or link.storage is None or link.trial is None:
        return None
    p = Pruning(link.storage, link.study, link.trial)
    return p if len(p.study.directions) == 1 else None




def record_run_dir(link, run_dir) -> None:
    """Tell the study where this trial's run store is, and its W&B run id (from the store's
    meta.json, written before the first step)."""
    if link is None or link.storage is None or link.trial is None:
        return
    study = optuna.load_study(study_name=link.study, storage=link.storage)
    trial_id = _trial_id(study, link.trial)
    study._storage.set_trial_user_attr(trial_id, RUN_DIR_ATTR, shown(run_dir))  # a bucket's store by its URL
    meta = Path(run_dir) / "meta.json"
    wandb_id = json.loads(meta.read_text()).get("wandb_id") if meta.exists() else None
    if wandb_id:
        study._storage.set_trial_user_attr(trial_id, WANDB_ATTR, wandb_id)


def _trial_id(study: optuna.Study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
