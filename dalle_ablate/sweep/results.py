"""A sweep's results: `optimization_results.yaml` in its folder (the trials by state, those that
died or were stopped, the best trial or the Pareto front with their run stores, the re-check's
verdict), and how a trial's values and parameters are written in the log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import optuna
from omegaconf import OmegaConf

from dalle_ablate.fileio import atomic_write
from dalle_ablate.sweep.optuna_study import MEMBERS_ATTR, RUN_DIR_ATTR, WANDB_ATTR
from dalle_ablate.sweep.recovery import STALE_ATTR, STOPPED_ATTR
from dalle_ablate.track.naming import short

log = logging.getLogger("dalle_ablate.sweep.sweeper")  # the sweeper's log: one voice for a sweep


def write_results(
    study: optuna.Study,
    sweep_dir: Path,
    directions: list[str],
    objectives: list[str],
    statistic: str,
    recheck: Optional[dict] = None,
) -> None:
    """The sweep's `optimization_results.yaml`: its trials by state, those that died or were
    stopped (sweep/recovery.py), the best trial (one objective) or the Pareto front, each with its
    run stores and W&B run, and the re-check's verdict; the best is logged too."""
    trials = study.get_trials(deepcopy=False)
    counts = {s.name: sum(t.state == s for t in trials) for s in optuna.trial.TrialState}
    out = {
        "study": study.study_name,
        "directions": directions,
        "trials": {k: v for k, v in counts.items() if v},
    }
    died = study.user_attrs.get(STALE_ATTR)
    if died:
        out["died"] = {int(k): v for k, v in died.items()}  # FAILED, not counted, replaced
    stopped = study.user_attrs.get(STOPPED_ATTR)
    if stopped:
        out["stopped"] = {int(k): v for k, v in stopped.items()}  # FAILED, not counted, continued
    out["objectives"] = objectives
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if complete and len(directions) == 1:
        best = study.best_trial
        out["best"] = {"number": best.number, "value": best.value, "params": best.params, **where(best)}
        at = (
            f"run store {best.user_attrs.get(RUN_DIR_ATTR)}"
            if MEMBERS_ATTR not in best.user_attrs
            else f"{statistic} of {len(best.user_attrs[MEMBERS_ATTR].get('seeds', []))} seeds, run stores "
            f"{', '.join(best.user_attrs[MEMBERS_ATTR].get('run_dirs', []))}"
        )
        log.info(
            f"best of {len(complete)} complete trials: trial {best.number}, {values_text(objectives, best.values)} at "
            f"{short_params(best.params)}, {at}"
        )
    elif complete:
        out["pareto_front"] = [
            {"number": t.number, "values": t.values, "params": t.params, **where(t)} for t in study.best_trials
        ]
        log.info(f"Pareto front of {len(complete)} complete trials: trials {[t.number for t in study.best_trials]}")
    if recheck is not None:
        out["recheck"] = recheck
    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(sweep_dir / "optimization_results.yaml", OmegaConf.to_yaml(OmegaConf.create(out)))


def values_text(objectives: list[str], values: list[float]) -> str:
    """`eval/valid/loss=0.4123`, one per objective."""
    names = objectives if len(objectives) == len(values) else [f"value{i}" for i in range(len(values))]
    return " ".join(f"{n}={v:.6g}" for n, v in zip(names, values))


def where(trial: optuna.trial.FrozenTrial) -> dict:
    """The trial's run store and W&B run, as the job recorded them (a trial of several seeds:
    its members' run stores, values and spread)."""
    return {k: trial.user_attrs[k] for k in (RUN_DIR_ATTR, WANDB_ATTR, MEMBERS_ATTR) if k in trial.user_attrs}


def short_params(params: dict) -> str:
    """Parameters as overrides, numbers to 3 significant digits, as runs are named."""
    return " ".join(short(f"{k}={v}") for k, v in params.items())
