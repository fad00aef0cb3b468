"""The verdict engine: whether a difference between two arms is real and by how much, on that comparison's own noise
(paired t over shared seeds, else Welch), three tests per comparison under Holm (docs/statistics.md). Pure numpy
over leading axes; values come in as tables `metric -> array[..., arm, seed]` (NaN: no value)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as st

from dalle_ablate.stats.basic import holm, power

# The family-wise error rate over the comparisons, for each kind of error (a false difference, a
# false "beyond the margin", a false equivalence).
ALPHA = 0.05
# The power seeds-needed is computed for, against a true difference of exactly the margin.
POWER = 0.80
# seeds-needed is searched up to this many seeds per arm; beyond it the page says "more than".
MAX_SEEDS = 200

# What the engine finds, whichever side a claim predicts (a comparison without a margin has no
# "by more than Δ" and no "equivalent"); report/prose.py's OUTCOMES says each in words.
HIGHER_BEYOND, HIGHER, EQUIVALENT, LOWER, LOWER_BEYOND, UNRESOLVED, IDENTICAL = range(7)

# A study's claim predicts a side; its verdict is the outcome read against that side (report/prose.py's
# VERDICTS in words).
REPRODUCED, SMALLER, NO_EFFECT, CONTRADICTED, NOT_RESOLVED, UNTESTABLE = range(6)


@dataclass
class Comparison:
    metric: str  # the table its values are in
    arm: int  # row of the arm compared
    against: int  # row of the arm it is compared with: the difference is arm - against
    margin: float = math.nan  # Δ in the metric's units (> 0); NaN: no margin, the difference test only


def _welch(a: np.ndarray, b: np.ndarray):
    """Welch's unpaired difference over the seeds each arm has: (d, se, df, sd of one seed's
    difference sqrt(s_a^2 + s_b^2), n = the smaller arm's count, s_a^2, s_b^2)."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    na, nb = fa.sum(-1), fb.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ma, mb = np.where(fa, a, 0).sum(-1) / na, np.where(fb, b, 0).sum(-1) / nb
        va = np.where(fa, (a - ma[..., None]) ** 2, 0).sum(-1) / (na - 1)
        vb = np.where(fb, (b - mb[..., None]) ** 2, 0).sum(-1) / (nb - 1)
        qa, qb = va / na, vb / nb
        df = (qa + qb) ** 2 / (qa**2 / (na - 1) + qb**2 / (nb - 1))
    return ma - mb, np.sqrt(qa + qb), df, np.sqrt(va + vb), np.minimum(na, nb), va, vb


def _paired(a: np.ndarray, b: np.ndarray):
    """The per-seed differences over the seeds both arms have: (d, se, df, their sd, n, rho)."""
    both = np.isfinite(a) & np.isfinite(b)
    n = both.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.where(both, a - b, 0.0)
        d = diff.sum(-1) / n
        sd = np.sqrt(np.where(both, (diff - d[..., None]) ** 2, 0.0).sum(-1) / (n - 1))
        am, bm = np.where(both, a, 0).sum(-1) / n, np.where(both, b, 0).sum(-1) / n
        ca, cb = np.where(both, a - am[..., None], 0), np.where(both, b - bm[..., None], 0)
        rho = (ca * cb).sum(-1) / np.sqrt((ca**2).sum(-1) * (cb**2).sum(-1))
        se = sd / np.sqrt(n)
    return d, se, n - 1.0, sd, n, np.where(n >= 3, rho, np.nan)


