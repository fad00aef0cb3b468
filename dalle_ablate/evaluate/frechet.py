"""Fréchet distance and kernel inception distance between two sets of features.

Fréchet distance (Heusel et al. 2017, arXiv 1706.08500) between Gaussians fitted to the features:
|mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2)). The trace term is computed in float64 from
the symmetric matrix S1^(1/2) S2 S1^(1/2), whose square root has the same trace, by symmetric
eigendecomposition -- not `scipy.linalg.sqrtm` of the non-symmetric product (SciPy 1.18 removed
its `disp` argument, which broke several FID packages, and it returns complex noise on
near-singular covariances). KID (Binkowski et al. 2018, arXiv 1801.01401): the unbiased MMD^2
with the cubic polynomial kernel, averaged over subsets.
"""

from __future__ import annotations

import numpy as np


def statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, covariance) in float64 of [N, D] features (N >= 2)."""
    f = np.asarray(features, np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"features must be [N, D] with N >= 2, got shape {f.shape}")
    return f.mean(0), np.cov(f, rowvar=False)


def _sqrt_psd(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1: np.ndarray, s1: np.ndarray, mu2: np.ndarray, s2: np.ndarray) -> float:
    mu1, mu2, s1, s2 = (np.asarray(x, np.float64) for x in (mu1, mu2, s1, s2))
    r1 = _sqrt_psd(s1)
    middle = r1 @ s2 @ r1
    w = np.linalg.eigvalsh((middle + middle.T) / 2)
    trace_sqrt = np.sqrt(np.clip(w, 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * trace_sqrt)


def frechet_of(features: np.ndarray, mu2: np.ndarray, s2: np.ndarray) -> float:
    """frechet_distance of [N, D] features against (mu2, s2). With fewer features than dimensions
    (an evaluation's few samples against 2048 Inception features) S1 = A'A has rank N - 1 at most,
    A = (f - mean) / sqrt(N - 1), and the nonzero eigenvalues of S1 S2 are those of the N x N matrix
    A S2 A': the trace term from it, in place of two D x D eigendecompositions (seconds each)."""
    f = np.asarray(features, np.float64)
    if f.ndim != 2 or f.shape[0] < 2 or f.shape[0] > f.shape[1]:
        return frechet_distance(*statistics(f), mu2, s2)
    mu1, s2 = f.mean(0), np.asarray(s2, np.float64)
    a = (f - mu1) / np.sqrt(len(f) - 1)
    middle = a @ s2 @ a.T
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    return float(((mu1 - np.asarray(mu2, np.float64)) ** 2).sum() + (a * a).sum() + np.trace(s2) - 2 * trace_sqrt)


def frechet_between(a: np.ndarray, b: np.ndarray) -> float:
    return frechet_distance(*statistics(a), *statistics(b))


def kid(a: np.ndarray, b: np.ndarray, subsets: int = 10, subset_size: int = 100, seed: int = 0) -> float:
    """Mean unbiased MMD^2 with k(x, y) = (x.y / D + 1)^3 over random subsets of both sets."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    m = min(subset_size, len(a), len(b))
    d = a.shape[1]
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(subsets):
        x, y = a[rng.choice(len(a), m, replace=False)], b[rng.choice(len(b), m, replace=False)]
        kxx, kyy, kxy = (x @ x.T / d + 1) ** 3, (y @ y.T / d + 1) ** 3, (x @ y.T / d + 1) ** 3
        values.append(
            (kxx.sum() - np.trace(kxx)) / (m * (m - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1)) - 2 * kxy.mean()
        )
    return float(np.mean(values))
