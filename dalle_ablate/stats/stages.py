"""The arithmetic of a study in two declared stages (docs/statistics.md, "Studies in stages"): the inverse-normal
combination test, two-look boundaries, Holm over the findings at each look, and repeated confidence intervals.
Pure numpy and scipy over leading (study) axes, for the calibration."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize
from scipy import stats as st

from dalle_ablate.stats import verdicts as V

# The kinds of boundary: classical O'Brien & Fleming ("OF") and Pocock ("P"); Lan & DeMets'
# spending functions of O'Brien-Fleming ("asOF") and Pocock ("asP") type (rpact's names).
KINDS = ("OF", "P", "asOF", "asP")


@dataclass(frozen=True)
class Combination:
    """The combination test of a study in two stages, declared before stage 1: stage 1's weight w1 (stage 2's is
    sqrt(1 - w1²)), e.g. sqrt(n1 / (n1 + n2)) for the seeds planned, and the boundaries' kind."""

    w1: float = math.sqrt(0.5)
    kind: str = "asOF"

    @property
    def w2(self) -> float:
        return math.sqrt(1 - self.w1**2)


def inverse_normal(p1, p2, w1: float) -> np.ndarray:
    """The inverse-normal combination of one-sided stage-wise p-values: 1 - Φ(w1 Φ⁻¹(1 - p1) +
    w2 Φ⁻¹(1 - p2)), w2 = sqrt(1 - w1²)."""
    return st.norm.sf(combined_z(st.norm.isf(p1), st.norm.isf(p2), w1))


def combined_z(z1, z2, w1: float) -> np.ndarray:
    """w1 z1 + w2 z2: the combined statistic of two stage-wise normal scores."""
    return w1 * np.asarray(z1, np.float64) + math.sqrt(1 - w1**2) * np.asarray(z2, np.float64)


def spending(t: float, alpha: float, kind: str) -> float:
    """The one-sided α spent by information fraction t by Lan & DeMets' (1983) functions:
    O'Brien-Fleming type 2 (1 - Φ(Φ⁻¹(1 - α/2) / sqrt(t))), Pocock type α ln(1 + (e - 1) t)."""
    if kind == "asOF":
        return 2 * st.norm.sf(st.norm.isf(alpha / 2) / math.sqrt(t))
    if kind == "asP":
        return alpha * math.log(1 + (math.e - 1) * t)
    raise ValueError(f"spending kind {kind!r}: one of asOF, asP")


def _both_below(c1: float, c2: float, rho: float) -> float:
    """P(Z1 < c1, Z2 < c2) for standard normals of correlation rho (scipy's bivariate normal,
    to an absolute error far below the smallest α a boundary is computed for)."""
    cov = [[1.0, rho], [rho, 1.0]]
    return float(st.multivariate_normal.cdf([c1, c2], [0.0, 0.0], cov, abseps=1e-12, releps=1e-10))


@functools.lru_cache(maxsize=None)
def boundaries(alpha: float, t1: float, kind: str) -> tuple[float, float]:
    """(c1, c2): the one-sided critical values of the stage-1 and the combined statistic at
    information fraction t1, whose probability of any crossing under the null is alpha.
    Classical (Jennison & Turnbull 2000, ch. 2): c1 = C / sqrt(t1), c2 = C for O'Brien & Fleming,
    c1 = c2 = C for Pocock. Spending (Lan & DeMets 1983): c1 spends spending(t1), c2 the rest."""
    rho = math.sqrt(t1)
    if kind in ("OF", "P"):
        first = (lambda c: c / rho) if kind == "OF" else (lambda c: c)
        c = optimize.brentq(lambda c: 1 - _both_below(first(c), c, rho) - alpha, 0.5, 10.0, xtol=1e-10)
        return first(c), c
    spent = spending(t1, alpha, kind)
    c1 = float(st.norm.isf(spent))
    # what is left for stage 2: P(Z1 < c1, Z >= c2) = alpha - spent
    c2 = optimize.brentq(lambda c: st.norm.cdf(c1) - _both_below(c1, c, rho) - (alpha - spent), 0.0, 10.0, xtol=1e-10)
    return c1, c2


def stage_z(d, se, df, shift=0.0) -> np.ndarray:
    """A stage's one-sided normal score for "the difference is above `shift`": Φ⁻¹ of the paired
    t test's 1 - p on df degrees of freedom (exact: the t's p-value is uniform under the null).
    -inf where the stage cannot test (fewer than 2 seeds: df < 1, or no spread); +inf for a
    difference above the shift with no spread."""
    d, se, df = (np.asarray(x, np.float64) for x in (d, se, df))
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (d - shift) / se
        z = st.norm.isf(st.t.sf(t, df))
    ok = np.isfinite(d) & (df >= 1) & ((se > 0) | (d != shift))
    return np.where(ok, z, -np.inf)


