"""A study's findings judged against the runs of its arms by the verdict engine: each finding's paired difference, its
interval and verdict under Holm, the seeds it still needs, Welch's interval beside it and its course over training."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from dalle_ablate.metrics import STUDY, Metric
import dalle_ablate.report.measures  # noqa: F401 -- the report's own measures a study can judge
from dalle_ablate.report import prose as P
from dalle_ablate.report.study_file import Finding, Study
from dalle_ablate.report.load import Run, final_value, series
from dalle_ablate.stats import verdicts as V
from dalle_ablate.stats.basic import blocked_residual, diff_ci

VERDICTS = P.VERDICTS


# The guidance scale a study reads a sampled metric at: 2, where the default job draws the most
# scenes right (docs/quickstart.md; guidance beyond 2-3 hurts).
STUDY_SCALE = 2.0


def _pareto_by_step(run: Run, key: str) -> dict[float, float]:
    """step -> a sampled metric at STUDY_SCALE, from every evaluation's eval_pareto table, not the last only."""
    out = {}
    for step, t in run.pareto_steps.items():
        c = {name: i for i, name in enumerate(t["columns"])}
        for row in t["rows"] if key in c else []:
            if row[c["scale"]] == STUDY_SCALE:
                out[float(step)] = float(row[c[key]])
    return out


def study_value(m: Metric, run: Run) -> float:
    """One run's value of `m` as a study reads it (page.py `reading` says it in words)."""
    if m.value is not None:
        return float(m.value(run))
    if m.source == "samples":  # the last evaluation's table
        c = {name: i for i, name in enumerate(run.pareto["columns"])} if run.pareto else {}
        rows = [r for r in run.pareto["rows"] if r[c["scale"]] == STUDY_SCALE] if m.key in c else []
        return float(rows[0][c[m.key]]) if rows else math.nan
    if m.reads == "median":
        _, v = series(run, m.logged())
        return float(np.median(v)) if len(v) else math.nan
    return final_value(run, m.logged())


def study_series(m: Metric) -> Optional[Callable[[Run], dict]]:
    """A run's values of `m` by step, for its course over training; None for a metric read once."""
    if m.reads != "last" or m.value is not None:
        return None
    if m.source == "samples":
        return lambda r: _pareto_by_step(r, m.key)
    return lambda r: dict(zip(*series(r, m.logged())))


def unit_of(metric: str) -> str:
    """The unit of a study metric's numbers; "" for one not declared."""
    return STUDY[metric].unit if metric in STUDY else ""


def claims_tables(
    study: Study, by_arm: dict[str, list[Run]], extra: Optional[dict[str, dict[str, dict]]] = None
) -> tuple[list[str], list, dict[str, np.ndarray]]:
    """(arms, seeds, metric -> values[arm, seed]) of the finished runs, NaN where none. `extra` (metric ->
    arm -> seed -> value) adds or replaces tables: values measured elsewhere (the stress runs')."""
    arms = list(dict.fromkeys([*by_arm, *(a for f in study.findings for a in (f.arm, f.against))]))
    done = {a: {r.seed: r for r in by_arm.get(a, []) if r.status == "finished"} for a in arms}
    extra = extra or {}
    seeds = sorted(
        {s for d in done.values() for s in d} | {s for t in extra.values() for d in t.values() for s in d}, key=str
    )
    tables = {}
    for m in dict.fromkeys(f.metric for f in study.findings):
        if m in extra or STUDY[m].reads == "given":
            given = extra.get(m, {})
            tables[m] = np.array([[float(given.get(a, {}).get(s, math.nan)) for s in seeds] for a in arms])
        else:
            read = STUDY[m]
            tables[m] = np.array(
                [[replicate(read, done[a][s]) if s in done[a] else math.nan for s in seeds] for a in arms]
            )
    return arms, seeds, tables


def replicate(m: Metric, run: Run) -> float:
    """One run's value of `m` as one replicate of its arm: NaN for a metric measured once per job
    (Metric.per_job) on a run that shared its job, whose value its members all log."""
    return math.nan if m.per_job and run.job_share > 1 else study_value(m, run)


