"""The noise report: where a metric's seed-to-seed noise comes from (evaluation set, checkpoint, initialisation and
data order), each arm's seed spread, and each comparison's sd and rho, measured on the runs a page compares
(docs/statistics.md, "The noise report")."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as st

from dalle_ablate.report.load import Run, series
from dalle_ablate.report.prose import NOISE_INTRO
from dalle_ablate.report.tables import fmt3

LAST = 5  # the last evaluations whose mean is set against the final one


def interaction(values: np.ndarray) -> tuple[float, int]:
    """(the rows x columns interaction variance of a two-way table without replication, its
    degrees of freedom (r - 1)(c - 1)): runs x scenes, what a run's mean over the c scenes carries
    of the evaluation set, divided by c."""
    r, c = values.shape
    res = values - values.mean(1, keepdims=True) - values.mean(0, keepdims=True) + values.mean()
    df = (r - 1) * (c - 1)
    return (float((res**2).sum() / df) if df > 0 else math.nan), df


def sd_interval(values, level: float = 0.95) -> tuple[float, float, float, int]:
    """(sd, low, high, n) of the finite values: the sample sd and its chi-square interval."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    n = len(v)
    if n < 2:
        return math.nan, math.nan, math.nan, n
    sd = float(v.std(ddof=1))
    lo = sd * math.sqrt((n - 1) / st.chi2.ppf(0.5 + level / 2, n - 1))
    hi = sd * math.sqrt((n - 1) / st.chi2.ppf(0.5 - level / 2, n - 1))
    return sd, lo, hi, n


def final_eval(run: Run) -> float:
    v = series(run, "eval/valid/loss")[1]
    return float(v[-1]) if len(v) else math.nan


def last_mean(run: Run, k: int = LAST) -> float:
    """The mean of the run's last k evaluations of the eval loss (NaN with fewer)."""
    v = series(run, "eval/valid/loss")[1]
    return float(v[-k:].mean()) if len(v) >= k else math.nan


def eval_set_share(runs: list[Run]) -> tuple[float, float, int]:
    """(the evaluation set's variance in one run's final eval loss, sigma^2_ab / N; its share of
    the runs' variance; the runs it is measured on): from the runs' per-scene losses at their final
    validation, NaN with fewer than two runs that logged them alike."""
    rows = [r.valid_losses for r in runs]
    rows = [x for x in rows if x is not None]
    if len(rows) < 2 or len({len(x) for x in rows}) != 1:
        return math.nan, math.nan, len(rows)
    table = np.stack(rows)
    var, _ = interaction(table)
    total = table.mean(1).var(ddof=1)
    return var / table.shape[1], (var / table.shape[1] / total if total > 0 else math.nan), len(rows)


def pair_eval_set_share(pairs: list[tuple[Run, Run]]) -> tuple[float, float]:
    """(the evaluation set's variance in one seed's difference of two arms' final eval loss; its
    share of those differences' variance over the seeds): the seeds x scenes interaction of the
    per-scene differences, over N."""
    rows = [(a.valid_losses, b.valid_losses) for a, b in pairs]
    rows = [x - y for x, y in rows if x is not None and y is not None and len(x) == len(y)]
    if len(rows) < 2 or len({len(x) for x in rows}) != 1:
        return math.nan, math.nan
    table = np.stack(rows)
    var, _ = interaction(table)
    total = table.mean(1).var(ddof=1)
    return var / table.shape[1], (var / table.shape[1] / total if total > 0 else math.nan)


ARM_COLUMNS = [
    "arm",
    "seeds",
    "final eval loss: mean",
    "sd of one run",
    "its 95% CI",
    "of its variance: the evaluation set",
    "scenes",
    f"sd of the mean of the last {LAST} evaluations",
]


def arm_rows(by_arm: dict[str, list[Run]]) -> list[list]:
    """Per arm, its finished runs' final eval loss: mean, sd with its interval, the evaluation set's
    share of its variance (and over how many scenes), the sd the mean of the last evaluations has."""
    out = []
    for arm, runs in by_arm.items():
        done = [r for r in runs if r.status == "finished"]
        finals = [final_eval(r) for r in done]
        sd, lo, hi, n = sd_interval(finals)
        _, share, _ = eval_set_share(done)
        scenes = next((len(r.valid_losses) for r in done if r.valid_losses is not None), None)
        last = sd_interval([last_mean(r) for r in done])[0]
        out.append([arm, n, float(np.nanmean(finals)) if n else math.nan, sd, _ci(lo, hi), share, scenes or "–", last])
    return out


def _ci(lo: float, hi: float) -> str:
    return f"[{fmt3(lo)}, {fmt3(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else "–"


PAIR_COLUMNS = [
    "comparison",
    "seeds",
    "sd of a seed's difference",
    "rho",
    "of its variance: the evaluation set",
    f"sd of the difference of the last {LAST} evaluations' means",
]


def pair_row(name: str, a: list[Run], b: list[Run]) -> list:
    """A comparison of two arms on the seeds both finished: the sd of a seed's difference of the
    final eval loss, rho, the evaluation set's share of its variance, and the sd the difference of
    the last evaluations' means has."""
    fa = {r.seed: r for r in a if r.status == "finished"}
    fb = {r.seed: r for r in b if r.status == "finished"}
    seeds = [s for s in fa if s in fb]
    pairs = [(fa[s], fb[s]) for s in seeds]
    x = np.array([final_eval(p) for p, _ in pairs])
    y = np.array([final_eval(q) for _, q in pairs])
    sd = float(np.std(x - y, ddof=1)) if len(seeds) > 1 else math.nan
    rho = float(np.corrcoef(x, y)[0, 1]) if len(seeds) > 2 and x.std() > 0 and y.std() > 0 else math.nan
    _, share = pair_eval_set_share(pairs)
    last = [last_mean(p) - last_mean(q) for p, q in pairs]
    return [name, len(seeds), sd, rho, share, sd_interval(last)[0]]


def section(
    by_arm: dict[str, list[Run]], pairs: list[tuple[str, str, str]], key: str = "noise", title: str = "Noise report"
):
    """The noise report as a page section: the arms' table and the comparisons' (`pairs`: (name,
    arm, against)); the text alone where no run logged an eval loss."""
    from dalle_ablate.report.writers import Section

    s = Section(key, title)
    if not any(len(series(r, "eval/valid/loss")[1]) for rs in by_arm.values() for r in rs):
        s.text.append("No run logged an eval loss: nothing to decompose.")
        return s
    s.text.append(NOISE_INTRO)
    s.tables.append((ARM_COLUMNS, arm_rows(by_arm)))
    rows = [pair_row(name, by_arm[a], by_arm[b]) for name, a, b in pairs if a in by_arm and b in by_arm]
    if rows:
        s.tables.append((PAIR_COLUMNS, rows))
    return s
