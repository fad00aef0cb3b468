"""The statistics a report states, one method throughout: Student's t intervals across seeds
(curves' bands and final metrics) and Welch's t interval of a variant's difference from the
baseline, and stability events per run."""

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
