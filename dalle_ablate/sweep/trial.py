"""The job's side of a sweep trial: the sweeper passes the study's storage, name and the trial's
number as `optuna.*` overrides (a trial object cannot cross into launcher processes); the job
reopens the trial from the storage, reports its eval loss at each evaluation and asks the
study's pruner whether to stop. A trial of several seeds (`seeds=[...]`, members of one job)
reports its members' mean eval loss, and its value is the declared statistic of its members'
values (`trial_value`), each member's value kept on the trial."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import optuna

from dalle_ablate.fileio import shown
from dalle_ablate.sweep.optuna_study import MEMBERS_ATTR, PRUNER_ATTR, RUN_DIR_ATTR, STATISTICS, WANDB_ATTR, make_pruner
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

    def __init__(self, link, seeds: Optional[list[int]] = None):
        self.link, self.seeds = link, seeds
        self.pruning = None
        self.run_dirs: list[Path] = []

    def started(self, run_dir: Path, processes: int) -> None:
        if self.seeds is None:
            record_run_dir(self.link, run_dir)
        else:  # a job of several members starts one run store each, in the order of its seeds
            self.run_dirs.append(Path(run_dir))
            record_members(
                self.link,
                {
                    "seeds": list(self.seeds),
                    "run_dirs": [shown(d) for d in self.run_dirs],
                    "wandb_ids": [_wandb_id(d) for d in self.run_dirs],
                },
            )
        if processes == 1 and self.pruning is None:
            self.pruning = pruning_for(self.link)

    def should_stop(self, eval_loss: float, step: int) -> bool:
        """`eval_loss`: a members job's the mean over its running members (train/hooks.py)."""
        return self.pruning is not None and self.pruning.report(eval_loss, step)


def trial_value(link, seeds: list[int], values: np.ndarray, objectives: list[str]) -> list[float]:
    """A trial of several seeds: its value for each objective, the declared statistic
    (`link.statistic`, study.STATISTICS) over its members' values (`values[member, objective]`);
    each member's value, the sample sd and the statistic kept on the trial (optuna-dashboard shows
    them as user attributes) beside the members' run stores."""
    stat = STATISTICS.get(link.statistic)
    out = [stat(values[:, k]) for k in range(values.shape[1])]
    if link.storage is not None and link.trial is not None:
        study = optuna.load_study(study_name=link.study, storage=link.storage)
        trial_id = _trial_id(study, link.trial)
        record = dict(study._storage.get_trial(trial_id).user_attrs.get(MEMBERS_ATTR, {}))
        record.update(
            seeds=list(seeds),
            statistic=link.statistic,
            values={o: [float(v) for v in values[:, k]] for k, o in enumerate(objectives)},
            sd={o: float(np.std(values[:, k], ddof=1)) if len(seeds) > 1 else None for k, o in enumerate(objectives)},
        )
        study._storage.set_trial_user_attr(trial_id, MEMBERS_ATTR, record)
    return out


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
    wandb_id = _wandb_id(run_dir)
    if wandb_id:
        study._storage.set_trial_user_attr(trial_id, WANDB_ATTR, wandb_id)


def record_members(link, record: dict) -> None:
    """A trial of several seeds: its members' run stores and W&B runs, as far as started."""
    if link is None or link.storage is None or link.trial is None:
        return
    study = optuna.load_study(study_name=link.study, storage=link.storage)
    trial_id = _trial_id(study, link.trial)
    had = study._storage.get_trial(trial_id).user_attrs.get(MEMBERS_ATTR, {})
    study._storage.set_trial_user_attr(trial_id, MEMBERS_ATTR, {**had, **record})


def _wandb_id(run_dir) -> Optional[str]:
    meta = Path(run_dir) / "meta.json"
    return json.loads(meta.read_text()).get("wandb_id") if meta.exists() else None


def _trial_id(study: optuna.Study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
