"""The statistics a report states: intervals across seeds, bootstrap intervals of final
metrics and of a variant's difference from the baseline, and stability events per run."""

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


def bootstrap_ci(values, resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean over seeds."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return np.nan, np.nan, np.nan
    if len(v) == 1:
        return float(v[0]), np.nan, np.nan
    means = np.random.default_rng(seed).choice(v, (resamples, len(v))).mean(1)
    a = (1 - level) / 2
    return float(v.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def bootstrap_diff(a, b, resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): seeds of each side resampled independently. An interval
    that excludes 0 is a difference beyond the seed spread."""
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if len(a) < 2 or len(b) < 2:
        return (float(a.mean() - b.mean()) if len(a) and len(b) else np.nan), np.nan, np.nan
    rng = np.random.default_rng(seed)
    d = rng.choice(a, (resamples, len(a))).mean(1) - rng.choice(b, (resamples, len(b))).mean(1)
    q = (1 - level) / 2
    return float(a.mean() - b.mean()), float(np.quantile(d, q)), float(np.quantile(d, 1 - q))


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