def tests(d, se, df, margin) -> dict[str, np.ndarray]:
    """p-values of a difference d with standard error se on df degrees of freedom: `zero`, two-
    sided against 0; `beyond`, against |δ| <= Δ, on the side d lies (twice the one-sided p, so
    that either side may be found); `tost`, equivalence within ±Δ by two one-sided tests
    (Schuirmann 1987: the larger of the two p-values). A difference the same on every seed (se 0)
    is exact: the limit of each test as se -> 0. NaN where untestable (df < 1, no difference and
    no spread, or no margin for the last two)."""
    d, se, df, margin = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (d, se, df, margin)))
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = np.isfinite(d) & (se >= 0) & (df > 0)
        zero = 2 * st.t.sf(np.abs(d) / se, df)
        beyond = np.minimum(2 * st.t.sf((np.abs(d) - margin) / se, df), 1.0)
        tost = np.maximum(st.t.sf((d + margin) / se, df), st.t.cdf((d - margin) / se, df))
    has = ok & np.isfinite(margin) & (margin > 0)
    return {
        "zero": np.where(ok, zero, np.nan),
        "beyond": np.where(has, beyond, np.nan),
        "tost": np.where(has, tost, np.nan),
    }


def analyse(
    tables: dict[str, np.ndarray], comparisons: list[Comparison], alpha: float = ALPHA, level: float = 0.95
) -> dict[str, np.ndarray]:
    """Every comparison's difference (arm - against), paired where the two arms share two seeds
    or more, else Welch's; its standard error, degrees of freedom and `level` interval, the
    family-wise interval (Bonferroni over the comparisons, the strictest level Holm's first step
    asks), rho, the sd of one seed's difference (the noise it is judged on), the three tests'
    p-values, Holm's decision on the difference (`differs`, also where the outcome is
    "equivalent") and the outcome (index into OUTCOMES). Arrays of shape (..., comparisons)."""
    cols: dict[str, list] = {k: [] for k in ("d", "se", "df", "sd", "n", "rho", "paired", "margin", "va", "vb")}
    for c in comparisons:
        t = np.asarray(tables[c.metric], np.float64)
        a, b = t[..., c.arm, :], t[..., c.against, :]
        pd_, pse, pdf, psd, pn, rho = _paired(a, b)
        wd, wse, wdf, wsd, wn, va, vb = _welch(a, b)
        use = pn >= 2
        for k, p, w in (("d", pd_, wd), ("se", pse, wse), ("df", pdf, wdf), ("sd", psd, wsd), ("n", pn, wn)):
            cols[k].append(np.where(use, p, w))
        cols["rho"].append(rho)
        cols["paired"].append(use)
        cols["margin"].append(np.broadcast_to(float(c.margin), pd_.shape))
        cols["va"].append(np.where(use, np.nan, va))
        cols["vb"].append(np.where(use, np.nan, vb))
    r = {k: np.stack(np.broadcast_arrays(*v), -1) for k, v in cols.items()}
    k = len(comparisons)
    with np.errstate(invalid="ignore"):
        half = st.t.ppf(0.5 + level / 2, r["df"]) * r["se"]
        fw = st.t.ppf(1 - alpha / (2 * k), r["df"]) * r["se"]
    p = tests(r["d"], r["se"], r["df"], r["margin"])
    zero, beyond, tost = holm(p["zero"], alpha), holm(p["beyond"], alpha), holm(p["tost"], alpha)
    up = r["d"] > 0
    out = np.full(r["d"].shape, UNRESOLVED)
    out[zero & up] = HIGHER
    out[zero & ~up] = LOWER
    out[zero & up & beyond] = HIGHER_BEYOND
    out[zero & ~up & beyond] = LOWER_BEYOND
    # Inside ±Δ (TOST) is "equivalent" whichever side a detected difference is on: a difference
    # smaller than Δ is no meaningful effect in either direction.
    out[tost] = EQUIVALENT
    out[(r["sd"] == 0) & (r["d"] == 0) & (r["n"] >= 2)] = IDENTICAL
    r.update(
        low=r["d"] - half,
        high=r["d"] + half,
        fw_low=r["d"] - fw,
        fw_high=r["d"] + fw,
        p_zero=p["zero"],
        p_beyond=p["beyond"],
        p_tost=p["tost"],
        differs=zero,
        outcome=out,
    )
    return r


