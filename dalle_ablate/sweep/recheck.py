"""The winner re-checked (hydra.sweeper.recheck): after a sweep, its best `top` trials trained
again on seeds the sweep never used, each as one job of members, and judged against each other by
the verdict engine that judges studies (stats/verdicts.py: paired by seed, Holm over the
comparisons). A sweep's best value is the best of many noisy values, so it is biased toward luck
(the winner's curse); the re-check's values are not, and their difference is the selection bias
measured. Each trial's members' eval-loss curves are read for seeds late to their transition
(report/transitions.py): a late one is named in the log and in the record's `late_seeds`, and
judged like every other seed.

Imports here stay light: Hydra imports the sweeper plugin (and so this module) at every start of
`run.py`, `--help` included; the verdict engine (scipy) and the trainer's records (jax) are imported
when a re-check runs."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np
import optuna

from dalle_ablate.registry import ConfigError
from dalle_ablate.track.naming import key_of

log = logging.getLogger(__name__)
FOLDER = "recheck"  # under the sweep folder: recheck/trial<N>, one members job per re-checked trial


@dataclass
class RecheckConf:
    top: int = 0  # the best N complete trials re-checked at the end of the sweep; 0 = none, else >= 2
    # the fresh seeds; null = as many as a trial trained (at least 3), after the sweep's
    seeds: Optional[list[int]] = None
    margin: Optional[float] = None  # Δ: also say whether the best wins by more than Δ, or is equivalent within ±Δ
    # two declared stages (a study file's `stages:` mapping; docs/statistics.md, "Studies in stages"):
    # the seeds above are stage 1, stage 2's per trial by the rule from stage 1's values; null = one look
    stages: Optional[Dict[str, Any]] = None


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


def job_overrides(trial_overrides: list[str], seeds: list[int], number: int, stage: int = 1) -> list[str]:
    """A re-checked trial's job: its parameters and the sweep's fixed overrides, without the
    study's `optuna.*` (it is not a trial) and with the fresh seeds as members, in its own folder
    (`job_folder`: one per trial and stage)."""
    kept = [o for o in trial_overrides if key_of(o) not in ("seed", "seeds") and not key_of(o).startswith("optuna.")]
    return [
        *kept,
        f"seeds=[{','.join(map(str, seeds))}]",
        f"seed={seeds[0]}",
        f"hydra.sweep.subdir={FOLDER}/{job_folder(number, stage)}",
    ]


def job_folder(number: int, stage: int = 1) -> str:
    """A re-checked trial's job folder under recheck/: trial<N>, its stage 2 trial<N>-stage2."""
    return f"trial{number}" if stage == 1 else f"trial{number}-stage2"


def member_values(job_dir: Path, seeds: list[int], objective: str) -> np.ndarray:
    """Each member's value of `objective` (its run store's summary), NaN where a member did not
    finish -- all NaN where the job recorded no members (it failed before training) -- in the order
    of `seeds`."""
    from dalle_ablate.train.records import MEMBERS_FILE, member_folder

    path = job_dir / MEMBERS_FILE
    if not path.exists():
        return np.full(len(seeds), math.nan)
    record = json.loads(path.read_text())
    where = {m["seed"]: (member_folder(job_dir, m["job_dir"]), m["status"]) for m in record["members"]}
    out = []
    for s in seeds:
        folder, status = where.get(s, (None, None))
        summary = folder / "run" / "summary.json" if folder is not None else None
        value = json.loads(summary.read_text()).get(objective) if status == "finished" and summary.exists() else None
        out.append(float(value) if value is not None else math.nan)
    return np.array(out)


def member_runs(job_dir: Path) -> list:
    """The run stores of a re-check job's members that logged anything (report.load.Run), each with
    its member's seed."""
    from dalle_ablate.report.load import load_run
    from dalle_ablate.train.records import MEMBERS_FILE, member_folder

    path = job_dir / MEMBERS_FILE
    runs = []
    for m in json.loads(path.read_text())["members"] if path.exists() else []:
        store = member_folder(job_dir, m["job_dir"]) / "run"
        if (store / "metrics.jsonl").exists():
            run = load_run(store)
            run.config["seed"] = m["seed"]
            runs.append(run)
    return runs