def shared_jobs(study: Study, by_arm: dict[str, list[Run]]) -> dict[str, str]:
    """Findings on a metric measured once per job whose arms trained too few runs as jobs of their
    own (two each) for a spread, and why: id -> why seeds trained as members of shared jobs cannot
    settle them. Their members' values are left out (claims_tables), so they are in no Holm family."""
    out = {}
    for f in study.findings:
        if not STUDY[f.metric].per_job:
            continue
        done = {a: [r for r in by_arm.get(a, []) if r.status == "finished"] for a in (f.arm, f.against)}
        short = [a for a, runs in done.items() if sum(r.job_share == 1 for r in runs) < 2]
        if short and any(r.job_share > 1 for runs in done.values() for r in runs):
            out[f.id] = (
                f"{' and '.join(short)}'s seeds trained as members of shared jobs, so its {f.metric} is one "
                "measurement per job, not one per seed; time the arms as jobs of their own (dalle-ablate study "
                "--no-members)"
            )
    return out


def comparisons(study: Study, arms: list[str], tables: dict[str, np.ndarray]) -> list[V.Comparison]:
    """Each finding as the verdict engine's comparison: its arm against the other, its margin in
    the metric's units."""
    b = arms.index(study.baseline) if study.baseline in arms else None
    out = []
    for f in study.findings:
        base = tables[f.metric][b] if b is not None else np.array([math.nan])
        out.append(V.Comparison(f.metric, arms.index(f.arm), arms.index(f.against), f.margin.of(base)))
    return out


def judge(
    study: Study, arms: list[str], tables: dict[str, np.ndarray], alpha: float = V.ALPHA
) -> tuple[list[V.Comparison], dict]:
    """The findings of `study` judged on these tables: verdicts.analyse's results, each finding's
    verdict (read against the side it predicts) and seeds-needed from its own noise."""
    comps = comparisons(study, arms, tables)
    r = V.analyse(tables, comps, alpha)
    r["verdict"] = np.array([V.verdict(int(o), f.side) for o, f in zip(r["outcome"], study.findings)])
    r["needed"] = V.seeds_needed(r["sd"], r["margin"], len(comps), alpha, **_noise(r))
    # an unresolved finding of n seeds needs n + 1 at least, whatever the plan's power says
    r["plan"], r["fewest"], r["most"] = V.seeds_to_settle(
        r["d"], r["low"], r["high"], r["sd"], r["margin"], len(comps), alpha, **_noise(r), at_least=r["n"] + 1
    )
    return comps, r


def _noise(r: dict) -> dict:
    """The noise arguments of seeds_needed and seeds_to_settle from verdicts.analyse's results."""
    return {"paired": r["paired"], "va": r["va"], "vb": r["vb"]}


def verdict_text(code: int, needed: int, seeds: int = 0, why: str = "", *, plan: tuple[int, int, int]) -> str:
    """A verdict in words: a settled one as it is; an untestable one with `why`; one not resolved
    with what more seeds would do (verdicts.seeds_words): `plan`, (plan, fewest, most) from
    verdicts.seeds_to_settle, at the observed difference, and `needed`, for a difference of Δ."""
    if code == V.UNTESTABLE:
        return f"untestable here: {why or 'both arms give the same value on every seed'}"
    if code != V.NOT_RESOLVED:
        return P.VERDICTS[code]
    if needed == 0 and plan[0] == 0:
        return "not resolved: no seed spread to judge it on"
    if 0 < needed <= seeds:  # its seeds would find an effect of Δ 80 % of the time: one between 0 and Δ is likelier
        return (
            f"not resolved at {seeds} seeds, enough for an effect of Δ: the effect is likely smaller; "
            + P.seeds_words(*plan, 0)
        )
    return "not resolved: " + P.seeds_words(*plan, needed)


@dataclass(frozen=True)
class Spread:
    """What every finished seed of a finding's two arms says, whatever look judges it: counts, means,
    paired (or Welch's) sd and rho, Welch's interval, the seeds Δ needs and the plan (seeds_to_settle)."""

    n: tuple[int, int]
    seeds: list
    arm_mean: float
    against_mean: float
    rho: float
    sd: float
    df: float
    paired: bool
    welch_low: float
    welch_high: float
    tested: int  # the seeds the verdict's test is over
    needed: int
    plan: tuple[int, int, int]


