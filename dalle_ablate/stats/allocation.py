"""Stage 2's seeds per arm by the budget rule declared before stage 1: runs or CPU-hours go where they raise the
expected number of findings settled by look 2 most, judged from stage 1 (docs/statistics.md, "Studies in stages").
Vectorised over leading (study) axes for the calibration."""

from __future__ import annotations

import numpy as np
from scipy import stats as st

from dalle_ablate.stats import stages as S
from dalle_ablate.stats import verdicts as V


def settle_chance(
    z1: dict, d, sd, margin, pairs, left, combination: S.Combination, alpha: float = V.ALPHA, left_eq=None
) -> np.ndarray:
    """P(a finding is settled by look 2 | stage 1) with `pairs` stage-2 seeds, if its true difference
    were `d` and one seed's difference had sd `sd`. `z1`: stage 1's one-sided scores (stages.stage_z)
    "up", "down" (the difference's sides) and "above", "below" (TOST's, against -Δ and +Δ); `left`,
    `left_eq`: the hypotheses Holm has left at look 2 in the difference's family and in
    equivalence's (default: `left`). All broadcast; 0 where pairs < 2 (no stage-2 test); no
    equivalence without a margin (NaN or 0)."""
    pairs, margin = np.asarray(pairs, np.float64), np.asarray(margin, np.float64)
    c_diff = _c2(alpha / (2 * np.asarray(left)), combination)
    c_eq = _c2(alpha / np.asarray(left if left_eq is None else left_eq), combination)
    d = np.asarray(d, np.float64)
    side = lambda z, c, effect: _passes(z, c, effect, sd, pairs, combination)  # noqa: E731
    differs = side(z1["up"], c_diff, d) + side(z1["down"], c_diff, -d)  # the two sides exclude each other
    # TOST needs both: at least P(above) + P(below) - 1 (Fréchet), of the one event or the other
    equivalent = np.maximum(side(z1["above"], c_eq, d + margin) + side(z1["below"], c_eq, margin - d) - 1.0, 0.0)
    equivalent = np.where(np.isfinite(margin) & (margin > 0), np.nan_to_num(equivalent), 0.0)
    p = np.maximum(differs, equivalent)  # the union is at least the larger
    return np.where(pairs >= 2, np.clip(np.nan_to_num(p), 0.0, 1.0), 0.0)


