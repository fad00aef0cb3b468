"""Late seeds: each run's caption-following transition (where its eval loss leaves its plateau), the seeds of an arm
that reach it late, and the view of every seed's curve that shows them. It changes no verdict (docs/statistics.md,
"Late seeds")."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from dalle_ablate.metrics import metric
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import figures
from dalle_ablate.report import prose as P
from dalle_ablate.report.load import Run, series
from dalle_ablate.report.tables import fmt3
from dalle_ablate.report.writers import Section

METRIC = "eval/valid/loss"  # the curve a transition is read on: one value per evaluation, the same scenes every time


@dataclass(frozen=True)
class Rule:
    """The rule's parameters, declared here once; a study file may declare its own (`transition:`,
    before its runs), `dalle-ablate report` takes the level with --transition-level."""

    # the loss a run's eval loss falls below when it leaves the plateau, in METRIC's unit. For the
    # shapes scenes on the k-means codes (the quickstart's and the studies' data) the plateau sits at
    # 0.29-0.30 nats per image token and runs that follow their captions end at 0.12-0.20 (issue 59's
    # baseline at 1500 and 3000 steps); 0.25 lies 0.04 below the plateau, four times the plateau's
    # own wiggle from one evaluation to the next, so no evaluation on the plateau crosses it by
    # chance, and above where any of them ends. Other data: declare a level of its own.
    level: float = 0.25
    # evaluations in a row below the level (the first counts; a run's last evaluation counts alone):
    # one evaluation that dips below and comes back is not the transition
    confirm: int = 2
    # late: a transition more than this many evaluation intervals after the arm's median (or none
    # where the median has one). The median, not the mean, so that the late seed does not move the
    # mark it is measured against; 2 intervals, so that seeds an evaluation or two apart, what the
    # resolution of the evaluations and a curve's own noise give, are on time
    late_after: float = 2.0


def rule_from(raw, where: str) -> Rule:
    """A study file's `transition:` mapping as a Rule (its missing keys the defaults), or a one-line
    error naming the file and the key."""
    if raw is None:
        return Rule()
    known = [f.name for f in fields(Rule)]
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: transition must be a mapping of {', '.join(known)}; it holds {raw!r}")
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{where}: transition has {key!r}; valid: {', '.join(known)}")
        whole = key == "confirm"
        ok = isinstance(value, int) if whole else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or not value > 0:
            kind = "a whole number of evaluations, 1 or more" if whole else "a positive number"
            raise ConfigError(f"{where}: transition.{key} is {value!r}; give {kind}")
    return Rule(**{k: (int(v) if k == "confirm" else float(v)) for k, v in raw.items()})


def transition_step(steps: np.ndarray, values: np.ndarray, level: float, confirm: int) -> Optional[float]:
    """The rule (docs/statistics.md, "Late seeds"): the step of the first evaluation whose value is
    below `level` and stays below at the next `confirm` - 1 evaluations the run has; None where no
    evaluation is (the run never left the plateau: "not reached"). A NaN is not below."""
    with np.errstate(invalid="ignore"):
        below = np.asarray(values, float) < level
    for i in range(len(below)):
        if below[i : i + confirm].all():
            return float(steps[i])
    return None


@dataclass
class Seed:
    seed: object
    steps: np.ndarray  # the evaluations' steps
    values: np.ndarray  # METRIC at each
    step: Optional[float]  # its transition; None: not reached
    late: bool = False


@dataclass
class Arm:
    name: str
    seeds: list[Seed]
    median: Optional[float]  # the median transition, "not reached" counted as later than any; None: not reached
    interval: float  # the evaluations' spacing in steps (their median), NaN with fewer than two


def median_step(steps: list[Optional[float]]) -> Optional[float]:
    """The median of transition steps, a run that has none counted as later than every step: None
    where the middle run (either of the middle two) has none."""
    if not steps:
        return None
    m = float(np.median([math.inf if s is None else s for s in steps]))
    return m if math.isfinite(m) else None


def is_late(step: Optional[float], median: Optional[float], interval: float, rule: Rule) -> bool:
    """Late by the rule: the arm's median reached and this run's transition either not reached or
    more than `rule.late_after` evaluation intervals after it."""
    if median is None:
        return False
    return step is None or step > median + rule.late_after * interval


def arm_transitions(name: str, runs: list[Run], rule: Rule) -> Arm:
    """Each run's curve and transition, the arm's median and which seeds are late; runs without an
    evaluation of METRIC are left out (they have no curve)."""
    seeds = []
    for r in runs:
        steps, values = series(r, METRIC)
        if len(steps):
            seeds.append(Seed(r.seed, steps, values, transition_step(steps, values, rule.level, rule.confirm)))
    every = np.unique(np.concatenate([s.steps for s in seeds])) if seeds else np.zeros(0)
    interval = float(np.median(np.diff(every))) if len(every) > 1 else math.nan
    median = median_step([s.step for s in seeds])
    for s in seeds:
        s.late = is_late(s.step, median, interval, rule)
    return Arm(name, seeds, median, interval)


def _confirmed(confirm: int) -> str:
    """The words for `confirm` evaluations in a row below the level."""
    if confirm == 1:
        return ""
    return P.CONFIRMED.format(k="" if confirm == 2 else f" {confirm - 1}", s="" if confirm == 2 else "s")


def _step(v: Optional[float]) -> str:
    return "not reached" if v is None else f"{v:g}"


def late_lines(arms: list[Arm], whose: str = "the arm's") -> list[str]:
    """One line per late seed, naming it, its transition and its arm's median; [] where none is."""
    return [
        P.LATE.format(
            arm=a.name,
            seed=s.seed,
            at="not reached" if s.step is None else f"at step {_step(s.step)}",
            whose=whose,
            median=_step(a.median),
        )
        for a in arms
        for s in a.seeds
        if s.late
    ]


