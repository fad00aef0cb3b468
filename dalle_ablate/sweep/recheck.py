"""The winner re-checked (hydra.sweeper.recheck): after a sweep, its best `top` trials trained
again on seeds the sweep never used, each as one job of members, and judged against each other by
the verdict engine that judges studies (report/verdicts.py: paired by seed, Holm over the
comparisons). A sweep's best value is the best of many noisy values, so it is biased toward luck
(the winner's curse); the re-check's values are not, and their difference is the selection bias
measured."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import optuna

from dalle_ablate.registry import ConfigError
from dalle_ablate.report import verdicts
from dalle_ablate.track.naming import key_of
from dalle_ablate.train.records import MEMBERS_FILE

FOLDER = "recheck"  # under the sweep folder: recheck/trial<N>, one members job per re-checked trial


@dataclass
class RecheckConf:
    top: int = 0  # the best N complete trials re-checked at the end of the sweep; 0 = none, else >= 2
    # the fresh seeds; null = as many as a trial trained (at least 3), after the sweep's
    seeds: Optional[list[int]] = None
    margin: Optional[float] = None  # Δ: also say whether the best wins by more than Δ, or is equivalent within ±Δ


def fresh_seeds(conf: RecheckConf, used: list[int], per_trial: int = 1) -> list[int]:
    """The re-check's seeds: the ones given, which must be new to the sweep, or as many as a trial
    trained (`per_trial`; at least 3: the paired test needs spread) starting after the largest seed
    the sweep used (`used`: every trial's)."""
    if conf.seeds is not None:
        seeds = [int(s) for s in conf.seeds]
        clash = sorted(set(seeds) & set(used))
        if clash or len(seeds) < 2 or len(set(seeds)) != len(seeds):
            raise ConfigError(
                f"hydra.sweeper.recheck.seeds={seeds}: give at least 2 different seeds the sweep did not "
                f"use (it used {sorted(set(used))})"
            )
        return seeds
    start = max(used) + 1
    return list(range(start, start + max(3, per_trial)))


def job_overrides(trial_overrides: list[str], seeds: list[int], number: int) -> list[str]:
    """A re-checked trial's job: its parameters and the sweep's fixed overrides, without the
    study's `optuna.*` (it is not a trial) and with the fresh seeds as members, in its own folder."""
    kept = [o for o in trial_overrides if key_of(o) not in ("seed", "seeds") and not key_of(o).startswith("optuna.")]
    return [
        *kept,
        f"seeds=[{','.join(map(str, seeds))}]",
        f"seed={seeds[0]}",
        f"hydra.sweep.subdir={FOLDER}/trial{number}",
    ]


def member_values(job_dir: Path, seeds: list[int], objective: str) -> np.ndarray:
    """Each member's value of `objective` (its run store's summary), NaN where a member did not
    finish, in the order of `seeds`."""
    record = json.loads((job_dir / MEMBERS_FILE).read_text())
    where = {m["seed"]: (Path(m["job_dir"]), m["status"]) for m in record["members"]}
    out = []
    for s in seeds:
        folder, status = where.get(s, (None, None))
        summary = folder / "run" / "summary.json" if folder is not None else None
        value = json.loads(summary.read_text()).get(objective) if status == "finished" and summary.exists() else None
        out.append(float(value) if value is not None else math.nan)
    return np.array(out)


def judge(trials: list[optuna.trial.FrozenTrial], values: np.ndarray, minimize: bool, margin: Optional[float]) -> dict:
    """The re-check's record: `values[trial, seed]` of the re-checked trials (best of the sweep
    first); the best against each other one by the verdict engine (difference = best - other,
    paired by seed, Holm over the comparisons), and each trial's selection bias: its sweep value
    minus its re-check mean (for a loss, > 0 would be bad luck, < 0 the winner's curse)."""
    comparisons = [verdicts.Comparison("v", 0, j, margin if margin else math.nan) for j in range(1, len(trials))]
    r = verdicts.analyse({"v": values}, comparisons)
    out = {"trials": [], "against": []}
    for t, row in zip(trials, values):
        mean = float(np.nanmean(row)) if np.isfinite(row).any() else math.nan
        out["trials"].append(
            {
                "number": t.number,
                "params": dict(t.params),
                "sweep_value": float(t.value),
                "recheck_values": [float(v) for v in row],
                "recheck_mean": mean,
                "selection_bias": float(t.value) - mean,
            }
        )
    for j, c in enumerate(comparisons):
        words = verdicts.against_baseline(int(r["outcome"][j]), minimize)
        out["against"].append(
            {
                "trial": trials[c.against].number,
                "difference": float(r["d"][j]),
                "low": float(r["low"][j]),
                "high": float(r["high"][j]),
                "p": float(r["p_zero"][j]),
                "seeds": int(r["n"][j]),
                "paired": bool(r["paired"][j]),
                # the engine's words for the best against another: "better than trial N (by more than Δ)"
                "outcome": words.replace("the baseline", f"trial {trials[c.against].number}"),
            }
        )
    return out


def summary_line(record: dict, objective: str) -> str:
    """The closing line: whether the sweep's best is better than the runner-up beyond the seed
    noise, by how much, and the winner's curse."""
    best = record["trials"][0]
    first = record["against"][0]
    n = first["seeds"]
    return (
        f"re-check on {n} fresh seeds: trial {best['number']} (the sweep's best) is {first['outcome']} -- "
        f"{objective} difference {first['difference']:+.3g} [{first['low']:+.3g}, {first['high']:+.3g}] (95 %, "
        f"{'paired' if first['paired'] else 'unpaired'}, Holm over {len(record['against'])}); its sweep value "
        f"{best['sweep_value']:.4g}, re-checked {best['recheck_mean']:.4g} (selection bias "
        f"{best['selection_bias']:+.3g})"
    )