def _passes(z1, c2, effect, sd, pairs, combination: S.Combination) -> np.ndarray:
    """P(one one-sided test rejects by look 2): its combined statistic w1 z1 + w2 z2 past c2, z2 the
    stage-2 paired t test's normal score (stages.stage_z), i.e. its t statistic past a t quantile,
    which the t of k seeds passes with the noncentral t's probability, noncentrality the true
    distance beyond the test's bound over the mean's se (`effect` sqrt(k) / sd)."""
    need = (c2 - combination.w1 * np.asarray(z1, np.float64)) / combination.w2  # the z2 the combination needs
    df = np.maximum(pairs - 1, 1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        t_need = st.t.isf(st.norm.sf(need), df)
        return st.nct.sf(t_need, df, effect * np.sqrt(pairs) / np.asarray(sd, np.float64))


def _c2(level, combination: S.Combination) -> np.ndarray:
    """The combined statistic's boundary at each one-sided level (stages.boundaries, cached)."""
    level = np.asarray(level, np.float64)
    flat = [S.boundaries(float(a), combination.w1**2, combination.kind)[1] for a in level.ravel()]
    return np.reshape(flat, level.shape)


def plan(
    first: dict[str, np.ndarray],
    comparisons: list[V.Comparison],
    combination: S.Combination,
    arms: list[tuple[int, int]],
    can_add: np.ndarray,
    cost: np.ndarray,
    budget: float,
    cap: int,
    alpha: float = V.ALPHA,
) -> tuple[np.ndarray, np.ndarray]:
    """The rule on stage 1's tables (metric -> values[..., arm, seed]): (stage 2's seeds per arm
    [..., arms], at most `cap`; which findings were open after look 1). `arms`: each comparison's
    (arm, against) as indices into `cost` (the arms of the runs stage 2 adds to); `can_add`: the
    comparisons judged on those runs (not on stress runs of a plan of their own)."""
    chance, open_ = chances(first, comparisons, combination, can_add, cap, alpha)
    ends = np.array(arms).T
    return allocate(chance, ends[0], ends[1], cost, budget), open_


def chances(
    first: dict[str, np.ndarray],
    comparisons: list[V.Comparison],
    combination: S.Combination,
    can_add,
    cap: int,
    alpha=V.ALPHA,
) -> tuple[np.ndarray, np.ndarray]:
    """(each finding's chance to settle by look 2 with k = 0 .. cap paired stage-2 seeds [...,
    findings, k], 0 for one settled at look 1 or without runs to add; which were open after look
    1), from stage 1's tables. A comparison that `can_add` nothing to has one look (reject_by_look)."""
    r = V.analyse(first, comparisons, alpha)
    d, se, df, sd, margin = (r[k] for k in ("d", "se", "df", "sd", "margin"))
    z1 = {
        "up": S.stage_z(d, se, df),
        "down": S.stage_z(-d, se, df),
        "above": S.stage_z(d, se, df, -margin),
        "below": S.stage_z(-d, se, df, -margin),
    }
    none = np.full(d.shape, -np.inf)  # no stage 2 yet: what look 1 settles
    tested = np.isfinite(d) & (df >= 1)
    single = ~np.broadcast_to(np.asarray(can_add, bool), d.shape)
    differs, _ = S.holm_by_look([(z1["up"], none), (z1["down"], none)], alpha, combination, tested, 2, single)
    has = tested & np.isfinite(margin) & (margin > 0)  # equivalence needs a margin
    equivalent, _ = S.holm_by_look([(z1["above"], none), (z1["below"], none)], alpha, combination, has, 1, single)
    open_ = tested & ~differs & ~equivalent
    # Holm's families at look 2: the hypotheses of each not yet rejected (a finding settled as
    # equivalent still holds a place in the difference's, and the other way round)
    left = np.maximum((tested & ~differs).sum(-1), 1)[..., None, None]
    left_eq = np.maximum((has & ~equivalent).sum(-1), 1)[..., None, None]
    k = np.arange(cap + 1)
    z = {n: v[..., None] for n, v in z1.items()}
    chance = settle_chance(z, d[..., None], sd[..., None], margin[..., None], k, left, combination, alpha, left_eq)
    return np.where((open_ & np.asarray(can_add, bool))[..., None], chance, 0.0), open_


def allocate(
    chance: np.ndarray,
    arm: np.ndarray,
    against: np.ndarray,
    cost: np.ndarray,
    budget: float,
    chunk: int = 500,
    allowed=None,
) -> np.ndarray:
    """Stage 2's seeds per arm, [..., arms]: the greedy rule. `chance`: [..., findings, k] each
    finding's settle chance with k = 0, 1, ... paired stage-2 seeds (0 throughout for a finding
    already settled or without runs to add); `arm`, `against`: [findings] each finding's two arms
    (indices); `cost`: [arms] the cost of one seed of each arm; `budget`: what stage 2 may spend;
    `allowed`: [arms] the arms a raise may add seeds to (default all) -- a raise of a settled
    finding that would also lift an arm of no open finding is never taken, even where that arm
    costs nothing. Studies `chunk` at a time (the candidates of one are findings x k x findings)."""
    chance = np.asarray(chance, np.float32)  # small types: the candidates are many
    arm, against, cost = np.asarray(arm), np.asarray(against), np.asarray(cost, np.float64)
    flat = chance.reshape(-1, *chance.shape[-2:])
    allowed = np.ones(len(cost), bool) if allowed is None else np.asarray(allowed, bool)
    seeds = [_greedy(flat[i : i + chunk], arm, against, cost, budget, allowed) for i in range(0, len(flat), chunk)]
    return np.concatenate(seeds).astype(int).reshape(*chance.shape[:-2], len(cost))


def _greedy(
    chance: np.ndarray, arm: np.ndarray, against: np.ndarray, cost: np.ndarray, budget: float, allowed: np.ndarray
) -> np.ndarray:
    """`allocate` for chance [studies, findings, k]."""
    studies, n_find, n_k = chance.shape
    seeds = np.zeros((studies, len(cost)), np.int16)
    spent = np.zeros(studies)
    k, rows = np.arange(n_k, dtype=np.int16), np.arange(studies)
    # raises[j, x]: a raise of finding j raises arm x (one of its two)
    raises = (np.arange(len(cost))[None] == arm[:, None]) | (np.arange(len(cost))[None] == against[:, None])
    while True:
        pairs = np.minimum(seeds[:, arm], seeds[:, against])  # [S, J]
        now = np.take_along_axis(chance, pairs[..., None], -1)[..., 0].sum(-1)  # [S]
        # candidate (j, k): both of finding j's arms raised to at least k seeds
        raised = np.maximum(seeds[:, None, None, :], k[None, None, :, None])  # [S, 1, K, A]
        after = np.where(raises[None, :, None, :], raised, seeds[:, None, None, :])  # [S, J, K, A]
        added = after - seeds[:, None, None, :]
        extra = np.where(added > 0, added * cost, 0.0).sum(-1)  # [S, J, K]; an arm not raised costs nothing
        new_pairs = np.minimum(after[..., arm], after[..., against])  # [S, J, K, J]
        got = np.take_along_axis(chance[:, None, None], new_pairs[..., None], -1)[..., 0].sum(-1)
        gain = got - now[:, None, None]
        blocked = ((added > 0) & ~allowed).any(-1)  # [S, J, K]: it would lift an arm no open finding needs
        ok = (extra > 0) & (spent[:, None, None] + extra <= budget + 1e-9) & (gain > 1e-9) & ~blocked
        ratio = np.where(ok, gain / np.where(extra > 0, extra, 1.0), -np.inf).reshape(studies, -1)
        best = ratio.argmax(-1)
        go = np.isfinite(ratio[rows, best])
        if not go.any():
            return seeds
        j, kk = np.unravel_index(best, (n_find, n_k))
        seeds = np.where(go[:, None], after[rows, j, kk], seeds)
        spent = np.where(go, spent + extra[rows, j, kk], spent)