def late_section(
    by_arm: dict[str, list[Run]], rule: Rule, key: str, group: str = "arm", where: str = "docs/statistics.md"
) -> Section:
    """The view: the rule in a sentence, a line per late seed (or that none is), a row per arm with
    each seed's transition, and every seed's curve, one panel per arm. `group`: what a panel is
    (arm, variant); `where`: how the page names docs/statistics.md."""
    s = Section(key, P.LATE_TITLE)
    arms = [arm_transitions(name, runs, rule) for name, runs in by_arm.items()]
    arms = [a for a in arms if a.seeds]
    if not arms:
        s.text.append(P.NO_EVALUATIONS.format(metric=METRIC))
        return s
    s.text.append(
        P.LATE_RULE.format(
            metric=METRIC,
            level=fmt3(rule.level, metric(METRIC).unit),
            confirmed=_confirmed(rule.confirm),
            after=f"{rule.late_after:g}",
            group=group,
            where=where,
        )
    )
    s.text += late_lines(arms, f"the {group}'s") or [P.NONE_LATE]
    s.tables.append(
        (
            [group, P.LATE_COLUMNS[0], P.LATE_COLUMNS[1], P.LATE_COLUMNS[2], P.LATE_COLUMNS[3]],
            [
                [
                    a.name,
                    ", ".join(f"{x.seed}: {_step(x.step)}" for x in a.seeds),
                    _step(a.median),
                    "–" if math.isnan(a.interval) else f"{a.interval:g}",
                    ", ".join(str(x.seed) for x in a.seeds if x.late) or "none",
                ]
                for a in arms
            ],
        )
    )
    if max(len(x.steps) for a in arms for x in a.seeds) < 2:
        s.text.append(P.NO_CURVES.format(metric=METRIC))
        return s
    panels = [(a.name, [(x.seed, x.steps, x.values, x.step, x.late) for x in a.seeds]) for a in arms]
    s.images.append(
        (
            P.LATE_FIGURE.format(metric=METRIC, unit=metric(METRIC).unit, group=group),
            figures.seeds_figure(panels, rule.level),
        )
    )
    return s