@dataclass(frozen=True)
class Judged:
    """One finding judged at one look: the difference (arm - against), its intervals, outcome and verdict
    read against the predicted side. p-values are the fixed design's (NaN at a staged study's looks);
    `look1`, `stage_n` and `one_look` are a staged study's."""

    finding: Finding
    spread: Spread
    margin: float  # Δ in the metric's units; NaN: none
    diff: float
    low: float
    high: float
    fw_low: float
    fw_high: float
    fw_level: float
    outcome: int
    code: int
    verdict: str
    p_zero: float = math.nan
    p_beyond: float = math.nan
    p_tost: float = math.nan
    look1: Optional[str] = None
    stage_n: Optional[tuple[int, int]] = None
    one_look: bool = False


def spreads(study: Study, claims: tuple, level: float = 0.95) -> tuple[list[Spread], dict]:
    """Each finding's Spread over every seed of `claims` (claims_tables), and verdicts.analyse's results (judge)."""
    arms, seeds, tables = claims
    comps, r = judge(study, arms, tables)
    out = []
    for i, c in enumerate(comps):
        t = tables[c.metric]
        a, b = t[c.arm][np.isfinite(t[c.arm])], t[c.against][np.isfinite(t[c.against])]
        _, wlo, whi = diff_ci(a, b, level) if len(a) and len(b) else (math.nan,) * 3
        both = np.isfinite(t[c.arm]) & np.isfinite(t[c.against])
        out.append(
            Spread(
                n=(len(a), len(b)),
                seeds=[s for s, ok in zip(seeds, both) if ok],
                arm_mean=float(a.mean()) if len(a) else math.nan,
                against_mean=float(b.mean()) if len(b) else math.nan,
                **{k: float(r[k][i]) for k in ("rho", "sd", "df")},
                paired=bool(r["paired"][i]),
                welch_low=wlo,
                welch_high=whi,
                tested=int(r["n"][i]),
                needed=int(r["needed"][i]),
                plan=(int(r["plan"][i]), int(r["fewest"][i]), int(r["most"][i])),
            )
        )
    return out, r


def compare(
    study: Study, claims: tuple, level: float = 0.95, untestable: Optional[dict[str, str]] = None
) -> list[Judged]:
    """Each finding judged once on `claims` (claims_tables) over every seed, its verdict under Holm at 5 %.
    `untestable`: id -> why more seeds could not settle it, its verdict whatever the numbers say."""
    every, r = spreads(study, claims, level)
    untestable = untestable or {}
    out = []
    for i, (f, sp) in enumerate(zip(study.findings, every)):
        code = V.UNTESTABLE if f.id in untestable else int(r["verdict"][i])
        out.append(
            Judged(
                f,
                sp,
                **{
                    k: float(r[k][i])
                    for k in ("margin", "low", "high", "fw_low", "fw_high", "p_zero", "p_beyond", "p_tost")
                },
                diff=float(r["d"][i]),
                fw_level=1 - V.ALPHA / len(every),
                outcome=int(r["outcome"][i]),
                code=code,
                verdict=verdict_text(code, sp.needed, sp.tested, untestable.get(f.id, ""), plan=sp.plan),
            )
        )
    return out


def course(study: Study, by_arm: dict[str, list[Run]], arms: list[str], level: float = 0.95) -> dict[str, tuple]:
    """finding id -> (steps, difference, low, high) at every evaluation of its metric (a metric read
    at the end: study_series), the same analysis as at the end at each step; `arms`: claims_tables'."""
    out = {}
    for m in dict.fromkeys(f.metric for f in study.findings):
        by_step = study_series(STUDY[m])
        found = [f for f in study.findings if f.metric == m]
        if by_step is None:
            continue
        done = {a: {r.seed: by_step(r) for r in by_arm.get(a, []) if r.status == "finished"} for a in arms}
        seeds = sorted({s for d in done.values() for s in d}, key=str)
        steps = sorted({x for d in done.values() for c in d.values() for x in c})
        if not steps or not seeds:
            continue
        t = np.array(
            [[[done[a][s].get(x, math.nan) if s in done[a] else math.nan for s in seeds] for a in arms] for x in steps]
        )
        # the intervals only: no margin
        r = V.analyse({m: t}, [V.Comparison(m, arms.index(f.arm), arms.index(f.against)) for f in found], level=level)
        for j, f in enumerate(found):
            out[f.id] = (np.array(steps, float), r["d"][:, j], r["low"][:, j], r["high"][:, j])
    return out


