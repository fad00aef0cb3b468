"""The statistics the pages state besides the verdict engine's: Student's t intervals across seeds, Welch's interval,
the two-way ANOVA's seed share of a noise floor, Holm's procedure, a t test's power, and stability events per run."""

from __future__ import annotations

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


def spikes(values: np.ndarray, window: int = 20, factor: float = 1.5) -> int:
    """Steps whose value exceeds `factor` x the median of the `window` values before it: loss
    spikes (factor 1.5) and gradient-norm peaks (factor 5) -- the events DALL·E Mega's journal
    tracked by eye."""
    v = np.asarray(values, np.float64)
    count = 0
    for i in range(window, len(v)):
        ref = np.median(v[i - window : i])
        if np.isfinite(v[i]) and np.isfinite(ref) and ref > 0 and v[i] > factor * ref:
            count += 1
    return count


def diverged(values: np.ndarray, status: str) -> bool:
    return status == "diverged" or not np.all(np.isfinite(np.asarray(values, np.float64)))


# ---- What the verdict engine (stats/verdicts.py) and a study's noise floor use ----


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
            ms_seed = (
                arms[:, 0, 0]
                * np.where(cols[complete][:, None, :], (seed_mean - grand) ** 2, 0.0).sum((1, 2))
                / (seeds[:, 0, 0] - 1)
            )
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


def holm(p, alpha: float = 0.05) -> np.ndarray:
    """Holm's step-down rejections over the last axis (Holm 1979): the i-th smallest of the k
    p-values is rejected if it and every smaller one are below alpha / (k - i). A NaN is no
    hypothesis tested (a comparison without a margin has no equivalence test): never rejected,
    and not counted in k."""
    p = np.asarray(p, np.float64)
    tested = np.isfinite(p)
    k = tested.sum(-1, keepdims=True)
    order = np.argsort(np.where(tested, p, np.inf), axis=-1, kind="stable")
    ranked = np.take_along_axis(np.where(tested, p, 1.0), order, -1)
    steps = np.maximum(k - np.arange(p.shape[-1]), 1)
    adjusted = np.minimum(np.maximum.accumulate(ranked * steps, axis=-1), 1.0)
    out = np.empty_like(adjusted)
    np.put_along_axis(out, order, adjusted, -1)
    return (out <= alpha) & tested


def power(n, effect: float, sd: float, alpha: float, df) -> np.ndarray:
    """Power of the two-sided t test at level alpha of a mean difference `effect` over n paired
    seeds whose differences have standard deviation `sd`, the noise estimated on `df` degrees of
    freedom: the noncentral t's mass beyond the critical values."""
    n, df = np.asarray(n, np.float64), np.asarray(df, np.float64)
    nc = effect / (sd / np.sqrt(n))
    crit = st.t.ppf(1 - alpha / 2, df)
    # The lower tail P(T < -crit | nc) as P(T > crit | -nc): scipy's nct.cdf returns NaN where it
    # underflows (df 2, nc 8.7), its sf does not.
    return st.nct.sf(crit, df, nc) + st.nct.sf(crit, df, -nc)