def reject_by_look(z1, z2, w1: float, c: tuple, single=None):
    """Whether a one-sided two-look test with boundaries c = (c1, c2) rejects at look 1 and by
    look 2 (at look 1, or its combined statistic beyond c2). `single`: where True, a hypothesis
    that no stage 2 can add to (a claim judged on stress runs of a plan of their own) has one look,
    its fixed-design test at the same level: stage 1's statistic beyond c[2] (Bonferroni's
    intersection tests need each member's own test at its level, of whatever form)."""
    first = np.asarray(z1) >= c[0]
    with np.errstate(invalid="ignore"):
        combined = combined_z(z1, z2, w1) >= c[1]
    if single is None:
        return first, first | combined
    once = np.asarray(z1) >= c[2]
    return np.where(single, once, first), np.where(single, once, first | combined)


def holm_by_look(
    sides, alpha: float, combination: Combination, tested, split: int = 1, single=None
) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down over the last axis at both looks (Posch et al. 2005; Maurer & Bretz 2013).
    `sides`: a list of (z1, z2) pairs, the one-sided tests of each hypothesis; `split` = 1: the
    hypothesis is rejected at level a where *all* its one-sided tests reject at a (an intersection-
    union test: TOST's two); `split` = 2: where *any* of its two one-sided tests rejects at a / 2
    (a two-sided test as two one-sided ones). `single`: the hypotheses of one look
    (reject_by_look). Returns the rejections at look 1 and by look 2."""
    tested = np.asarray(tested, bool)
    k = int(tested.sum(-1).max()) if tested.size else 0
    r1 = np.zeros(tested.shape, int)
    r2 = np.zeros(tested.shape, int)
    for m, at1, at2 in _by_level(sides, alpha, combination, k, split, single):
        combine = np.logical_or if split == 2 else np.logical_and
        r1 += functools.reduce(combine, at1)
        r2 += functools.reduce(combine, at2)
    return _step_down(r1, tested), _step_down(r2, tested)


def _by_level(sides, alpha: float, combination: Combination, k: int, split: int, single):
    """For m = 1 .. k: (m, each side's rejections at look 1, by look 2) at Holm's level alpha / m."""
    for m in range(1, k + 1):
        level = alpha / (m * split)
        c = (*boundaries(level, combination.w1**2, combination.kind), float(st.norm.isf(level)))
        by = [reject_by_look(z1, z2, combination.w1, c, single) for z1, z2 in sides]
        yield m, [b[0] for b in by], [b[1] for b in by]


def sides_by_look(sides, alpha: float, combination: Combination, tested, single=None) -> tuple[np.ndarray, np.ndarray]:
    """A two-sided hypothesis tested as its two one-sided tests (holm_by_look with split = 2): which
    side rejected it at look 1 and by look 2 -- +1 the first side, -1 the second, 0 not rejected --
    each at the level Holm's step-down rejected it at (alpha / (2 m) a side, m the hypotheses left
    then). Where both sides' sequential tests reject at that level (stage 1 and the two stages
    together pointing opposite ways), look 1's decides: it came first."""
    tested = np.asarray(tested, bool)
    k = int(tested.sum(-1).max()) if tested.size else 0
    counts = [[np.zeros(tested.shape, int) for _ in sides] for _ in range(2)]  # [look][side]
    for _, at1, at2 in _by_level(sides, alpha, combination, k, 2, single):
        for look, at in enumerate((at1, at2)):
            for i, a in enumerate(at):
                counts[look][i] += a
    out = []
    for look in range(2):
        r = functools.reduce(np.maximum, counts[look])
        m = _levels(r, tested)  # the m each was rejected at; 0: not rejected
        first = (counts[0][0] >= m) & (m > 0)  # look 1's side where it rejects at that level
        up = np.where(first | (counts[0][1] >= m) & (m > 0), first, counts[look][0] >= m)
        out.append(np.where(m > 0, np.where(up, 1, -1), 0))
    return out[0], out[1]