def topup_rule(study: Study, by_arm: dict[str, list[Run]], needed: Iterable[int]) -> tuple[int, int]:
    """(seeds per arm now, seeds per arm the top-up rule asks for) from each finding's seeds-needed: the
    findings judged on the study's own runs, as --seeds adds seeds to those, not to the stress runs."""
    now = max((sum(r.status == "finished" for r in rs) for rs in by_arm.values()), default=0)
    own = [int(n) for n, f in zip(needed, study.findings) if n > 0 and STUDY[f.metric].reads != "given"]
    return now, V.topup_seeds(own, now)


def _arms_by(runs: list[Run]) -> dict[str, list[Run]]:
    by_arm: dict[str, list[Run]] = {}
    for r in runs:
        arm = r.arm
        if arm is not None:
            by_arm.setdefault(arm, []).append(r)
    return by_arm


def noise_sources(runs: list[Run], value: Callable[[Run], float]) -> list[tuple[str, float, int]]:
    """Where an arm's seed spread comes from when its runs vary one seed field at a time (Bouthillier et
    al. 2021): per field besides `seed`, (field, sd pooled over runs agreeing on the rest, df)."""
    keys = sorted({k for r in runs for k in r.config if k != "seed" and k.rsplit(".", 1)[-1].endswith("seed")})
    keys = [k for k in keys if len({repr(r.config.get(k)) for r in runs}) > 1]
    out = []
    for k in keys:
        groups: dict[tuple, list[float]] = {}
        for r in runs:
            v = value(r)
            if np.isfinite(v):
                # agreeing on `seed` too: a field that follows it (its default) varies with every source
                groups.setdefault(tuple(repr(r.config.get(o)) for o in ["seed", *keys] if o != k), []).append(v)
        ss = sum(float(((np.array(g) - np.mean(g)) ** 2).sum()) for g in groups.values())
        df = sum(len(g) - 1 for g in groups.values())
        if df > 0:
            out.append((k, math.sqrt(ss / df), df))
    return out


def metric_spreads(study: Study, claims: tuple) -> list[tuple]:
    """Per metric of the claims tables: (metric, the baseline's sd across seeds and its seeds, the least
    and the most spread arm and their sds, the seed share of one run's variance)."""
    arms, _, tables = claims
    out = []
    for name, t in tables.items():
        b = t[arms.index(study.baseline)] if study.baseline in arms else np.array([math.nan])
        b = b[np.isfinite(b)]
        with np.errstate(invalid="ignore"):
            sds = {a: float(np.nanstd(v, ddof=1)) for a, v in zip(arms, t) if np.isfinite(v).sum() > 1}
        least, most = (min(sds, key=sds.get), max(sds, key=sds.get)) if sds else (None, None)
        spread = (least, sds.get(least, math.nan), most, sds.get(most, math.nan), float(blocked_residual(t)[2]))
        out.append((name, float(b.std(ddof=1)) if len(b) > 1 else math.nan, len(b), *spread))
    return out


def baseline_sources(study: Study, by_arm: dict[str, list[Run]], metrics: Iterable[str]) -> list[tuple]:
    """(metric, source, sd, df) for each seed field the baseline's finished runs vary (noise_sources)."""
    base = [r for r in by_arm.get(study.baseline, []) if r.status == "finished"]
    fields = [(m, noise_sources(base, lambda r, m=m: replicate(STUDY[m], r))) for m in metrics]
    return [(m, k, sd, df) for m, found in fields if STUDY[m].reads != "given" for k, sd, df in found]