def late_seeds(trials: list[optuna.trial.FrozenTrial], folder: Path) -> list[str]:
    """The late-seed view's lines for the re-checked trials (report/transitions.py, its default
    rule): a seed whose transition comes late against its trial's median named, or that none does;
    [] where no member logged an evaluation."""
    from dalle_ablate.report import prose
    from dalle_ablate.report.transitions import Rule, arm_transitions, late_lines

    arms = [arm_transitions(f"trial {t.number}", member_runs(folder / f"trial{t.number}"), Rule()) for t in trials]
    arms = [a for a in arms if a.seeds]
    return (late_lines(arms, "the trial's") or [prose.NONE_LATE]) if arms else []


def sweep_mean(trial: optuna.trial.FrozenTrial, objective: str) -> float:
    """A trial's mean value in the sweep: its members' mean (the trial's value may be another
    statistic of them: a bound, the median), or its one run's value."""
    members = trial.user_attrs.get("members", {}).get("values", {}).get(objective)
    return float(np.mean(members)) if members else float(trial.value)


def judge(
    trials: list[optuna.trial.FrozenTrial], values: np.ndarray, minimize: bool, margin: Optional[float], objective: str
) -> dict:
    """The re-check's record: `values[trial, seed]` of the re-checked trials (best of the sweep
    first); the best against each other one by the verdict engine (difference = best - other,
    paired by seed, Holm over the comparisons; the interval printed is the family-wise one,
    Bonferroni over them, the strictest level Holm's first step asks), and each trial's selection
    bias: its mean in the sweep minus its re-check mean (for a loss, < 0 is the winner's curse),
    with the re-check mean's standard error (the bias is itself one noisy number)."""
    from dalle_ablate.report import prose
    from dalle_ablate.stats import verdicts

    comparisons = [verdicts.Comparison("v", 0, j, margin if margin else math.nan) for j in range(1, len(trials))]
    r = verdicts.analyse({"v": values}, comparisons)
    out = {"trials": [], "against": []}
    for t, row in zip(trials, values):
        finite = row[np.isfinite(row)]
        mean = float(finite.mean()) if len(finite) else math.nan
        out["trials"].append(
            {
                "number": t.number,
                "params": dict(t.params),
                "sweep_value": float(t.value),
                "sweep_mean": sweep_mean(t, objective),
                "recheck_values": [float(v) for v in row],
                "recheck_mean": mean,
                "recheck_se": float(finite.std(ddof=1) / math.sqrt(len(finite))) if len(finite) > 1 else math.nan,
                "selection_bias": sweep_mean(t, objective) - mean,
            }
        )
    for j, c in enumerate(comparisons):
        words = prose.against_baseline(int(r["outcome"][j]), minimize)
        out["against"].append(
            {
                "trial": trials[c.against].number,
                "difference": float(r["d"][j]),
                "low": float(r["low"][j]),
                "high": float(r["high"][j]),
                "fw_low": float(r["fw_low"][j]),
                "fw_high": float(r["fw_high"][j]),
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
    k = len(record["against"])
    level = "95 %" if k == 1 else f"95 % family-wise over {k} comparisons"
    return (
        f"re-check on {first['seeds']} fresh seeds: trial {best['number']} (the sweep's best) is {first['outcome']} "
        f"-- {objective} difference {first['difference']:+.3g} [{first['fw_low']:+.3g}, {first['fw_high']:+.3g}] "
        f"({level}, {'paired' if first['paired'] else 'unpaired'}); its mean in the sweep {best['sweep_mean']:.4g}, "
        f"re-checked {best['recheck_mean']:.4g} ± {best['recheck_se']:.2g} (selection bias {best['selection_bias']:+.3g})"
    )


def collect(
    best: list, whys: list[str], folder: Path, seeds: list[int], objective: str, minimize: bool, margin: Optional[float]
) -> dict:
    """The re-check's record from what its jobs left (`folder/trial<N>`: the folder each job was
    given, not its JobReturn's -- a lost worker's has no config; `whys`: why each job failed, "" if
    it did not). A job that failed, or whose
    members did not finish, is named, not judged: the others are judged without it while the best
    and one more have two values or more."""
    values = np.array([member_values(folder / f"trial{t.number}", seeds, objective) for t in best])
    failed = {
        t.number: why or "its members did not finish"
        for t, why, v in zip(best, whys, values)
        if np.isfinite(v).sum() < 2
    }
    kept = [i for i, t in enumerate(best) if t.number not in failed]
    for number, why in failed.items():
        log.warning(f"re-check of trial {number} failed: {why} (run the sweep again to retry it)")
    if len(kept) < 2 or kept[0] != 0:
        log.warning("re-check: the sweep's best could not be judged against another trial")
        return {"seeds": seeds, "objective": objective, "failed": failed}
    record = judge([best[i] for i in kept], values[kept], minimize, margin, objective)
    record.update(seeds=seeds, objective=objective, **({"failed": failed} if failed else {}))
    log.info(summary_line(record, objective))
    late = late_seeds([best[i] for i in kept], folder)
    for line in late:  # the verdict above used every seed, a late one too
        log.info(f"re-check: {line}")
    if late:
        record["late_seeds"] = late
    return record


def stages_of(conf: RecheckConf, used: list[int], seeds: list[int]):
    """hydra.sweeper.recheck.stages as its declared Stages (report/study_file.py), checked before
    stage 1 runs: one line naming the field; stage 2's seeds new to the sweep and to stage 1."""
    from dalle_ablate.report.study_file import stages_from

    stages = stages_from(conf.stages, "hydra.sweeper.recheck")
    clash = sorted(set(stages.seeds(stages.cap)) & (set(used) | set(seeds)))
    if clash:
        raise ConfigError(
            f"hydra.sweeper.recheck.stages.seeds_from={stages.seeds_from}: stage 2 would train seeds "
            f"{clash}, which the sweep or the re-check's stage 1 uses; give seeds_from above {max([*used, *seeds])}"
        )
    return stages


def staged(
    best: list,
    record: dict,
    folder: Path,
    stages,
    overrides_of: Callable[[optuna.trial.FrozenTrial], list[str]],
    run: Callable[[list[list[str]]], list[str]],
    minimize: bool,
    margin: Optional[float],
) -> dict:
    """The re-check's stage 2 and both looks (report/staged.py, as a staged study's): stage 2's
    seeds per trial planned once from stage 1's values by the declared rule and kept in
    recheck/stages.json before any stage-2 job starts (a rerun reads it back), each raised trial's
    stage-2 seeds one members job (recheck/trial<N>-stage2; `run` launches them, the failure of each
    or ""), then the best against each other trial judged at both looks: the combined estimate,
    the repeated confidence intervals, the verdict at look 1 and by look 2. The trials' re-check
    means and selection bias stay stage 1's (a fixed sample: stage 2's size depends on stage 1)."""
    from dalle_ablate.stats import verdicts

    trials = [next(t for t in best if t.number == r["number"]) for r in record["trials"]]
    arms = [f"trial {t.number}" for t in trials]
    seeds1, later = record["seeds"], stages.seeds(stages.cap)
    comps = [verdicts.Comparison("v", 0, j, margin if margin else math.nan) for j in range(1, len(trials))]
    values1 = np.array([r["recheck_values"] for r in record["trials"]])
    plan = _stage2_plan(folder, stages, trials, arms, seeds1, values1, comps)
    raised = [(t, plan["stage2"][a]) for t, a in zip(trials, arms) if a in plan["stage2"]]
    batch = [job_overrides(overrides_of(t), ks, t.number, stage=2) + ["resume=auto"] for t, ks in raised]
    log.info(
        f"re-check stage 2, by its {plan['rule']} rule: "
        + ("; ".join(f"trial {t.number}: seeds {ks}" for t, ks in raised) or "no seeds")
    )
    failed = {t.number: why for (t, _), why in zip(raised, run(batch) if batch else []) if why}
    for number, why in failed.items():  # judged on what it has: stage 1's seeds, and any of stage 2's that finished
        log.warning(f"re-check stage 2 of trial {number} failed: {why} (run the sweep again to retry it)")
    width = max([len(later), *map(len, plan["stage2"].values())])
    values2 = np.full((len(trials), width), math.nan)
    for i, (t, a) in enumerate(zip(trials, arms)):
        ks = plan["stage2"].get(a, [])
        got = member_values(folder / job_folder(t.number, 2), ks, record["objective"]) if ks else []
        values2[i, : len(ks)] = got
    _judge_both_looks(record["against"], values1, values2, comps, stages, minimize)
    for r, row in zip(record["trials"], values2):
        r["stage2_values"] = [float(v) for v in row[: len(plan["stage2"].get(f"trial {r['number']}", []))]]
    record["stages"] = {**plan, **({"failed": failed} if failed else {})}
    log.info(summary_line(record, record["objective"]) + " -- by look 2 of its two declared stages")
    return record


def _stage2_plan(folder: Path, stages, trials: list, arms: list[str], seeds1: list[int], values1, comps) -> dict:
    """The re-check's stage-2 plan: the one kept in recheck/stages.json (refused where it was made
    for another stage 1), else planned from stage 1's values by the declared rule and kept there
    before any stage-2 job starts."""
    from dalle_ablate.fileio import atomic_write
    from dalle_ablate.report import staged as plans

    path = folder / plans.RECORD
    if path.exists():
        plan = json.loads(path.read_text())
        if plan["stage1"] != seeds1 or not set(plan["stage2"]) <= set(arms):
            raise ConfigError(
                f"{path}: stage 2 was planned for the re-check of {sorted(plan['stage2'])} on stage-1 seeds "
                f"{plan['stage1']}, this one re-checks {arms} on {seeds1}; move the file away to plan anew"
            )
        plans.check_stages(plan, stages, str(path))
        return plan
    cost = plans.seconds_per_run({a: member_runs(folder / job_folder(t.number)) for a, t in zip(arms, trials)})
    ids = [f"{arms[0]} vs {arms[c.against]}" for c in comps]
    every = np.ones(len(comps), bool)
    account = plans.plan_tables(stages, arms, {"v": values1}, comps, every, cost, ids, "hydra.sweeper.recheck")
    plan = {"declared": stages.declared, "design": plans.kept_stages(stages), "stage1": seeds1, **account}
    atomic_write(path, json.dumps(plan, indent=1) + "\n")  # before any stage-2 job: what stage 1 showed
    return plan


def _judge_both_looks(against: list[dict], values1, values2, comps, stages, minimize: bool) -> None:
    """Each entry of `against` (the best against one other trial) judged at both looks from the
    trials' stage-1 and stage-2 values: the combined estimate, the repeated confidence intervals,
    the verdict at look 1 and by look 2, in place of its one-look p."""
    from dalle_ablate.report import prose
    from dalle_ablate.stats import stages as S

    nan1, nan2 = np.full_like(values2, math.nan), np.full_like(values1, math.nan)
    first, second = {"v": np.hstack([values1, nan1])}, {"v": np.hstack([nan2, values2])}
    for entry, look in zip(against, S.looks(first, second, comps, stages.combination, np.zeros(len(comps), bool))):
        name = f"trial {entry['trial']}"
        words = [prose.against_baseline(look[k], minimize).replace("the baseline", name) for k in ("look1", "look2")]
        entry.pop("p")  # the combined test has no one p-value
        entry.update(
            difference=look["d"],
            low=look["low"],
            high=look["high"],
            fw_low=look["fw_low"],
            fw_high=look["fw_high"],
            seeds=sum(look["stage_n"]),
            stage_n=list(look["stage_n"]),
            look1=words[0],
            outcome=words[1],
        )
