"""The statistics a report states, one method throughout: Student's t intervals across seeds
(curves' bands and final metrics) and Welch's t interval of a variant's difference from the
baseline, and stability events per run."""

from __future__ import annotations

import warnings

import numpy as np
from scipy import stats as st


def t_interval(values: np.ndarray, axis: int = 0, level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high): Student's t interval of the mean across seeds (NaN where n < 2)."""
    v = np.asarray(values, np.float64)
    n = np.sum(np.isfinite(v), axis=axis)
    mean = np.nanmean(v, axis=axis)
    sd = np.nanstd(v, axis=axis, ddof=1) if v.shape[axis] > 1 else np.full_like(mean, np.nan)
    half = st.t.ppf(0.5 + level / 2, np.maximum(n - 1, 1)) * sd / np.sqrt(np.maximum(n, 1))
    half = np.where(n >= 2, half, np.nan)
    return mean, mean - half, mean + half


def mean_ci(values, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval of the mean over seeds (NaN bounds below 2 seeds),
    the interval the curves' bands use too. Valid at n = 3 for roughly normal seed spreads, where a
    percentile bootstrap is too narrow: it cannot see spread the 3 seeds did not show."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return np.nan, np.nan, np.nan
    if len(v) == 1 or np.ptp(v) == 0:
        return float(v.mean()), (np.nan if len(v) == 1 else float(v[0])), (np.nan if len(v) == 1 else float(v[0]))
    ci = st.ttest_1samp(v, 0.0).confidence_interval(level)
    return float(v.mean()), float(ci.low), float(ci.high)


def diff_ci(a, b, level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): Welch's t interval (unequal variances, Welch-Satterthwaite
    degrees of freedom). An interval that excludes 0 is a difference beyond the seed spread."""
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    d = float(a.mean() - b.mean()) if len(a) and len(b) else np.nan
    if len(a) < 2 or len(b) < 2:
        return d, np.nan, np.nan
    if np.ptp(a) == 0 and np.ptp(b) == 0:  # no spread on either side: the difference is exact
        return d, d, d
    ci = st.ttest_ind(a, b, equal_var=False).confidence_interval(level)
    return d, float(ci.low), float(ci.high)


def significant(low: float, high: float) -> bool:
    return bool(np.isfinite(low) and np.isfinite(high) and (low > 0 or high < 0))


def spikes(values: np.ndarray, window: int = 20, factor: float = 1.5) -> int:
    """Steps whose value exceeds `factor` x the median of the `window` values before it: loss
    spikes (factor 1.5) and gradient-norm peaks (factor 5) -- the events DALL·E Mega's journal
    tracked by eye."""
    v = np.asarray(values, np.float64)
    count = 0
    for i in range(window, len(v)):
        ref = np.median(v[i - window:i])
        if np.isfinite(v[i]) and np.isfinite(ref) and ref > 0 and v[i] > factor * ref:
            count += 1
    return count


def diverged(values: np.ndarray, status: str) -> bool:
    return status == "diverged" or not np.all(np.isfinite(np.asarray(values, np.float64)))


# ---- Paired, pooled comparisons of a study's arms (docs/statistics.md) ----
#
# A study runs every arm with the same seeds; arms with one seed share its data order and initial
# key (common random numbers), so their values move together across seeds. The analysis blocks on
# the seed: per seed, the difference of two arms, and the noise of that difference pooled over
# every arm of the study by the additive model  value ~ arm + seed  (a randomised complete block
# design, Montgomery, "Design and Analysis of Experiments", ch. 4). The pooled residual variance
# has (arms - 1)(seeds - 1) degrees of freedom against the pair's own seeds - 1: at 16 arms and 3
# seeds, 30 against 2, which is what lets a handful of seeds decide anything at a family-wise 5 %.

def paired(a, b) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-seed differences a - b on the seeds both have (NaN where either is missing), over the
    last axis: (mean difference, its sample variance (ddof 1), seeds used, correlation rho of a
    and b over those seeds). Vectorised over leading axes."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    n = both.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(both, a - b, 0.0)
        mean = d.sum(-1) / n
        var = np.where(both, (d - mean[..., None]) ** 2, 0.0).sum(-1) / (n - 1)
        am = np.where(both, a, 0.0).sum(-1) / n
        bm = np.where(both, b, 0.0).sum(-1) / n
        ca, cb = np.where(both, a - am[..., None], 0.0), np.where(both, b - bm[..., None], 0.0)
        rho = (ca * cb).sum(-1) / np.sqrt((ca**2).sum(-1) * (cb**2).sum(-1))
    return mean, np.where(n >= 2, var, np.nan), n, np.where(n >= 3, rho, np.nan)


def blocked_residual(values) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The additive model value ~ arm + seed fitted to values[..., arm, seed] (NaN: no value):
    (residual variance, its degrees of freedom, the seed share of a single run's variance,
    sigma_seed^2 / (sigma_seed^2 + sigma_residual^2), from the two-way ANOVA's mean squares).
    In closed form, vectorised over leading axes, where the values present are a full table of
    some arms by some seeds (a study's seeds not all run yet, arms left out); else by least
    squares on the arm and seed indicators."""
    y = np.asarray(values, np.float64)
    batch = y.shape[:-2]
    flat = y.reshape(-1, *y.shape[-2:])
    s2, df, share = np.full(len(flat), np.nan), np.zeros(len(flat)), np.full(len(flat), np.nan)
    fin = np.isfinite(flat)
    rows, cols = fin.any(2), fin.any(1)  # arms and seeds with any value
    complete = (fin == (rows[:, :, None] & cols[:, None, :])).all((1, 2)) & cols.any(1)
    if complete.any():
        m = fin[complete]
        c = np.where(m, flat[complete], 0.0)
        arms, seeds = rows[complete].sum(1)[:, None, None], cols[complete].sum(1)[:, None, None]
        arm_mean, seed_mean = c.sum(2, keepdims=True) / seeds, c.sum(1, keepdims=True) / arms
        grand = c.sum((1, 2), keepdims=True) / (arms * seeds)
        resid = np.where(m, c - arm_mean - seed_mean + grand, 0.0)
        d = ((arms - 1) * (seeds - 1))[:, 0, 0]
        with np.errstate(invalid="ignore", divide="ignore"):
            ms_res = np.where(d > 0, (resid**2).sum((1, 2)) / d, np.nan)
            ms_seed = arms[:, 0, 0] * np.where(cols[complete][:, None, :], (seed_mean - grand) ** 2, 0.0).sum((1, 2)) \
                / (seeds[:, 0, 0] - 1)
            seed_var = np.maximum((ms_seed - ms_res) / arms[:, 0, 0], 0.0)  # E[MS_seed] = s_res^2 + arms s_seed^2
            s2[complete], df[complete] = ms_res, d
            share[complete] = seed_var / (seed_var + ms_res)
    for i in np.flatnonzero(~complete):
        arm_i, seed_i = np.nonzero(fin[i])
        if len(arm_i) == 0:
            continue
        x = np.zeros((len(arm_i), flat.shape[1] + flat.shape[2]))
        x[np.arange(len(arm_i)), arm_i] = 1.0
        x[np.arange(len(arm_i)), flat.shape[1] + seed_i] = 1.0
        obs = flat[i][arm_i, seed_i]
        coef, *_ = np.linalg.lstsq(x, obs, rcond=None)
        d = len(obs) - np.linalg.matrix_rank(x)
        if d > 0:
            s2[i], df[i] = float(((obs - x @ coef) ** 2).sum() / d), d
    return s2.reshape(batch), df.reshape(batch), share.reshape(batch)


