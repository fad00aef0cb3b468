"""A study's verdicts from per-arm, per-seed values: the paired, pooled analysis, the five
verdicts at a family-wise 5 % (Holm), and the seeds a claim needs. Pure numpy over leading axes,
so that the calibration tests run thousands of simulated studies through this same code
(docs/statistics.md says why each choice; tests/report/test_verdicts.py proves the error rates).

The values come in as tables `metric -> array[..., arm, seed]` (NaN: no value for that run), so
any source can supply them: the study page reads them from run stores (report/findings.py), and
a stability claim judged on learning-rate stress runs can hand its per-arm, per-seed values
(e.g. each seed's learning-rate sensitivity) in a table of its own metric."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats as st

from dalle_ablate.report.stats import blocked_residual, holm, outlying_arms, paired, power, t_tests

# The family-wise error rate over a study's claims, for each kind of error (a false difference,
# a false equivalence, a false "beyond the margin").
ALPHA = 0.05
# The power seeds-needed is computed for, against a true effect of exactly the margin.
POWER = 0.80
# The homogeneity check: a claim whose own paired variance exceeds the pooled one by more than the
# upper CHECK quantile of F(n - 1, pooled df) is judged on its own variance (n - 1 degrees of
# freedom) instead -- the pooled noise would understate it (an arm whose seeds are not shared,
# e.g. other parameter shapes drawing another initialisation from the same key).
CHECK = 0.10
# An arm is left out of its metric's pool when its seeds' deviation from the other arms' is beyond
# the upper OUTLIER quantile of the F ratio against the others' residual variance; its claims are
# judged on their own variance.
OUTLIER = 0.01
# seeds-needed is searched up to this many seeds per arm; beyond it the page says "more than".
MAX_SEEDS = 200

VERDICTS = ("reproduced", "reproduced, possibly smaller than Δ", "no meaningful effect (equivalent within ±Δ)",
            "contradicted (reversed)", "not resolved")
REPRODUCED, SMALLER, EQUIVALENT, CONTRADICTED, UNRESOLVED = range(5)


@dataclass
class Claim:
    metric: str  # the table its values are in
    arm: int  # row of the arm the claim is about
    against: int  # row of the arm it is compared with
    side: int  # +1: the claim predicts arm > against; -1: arm < against
    margin: float  # delta, in the metric's units (> 0)


def analyse(tables: dict[str, np.ndarray], claims: list[Claim], alpha: float = ALPHA, level: float = 0.95,
            check: float = CHECK, outlier: float = OUTLIER) -> dict[str, np.ndarray]:
    """Every claim's paired difference (arm - against), its standard error and degrees of freedom
    (pooled, or the claim's own where the check rejects pooling), its `level` interval, rho, the
    three tests' p-values, Holm's decisions over the claims at `alpha`, and the verdict code
    (index into VERDICTS). Arrays of shape (..., claims)."""
    outlying, pooled = {}, {}
    for m, t in tables.items():
        t = np.asarray(t, np.float64)
        outlying[m] = outlying_arms(t, outlier)
        pooled[m] = blocked_residual(np.where(outlying[m][..., None], np.nan, t))
    cols: dict[str, list] = {k: [] for k in ("d", "var", "n", "rho", "s2", "pooled_df", "margin", "side", "arms",
                                             "outlier")}
    for c in claims:
        t = np.asarray(tables[c.metric], np.float64)
        d, var, n, rho = paired(t[..., c.arm, :], t[..., c.against, :])
        s2, df, _ = pooled[c.metric]
        for k, v in zip(cols, (d, var, n, rho, s2, df, np.broadcast_to(c.margin, d.shape),
                               np.broadcast_to(float(c.side), d.shape), np.broadcast_to(t.shape[-2], d.shape),
                               outlying[c.metric][..., c.arm] | outlying[c.metric][..., c.against])):
            cols[k].append(v)
    a = {k: np.stack(np.broadcast_arrays(*v), -1) for k, v in cols.items()}
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = a["var"] / (2 * a["s2"])
        use_pooled = ~a["outlier"] & (a["pooled_df"] > 0) & np.isfinite(a["s2"]) & ~(ratio > st.f.ppf(1 - check, a["n"] - 1, a["pooled_df"]))
        var = np.where(use_pooled, 2 * a["s2"], a["var"])
        df = np.where(use_pooled, a["pooled_df"], a["n"] - 1).astype(np.float64)
        se = np.sqrt(var / a["n"])
        half = st.t.ppf(0.5 + level / 2, df) * se
    p = t_tests(a["d"], se, df, a["margin"], a["side"])
    zero, beyond, tost = holm(p["zero"], alpha), holm(p["beyond"], alpha), holm(p["tost"], alpha)
    predicted = np.sign(a["d"]) == a["side"]
    verdict = np.full(a["d"].shape, UNRESOLVED)
    # Inside ±Δ (TOST) is "no meaningful effect" whichever side a detected difference is on: a
    # difference smaller than Δ is no effect in either direction.
    verdict[tost] = EQUIVALENT
    verdict[zero & ~predicted & ~tost] = CONTRADICTED
    verdict[zero & predicted & ~tost] = SMALLER
    verdict[zero & predicted & beyond] = REPRODUCED
    return {"d": a["d"], "se": se, "df": df, "low": a["d"] - half, "high": a["d"] + half, "n": a["n"], "rho": a["rho"],
            "pooled": use_pooled, "outlier": a["outlier"], "pooled_sd": np.sqrt(a["s2"]), "pooled_df": a["pooled_df"], "arms": a["arms"],
            "margin": a["margin"], "side": a["side"], "p_zero": p["zero"], "p_beyond": p["beyond"], "p_tost": p["tost"],
            "verdict": verdict}


def seeds_needed(pooled_sd, margin, arms: int, claims: int, alpha: float = ALPHA, target: float = POWER,
                 check: float = CHECK, max_seeds: int = MAX_SEEDS) -> np.ndarray:
    """Seeds per arm at which a true effect of exactly `margin` is told from 0 with probability
    `target`, from the pooled residual noise alone (never from an observed effect): the paired
    difference's sd is sqrt(2) x the residual sd, tested at alpha / claims (Holm's first step,
    the strictest it asks), on (arms - 1)(n - 1) degrees of freedom -- or, with probability
    `check` (the homogeneity check's false alarms), on the claim's own n - 1. max_seeds + 1 where
    even max_seeds would not do; 0 where the noise is unknown. Vectorised over pooled_sd and margin."""
    sd = np.sqrt(2) * np.asarray(pooled_sd, np.float64)[..., None]
    margin = np.asarray(margin, np.float64)[..., None]
    n = np.arange(2, max_seeds + 1)
    at = alpha / claims
    with np.errstate(invalid="ignore", divide="ignore"):
        p = (1 - check) * power(n, margin, sd, at, (arms - 1) * (n - 1)) + check * power(n, margin, sd, at, n - 1)
    ok = p >= target
    out = np.where(ok.any(-1), n[np.argmax(ok, -1)], max_seeds + 1)
    known = np.isfinite(sd[..., 0]) & (sd[..., 0] > 0) & (margin[..., 0] > 0)
    return np.where(known, out, 0)


def topup_seeds(needed: list[int], current: int, cap: int = MAX_SEEDS) -> int:
    """The top-up rule (docs/statistics.md): seeds per arm after a top-up = the largest
    seeds-needed over all the study's claims -- resolved or not, so that the choice depends on
    the pooled noise and the margins only, never on an effect -- and at least the current count."""
    return int(min(max([current, *needed]), cap))