def _step_down(r: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """Holm's step-down given, per hypothesis, the largest m at which its test at alpha / m
    rejects (its test's rejections are nested: a smaller level rejects less): with k tested, the
    i-th most significant (0-based) is rejected if it and every one before rejects at alpha / (k - i)."""
    return _levels(r, tested) > 0


def _levels(r: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """_step_down's decisions as the m each hypothesis was rejected at (alpha / m its level then), 0
    for one not rejected: the i-th most significant (0-based) of k tested is rejected at m = k - i."""
    k = tested.sum(-1, keepdims=True)
    r = np.where(tested, r, -1)
    order = np.argsort(-r, axis=-1, kind="stable")
    ranked = np.take_along_axis(r, order, -1)
    m = k - np.arange(r.shape[-1])
    ok = np.cumprod(ranked >= m, axis=-1).astype(bool)
    out = np.empty(ok.shape, int)
    np.put_along_axis(out, order, np.where(ok, m, 0), -1)
    return np.where(tested, out, 0)


def analyse_staged(
    first: dict[str, np.ndarray],
    second: dict[str, np.ndarray],
    comparisons: list[V.Comparison],
    combination: Combination,
    alpha: float = V.ALPHA,
    single=None,
) -> dict[str, np.ndarray]:
    """Every comparison judged in two stages, each stage's tables (metric -> values[..., arm,
    seed], NaN: no value; stage 2 all NaN where it did not run) on its own seeds by the verdict
    engine's paired difference (stats/verdicts.py): per look, Holm over the comparisons of the
    difference test (two-sided: each side at α/2), of the difference beyond ±Δ on either side
    (each at α/2, as the fixed design's), and of equivalence within ±Δ (both one-sided tests of
    TOST). `single` [comparisons]: those no stage 2 adds to, each with one look (reject_by_look).
    Returns the stage-wise differences and standard errors, the rejections at look 1
    (`differs1`, `beyond1`, `equivalent1`) and by look 2 (`differs2`, `beyond2`, `equivalent2`)."""
    s1, s2 = V.analyse(first, comparisons, alpha), V.analyse(second, comparisons, alpha)
    z = {}
    for name, s in (("1", s1), ("2", s2)):
        z["up" + name] = stage_z(s["d"], s["se"], s["df"])
        z["down" + name] = stage_z(-s["d"], s["se"], s["df"])
        z["above" + name] = stage_z(s["d"], s["se"], s["df"], -s["margin"])  # against δ <= -Δ
        z["below" + name] = stage_z(-s["d"], s["se"], s["df"], -s["margin"])  # against δ >= Δ
        z["over" + name] = stage_z(s["d"], s["se"], s["df"], s["margin"])  # against δ <= Δ
        z["under" + name] = stage_z(-s["d"], s["se"], s["df"], s["margin"])  # against δ >= -Δ
    tested = np.isfinite(s1["d"]) & (s1["df"] >= 1)
    look = functools.partial(holm_by_look, alpha=alpha, combination=combination, single=single)
    differ = [(z["up1"], z["up2"]), (z["down1"], z["down2"])]
    differs1, differs2 = look(differ, tested=tested, split=2)
    has = tested & np.isfinite(s1["margin"]) & (s1["margin"] > 0)
    eq1, eq2 = look([(z["above1"], z["above2"]), (z["below1"], z["below2"])], tested=has)
    beyond = [(z["over1"], z["over2"]), (z["under1"], z["under2"])]
    beyond1, beyond2 = look(beyond, tested=has, split=2)
    side1, side2 = sides_by_look(differ, alpha, combination, tested, single)
    beyond_side1, beyond_side2 = sides_by_look(beyond, alpha, combination, has, single)
    return {
        "d1": s1["d"],
        "se1": s1["se"],
        "df1": s1["df"],
        "d2": s2["d"],
        "se2": s2["se"],
        "df2": s2["df"],
        "differs1": differs1,
        "differs2": differs2,
        "beyond1": beyond1,
        "beyond2": beyond2,
        "equivalent1": eq1,
        "equivalent2": eq2,
        "side1": side1,
        "side2": side2,
        "beyond_side1": beyond_side1,
        "beyond_side2": beyond_side2,
        "n1": s1["n"],
        "n2": s2["n"],
    }


def repeated_interval(d1, se1, df1, d2, se2, df2, combination: Combination, alpha_side: float) -> tuple[tuple, tuple]:
    """The repeated confidence intervals of one comparison at its two looks (Jennison & Turnbull
    2000, ch. 9), each side at the boundaries of level alpha_side: at look 1, d1 ± t_df1(Φ(c1)) se1;
    at look 2, the differences δ0 whose combined statistic w1 z1(δ0) + w2 z2(δ0) lies within ±c2,
    z_j(δ0) the stage's t test of δ0 made normal (stage_z). Together they cover the true difference
    at both looks with probability at least 1 - 2 alpha_side; look j's excludes 0 exactly where that
    look's test rejects it. Without a stage-2 test, look 2's is look 1's."""
    c1, c2 = boundaries(alpha_side, combination.w1**2, combination.kind)
    half = st.t.ppf(st.norm.cdf(c1), df1) * se1
    look1 = (d1 - half, d1 + half)
    if not (np.isfinite(d2) and df2 >= 1 and se2 > 0):  # no stage-2 test: what look 1 showed
        return look1, look1

    def combined(delta: float) -> float:
        return float(combined_z(stage_z(d1, se1, df1, delta), stage_z(d2, se2, df2, delta), combination.w1))

    span = 50 * (se1 + se2) + abs(d1) + abs(d2)
    low = optimize.brentq(lambda x: combined(x) - c2, min(d1, d2) - span, max(d1, d2) + span, xtol=1e-12)
    high = optimize.brentq(lambda x: combined(x) + c2, min(d1, d2) - span, max(d1, d2) + span, xtol=1e-12)
    return look1, (low, high)


def outcome_at(res: dict, look: int) -> np.ndarray:
    """Each comparison's outcome (verdicts.OUTCOMES) at look 1, or by look 2, from analyse_staged's
    rejections: equivalent within ±Δ, else a difference on the side whose one-sided test rejected it
    (sides_by_look) -- beyond Δ where that side's beyond-Δ test rejects too -- else not resolved."""
    side, beyond, eq = (np.asarray(res[f"{k}{look}"]) for k in ("side", "beyond_side", "equivalent"))
    out = np.full(side.shape, V.UNRESOLVED)
    out[side > 0] = V.HIGHER
    out[side < 0] = V.LOWER
    out[(side > 0) & (beyond > 0)] = V.HIGHER_BEYOND
    out[(side < 0) & (beyond < 0)] = V.LOWER_BEYOND
    out[eq.astype(bool)] = V.EQUIVALENT
    return out


def combined_estimate(d1, se1, df1, d2, se2, df2, combination: Combination) -> float:
    """The difference the two stages together point at: the δ against which the combined statistic
    is 0, the one a test of it is least able to reject (median-unbiased where the study cannot stop
    at look 1: it is then the median of the combined test's confidence distribution); stage 1's
    difference where stage 2 has no test (no seeds, or no spread)."""
    if not (np.isfinite(d2) and df2 >= 1 and se2 > 0) or not (np.isfinite(d1) and df1 >= 1 and se1 > 0):
        return float(d1)

    def combined(delta: float) -> float:
        return float(combined_z(stage_z(d1, se1, df1, delta), stage_z(d2, se2, df2, delta), combination.w1))

    return float(optimize.brentq(combined, min(d1, d2) - 1e-9, max(d1, d2) + 1e-9, xtol=1e-12))


def looks(
    first: dict[str, np.ndarray],
    second: dict[str, np.ndarray],
    comps: list[V.Comparison],
    combination: Combination,
    once: np.ndarray,
) -> list[dict]:
    """Each comparison judged at both looks (analyse_staged): its outcome at look 1 and by
    look 2 (verdicts.analyse's codes), the combined estimate, and the repeated confidence
    intervals, 95 % and family-wise (α / m each side), as the intersection of both looks' (they
    cover the true difference at every look at once, so their intersection does too, and it
    excludes 0 wherever either look's test at that level rejects); a comparison of one look
    (`once`: on stress runs) gets its fixed-design t intervals. `stage_n`: its pairs per stage."""
    res = analyse_staged(first, second, comps, combination, single=once)
    outcomes = [outcome_at(res, 1), outcome_at(res, 2)]
    m, out = len(comps), []
    for j in range(m):
        d1, se1, df1, d2, se2, df2 = (float(res[k][j]) for k in ("d1", "se1", "df1", "d2", "se2", "df2"))
        if once[j]:
            (low, high), (fw_low, fw_high) = (_t_interval(d1, se1, df1, a) for a in (V.ALPHA, V.ALPHA / m))
            estimate = d1
        else:
            low, high = _intersection(*repeated_interval(d1, se1, df1, d2, se2, df2, combination, V.ALPHA / 2))
            fw_low, fw_high = _intersection(
                *repeated_interval(d1, se1, df1, d2, se2, df2, combination, V.ALPHA / (2 * m))
            )
            estimate = combined_estimate(d1, se1, df1, d2, se2, df2, combination)
        out.append(
            {
                "d": estimate,
                "low": low,
                "high": high,
                "fw_low": fw_low,
                "fw_high": fw_high,
                "fw_level": 1 - V.ALPHA / m,
                "look1": int(outcomes[0][j]),
                "look2": int(outcomes[1][j]),
                "stage_n": (int(res["n1"][j]), int(res["n2"][j])),
            }
        )
    return out


def _t_interval(d: float, se: float, df: float, alpha: float) -> tuple[float, float]:
    """The fixed design's two-sided t interval at 1 - alpha."""
    half = float(st.t.ppf(1 - alpha / 2, df) * se) if df >= 1 else math.nan
    return d - half, d + half


def _intersection(look1: tuple, look2: tuple) -> tuple[float, float]:
    """The two looks' repeated intervals intersected; look 2's where they do not meet (the two
    stages disagree beyond both intervals: one of them missed)."""
    low, high = max(look1[0], look2[0]), min(look1[1], look2[1])
    return (low, high) if low <= high else look2