def outlying_arms(values, level: float = 0.01) -> np.ndarray:
    """Arms whose seeds do not follow the others': per arm, its values' deviation from the other
    arms' seed means, its variance across seeds against the residual variance of the other arms'
    blocked model (x A / (A - 1), the variance that deviation has if the arm is like the rest),
    as an F ratio on (seeds - 1, the others' df) beyond its upper `level` quantile. Such an arm
    (an optimiser that diverges on some seeds, parameters initialised from another draw) would
    widen every interval of the pool, or be judged with too little noise by it. (..., arms) bool."""
    y = np.asarray(values, np.float64)
    arms = y.shape[-2]
    out = np.zeros(y.shape[:-1], bool)
    if arms < 3:
        return out
    for a in range(arms):
        others = np.delete(y, a, axis=-2)
        s2, df, _ = blocked_residual(others)
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)  # a seed no arm has: NaN, not a value
            dev = y[..., a, :] - np.nanmean(others, axis=-2)
            n = np.isfinite(dev).sum(-1)
            # Var(y_a - mean of the m others) = s2 (1 + 1/m) under the additive model, m the arms
            # with values (a metric measured on some arms only has fewer than `arms`).
            m = np.isfinite(others).any(-1).sum(-1)
            ratio = np.nanvar(dev, axis=-1, ddof=1) / (s2 * (m + 1) / np.maximum(m, 1))
            out[..., a] = (n >= 2) & (df > 0) & (ratio > st.f.ppf(1 - level, n - 1, df))
    return out


def holm(p, alpha: float = 0.05) -> np.ndarray:
    """Holm's step-down rejections over the last axis (Holm 1979): the i-th smallest p-value of k
    is rejected if it and every smaller one are below alpha / (k - i). NaN counts as 1."""
    p = np.where(np.isfinite(p), p, 1.0)
    k = p.shape[-1]
    order = np.argsort(p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, -1)
    adjusted = np.minimum(np.maximum.accumulate(ranked * (k - np.arange(k)), axis=-1), 1.0)
    out = np.empty_like(adjusted)
    np.put_along_axis(out, order, adjusted, -1)
    return out <= alpha


def t_tests(d, se, df, margin, side) -> dict[str, np.ndarray]:
    """p-values of a difference d with standard error se on df degrees of freedom: `zero`, two-
    sided against 0; `beyond`, one-sided against side*delta <= margin (the effect on the side the
    claim predicts, side = +1 or -1, exceeds the margin); `tost`, the two one-sided tests of
    equivalence within +-margin (Schuirmann 1987: the larger of the two p-values)."""
    d, se, df, margin, side = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (d, se, df, margin, side)))
    with np.errstate(invalid="ignore", divide="ignore"):
        ok = np.isfinite(d) & (se > 0) & (df > 0)
        t0 = d / se
        zero = 2 * st.t.sf(np.abs(t0), df)
        beyond = st.t.sf((side * d - margin) / se, df)
        tost = np.maximum(st.t.sf((d + margin) / se, df), st.t.cdf((d - margin) / se, df))
    return {k: np.where(ok, v, np.nan) for k, v in (("zero", zero), ("beyond", beyond), ("tost", tost))}


def power(n, effect: float, sd: float, alpha: float, df) -> np.ndarray:
    """Power of the two-sided t test at level alpha of a mean difference `effect` over n paired
    seeds whose differences have standard deviation `sd`, the noise estimated on `df` degrees of
    freedom: the noncentral t's mass beyond the critical values."""
    n, df = np.asarray(n, np.float64), np.asarray(df, np.float64)
    nc = effect / (sd / np.sqrt(n))
    crit = st.t.ppf(1 - alpha / 2, df)
    return st.nct.sf(crit, df, nc) + st.nct.cdf(-crit, df, nc)