def verdict(outcome: int, side: int) -> int:
    """A claim's verdict (index into VERDICTS) from the engine's outcome and the side it predicts
    (+1: the arm higher than the one it is compared with, -1: lower)."""
    if outcome == EQUIVALENT:
        return NO_EFFECT
    if outcome == IDENTICAL:
        return UNTESTABLE
    if outcome == UNRESOLVED:
        return NOT_RESOLVED
    higher = outcome in (HIGHER_BEYOND, HIGHER)
    if higher != (side > 0):
        return CONTRADICTED
    return REPRODUCED if outcome in (HIGHER_BEYOND, LOWER_BEYOND) else SMALLER


def _df_at(n: np.ndarray, shape, paired, va, vb) -> np.ndarray:
    """Degrees of freedom at n seeds per arm (last axis), for comparisons of `shape`: n - 1 paired,
    Welch's from the arms' variances va and vb where the arms do not share seeds."""
    if va is None or vb is None:
        return np.broadcast_to(n - 1, (*shape, len(n)))
    va, vb = (np.broadcast_to(np.asarray(x, np.float64), shape)[..., None] for x in (va, vb))
    with np.errstate(invalid="ignore", divide="ignore"):
        welch = (n - 1) * (va + vb) ** 2 / (va**2 + vb**2)
    return np.where(np.broadcast_to(np.asarray(paired, np.float64), shape)[..., None] > 0, n - 1, welch)


def _first(ok: np.ndarray, n: np.ndarray, max_seeds: int) -> np.ndarray:
    """The first n (last axis) at which `ok` holds; max_seeds + 1 where none does."""
    return np.where(ok.any(-1), n[np.argmax(ok, -1)], max_seeds + 1).astype(int)


def seeds_needed(
    sd,
    margin,
    comparisons: int,
    alpha: float = ALPHA,
    target: float = POWER,
    paired=True,
    va=None,
    vb=None,
    max_seeds: int = MAX_SEEDS,
) -> np.ndarray:
    """Seeds per arm at which a true difference of exactly `margin` is told from 0 with
    probability `target` by the test this engine judges the comparison with: two-sided at
    alpha / comparisons (Holm's first step, the strictest it asks), its standard error the sd
    of one seed's difference `sd` (the comparison's own noise, never an observed effect) over
    sqrt(n), on n - 1 degrees of freedom paired, or Welch's at n seeds per arm from the arms'
    variances va and vb. max_seeds + 1 where even max_seeds would not do; 0 where the noise or
    the margin is unknown. Vectorised over sd and margin."""
    sd, margin = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (sd, margin)))
    n = np.arange(2, max_seeds + 1, dtype=np.float64)
    df = _df_at(n, sd.shape, paired, va, vb)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = power(n, margin[..., None], sd[..., None], alpha / comparisons, df)
    out = _first(p >= target, n, max_seeds)
    known = np.isfinite(sd) & (sd > 0) & np.isfinite(margin) & (margin > 0)
    return np.where(known, out, 0)


def settle_power(n, delta, sd, margin, alpha: float, df) -> np.ndarray:
    """At least the probability that a comparison of n seeds per arm is settled -- Holm's first
    step rejects "no difference" or, with a margin, "not equivalent" -- where its true difference
    is `delta` and one seed's difference has sd `sd`: the larger of the difference test's power
    (two-sided at alpha, stats.power) and TOST's. TOST's is the lower bound P(T+ > t) + P(T- < -t)
    - 1 over its two one-sided tests at alpha, each a noncentral t (Phillips 1990 gives the exact
    power; the bound misses only the chance that both fail at once, which needs t se > Δ), so the
    seeds counted from it are never too few. Broadcasts over its arguments."""
    n, delta, sd, margin, df = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (n, delta, sd, margin, df)))
    diff = power(n, delta, sd, alpha, df)
    with np.errstate(invalid="ignore", divide="ignore"):
        se = sd / np.sqrt(n)
        t = st.t.ppf(1 - alpha, df)
        tost = st.nct.sf(t, df, (delta + margin) / se) + st.nct.sf(t, df, (margin - delta) / se) - 1
    tost = np.where(np.isfinite(margin) & (margin > 0), np.maximum(tost, 0.0), 0.0)
    return np.maximum(np.nan_to_num(diff), tost)


# The differences across a comparison's 95 % interval at which the plan's range is computed: its
# two ends, its middle and points between (the seeds to settle are not monotone in the difference
# with a margin: a difference near Δ is the hardest to tell from either 0 or Δ).
PLAN_POINTS = 33


def seeds_to_settle(
    d,
    low,
    high,
    sd,
    margin,
    comparisons: int,
    alpha: float = ALPHA,
    target: float = POWER,
    paired=True,
    va=None,
    vb=None,
    at_least=2,
    max_seeds: int = MAX_SEEDS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A plan: the seeds per arm at which a comparison is settled with probability `target`
    (settle_power, at Holm's first step alpha / comparisons) if its true difference were the one
    observed, `d`, its noise the one observed, `sd` -- and, for its uncertainty, the fewest and the
    most seeds that asks for over the differences of its interval [low, high]. (plan, fewest,
    most), each at least `at_least` (an unresolved comparison of n seeds needs n + 1) and
    max_seeds + 1 where max_seeds would not do; 0 where the noise is unknown. The range covers
    what the difference may be, not the noise estimate's own error (at 3 seeds its 95 % interval
    runs from half to six times the estimate, docs/statistics.md). Vectorised over leading axes."""
    d, low, high, sd, margin = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (d, low, high, sd, margin)))
    n = np.arange(2, max_seeds + 1, dtype=np.float64)
    df = _df_at(n, sd.shape, paired, va, vb)[..., None, :]
    u = np.linspace(0.0, 1.0, PLAN_POINTS)
    deltas = np.concatenate([d[..., None], low[..., None] + u * (high - low)[..., None]], -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = settle_power(n, deltas[..., None], sd[..., None, None], margin[..., None, None], alpha / comparisons, df)
    counts = np.maximum(_first(p >= target, n, max_seeds), np.asarray(at_least)[..., None])
    known = (np.isfinite(sd) & (sd > 0) & np.isfinite(d))[..., None]
    counts = np.where(known, counts, 0)
    spread = np.where(np.isfinite(low) & np.isfinite(high), 1, 0)[..., None].astype(bool)
    rest = np.where(spread, counts[..., 1:], counts[..., :1])
    return counts[..., 0], rest.min(-1), rest.max(-1)


@dataclass(frozen=True)
class Margin:
    """Δ as declared: `value` in the metric's units, or with `relative` a fraction of the baseline's
    mean; parsed once, where a study file or flag is read (parse_margin)."""

    value: float
    relative: bool = False

    def of(self, baseline_values) -> float:
        """Δ in the metric's units: a percentage of the baseline's mean over its finished seeds
        (blind to every other arm, so an effect under test cannot move it), or the value given;
        NaN where the baseline has no value."""
        if not self.relative:
            return self.value
        base = np.asarray(baseline_values, np.float64)
        base = base[np.isfinite(base)]
        return self.value * abs(float(base.mean())) if len(base) else math.nan

    def __str__(self) -> str:
        return f"{100 * self.value:g}%" if self.relative else f"{self.value:g}"


def parse_margin(margin) -> Margin | None:
    """A margin given as "2%" (of the baseline's mean) or 0.01 (in the metric's units); None if it
    is not a positive number."""
    text = str(margin).strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        return None
    return Margin(value, text.endswith("%")) if math.isfinite(value) and value > 0 else None


def topup_seeds(needed: list[int], current: int, cap: int = MAX_SEEDS) -> int:
    """The top-up rule (docs/statistics.md): seeds per arm after a top-up = the largest
    seeds-needed over all the study's claims -- resolved or not, so that the choice depends on
    each claim's noise and margin only, never on an effect -- and at least the current count."""
    return int(min(max([current, *needed]), cap))
