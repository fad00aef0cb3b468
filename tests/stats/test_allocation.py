"""Stage 2's seeds by the declared budget rule (stats/allocation.py): each finding's chance to
settle against a simulation of the real stage 2 -- paired t tests on new seeds, combined with stage
1 by the inverse-normal test at the boundaries of stats/stages.py -- and the greedy rule's
properties: it keeps to its budget, spends nothing on an arm no open finding needs, raises an arm
shared by two findings once for both, and weighs an arm's cost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dalle_ablate.stats import allocation as A
from dalle_ablate.stats import stages as S
from dalle_ablate.stats import verdicts as V

COMBINATION = S.Combination()


def scores(d: float, se: float, df: float, margin: float) -> dict:
    """Stage 1's one-sided scores of a finding, as stats/stages.py computes them."""
    return {
        "up": S.stage_z(d, se, df),
        "down": S.stage_z(-d, se, df),
        "above": S.stage_z(d, se, df, -margin),
        "below": S.stage_z(-d, se, df, -margin),
    }


def simulated(z1: dict, true: float, sd: float, margin: float, k: int, left: int, n: int = 100_000):
    """The oracle: (P(the difference test rejects by look 2), P(both of TOST's tests do)) over n
    simulated stage 2s of k seeds, each a paired t test made normal and combined with stage 1."""
    rng = np.random.default_rng(k)
    x = rng.normal(true, sd, (n, k))
    m, se = x.mean(1), x.std(1, ddof=1) / math.sqrt(k)
    c_diff = S.boundaries(V.ALPHA / (2 * left), COMBINATION.w1**2, COMBINATION.kind)[1]
    c_eq = S.boundaries(V.ALPHA / left, COMBINATION.w1**2, COMBINATION.kind)[1]
    past = lambda z, z2, c: S.combined_z(z, z2, COMBINATION.w1) >= c  # noqa: E731
    differs = past(z1["up"], S.stage_z(m, se, k - 1), c_diff) | past(z1["down"], S.stage_z(-m, se, k - 1), c_diff)
    equivalent = past(z1["above"], S.stage_z(m, se, k - 1, -margin), c_eq) & past(
        z1["below"], S.stage_z(-m, se, k - 1, -margin), c_eq
    )
    return differs.mean(), equivalent.mean(), (differs | equivalent).mean()


@pytest.mark.parametrize("k", [2, 3, 8, 15])
def test_the_chance_of_a_difference_is_the_simulated_stage_2s(k):
    """A margin too small for equivalence: the chance is the difference test's, exact (the
    noncentral t of k seeds), where a simulation of the stage-2 t tests puts it."""
    z1 = scores(0.8, 0.5, 3, 1e-3)
    differs, _, _ = simulated(z1, 0.8, 1.0, 1e-3, k, left=3)
    got = float(A.settle_chance(z1, 0.8, 1.0, 1e-3, k, 3, COMBINATION))
    assert got == pytest.approx(differs, abs=4 * math.sqrt(differs * (1 - differs) / 100_000) + 1e-4)


@pytest.mark.parametrize("k", [4, 12])
def test_the_chance_of_equivalence_is_at_most_the_simulated_one(k):
    """No difference and a wide margin: equivalence is what settles it, and the chance (Fréchet's
    lower bound for TOST's two tests) is not above the simulation's, and not far below it."""
    z1 = scores(0.05, 0.6, 3, 1.0)
    _, _, settled = simulated(z1, 0.0, 1.2, 1.0, k, left=1)  # 0.39 at 4 seeds, 0.92 at 12
    got = float(A.settle_chance(z1, 0.0, 1.2, 1.0, k, 1, COMBINATION))
    tol = 4 * math.sqrt(settled * (1 - settled) / 100_000) + 1e-4
    assert settled - 0.1 <= got <= settled + tol


def test_a_finding_without_a_margin_can_still_settle_by_its_difference():
    """No margin (NaN, verdicts.Comparison's default): no equivalence, the difference test alone."""
    z1 = scores(0.8, 0.5, 3, np.nan)
    got = A.settle_chance(z1, 0.8, 1.0, np.nan, 8, 3, COMBINATION)
    assert got == pytest.approx(A.settle_chance(scores(0.8, 0.5, 3, 1e-9), 0.8, 1.0, 1e-9, 8, 3, COMBINATION), abs=1e-6)
    assert 0.2 < got < 1


def test_fewer_than_two_seeds_cannot_settle_and_more_seeds_settle_more_often():
    z1 = scores(0.8, 0.5, 3, 0.2)
    chance = A.settle_chance(z1, 0.8, 1.0, 0.2, np.arange(0, 30), 4, COMBINATION)
    assert chance[0] == chance[1] == 0.0
    assert (np.diff(chance[2:]) > 0).all() and chance[-1] < 1.0


def table(*rising: float, k: int = 13) -> np.ndarray:
    """Settle chances [findings, k]: finding j's rising from 0 at 2 seeds to rising[j] at k - 1."""
    out = np.zeros((len(rising), k))
    for j, top in enumerate(rising):
        out[j, 2:] = top * (1 - np.exp(-np.arange(k - 2) / 3)) / (1 - np.exp(-(k - 3) / 3))
    return out


def test_the_rule_keeps_to_its_budget_and_spends_nothing_where_no_finding_is_open():
    """Arms 0 (the baseline), 1, 2, 3; findings 1-0 and 2-0 open, 3-0 settled at stage 1 (chance 0)."""
    chance = table(0.9, 0.6, 0.0)
    cost = np.array([1.0, 1.0, 1.0, 1.0])
    for budget in (4, 9, 20, 60):
        seeds = A.allocate(chance, np.array([1, 2, 3]), np.array([0, 0, 0]), cost, budget)
        assert (seeds * cost).sum() <= budget
        assert seeds[3] == 0
        assert seeds[0] >= max(seeds[1], seeds[2])  # a pair is both arms' seeds: the baseline has the most
    assert A.allocate(chance, np.array([1, 2, 3]), np.array([0, 0, 0]), cost, 1).tolist() == [0, 0, 0, 0]


def test_a_shared_arm_is_raised_once_for_both_of_its_findings():
    """Two equal findings on the same baseline: 3k runs give both k pairs (not 2k runs for one)."""
    seeds = A.allocate(table(0.8, 0.8), np.array([1, 2]), np.array([0, 0]), np.ones(3), 18)
    assert seeds.tolist() == [6, 6, 6]


def test_a_costlier_arm_gets_fewer_seeds():
    """Two equal findings, one on an arm whose seed costs three times as much."""
    seeds = A.allocate(table(0.8, 0.8), np.array([1, 2]), np.array([0, 0]), np.array([1.0, 1.0, 3.0]), 24)
    assert seeds[1] > seeds[2]


def test_the_rule_over_stage_1_tables_adds_seeds_only_to_open_findings_of_its_own_runs():
    """`plan` on simulated stage-1 tables: a finding far beyond 0 settles at look 1 and its arm gets
    nothing; a close one gets seeds; one judged on other runs (can_add False) gets none."""
    rng = np.random.default_rng(0)
    seed = rng.normal(size=4)
    values = np.stack(
        [seed, seed + 40 + rng.normal(size=4), seed + 1.0 + rng.normal(size=4), seed + rng.normal(size=4)]
    )
    comps = [V.Comparison("m", a, 0, 0.2) for a in (1, 2, 3)]
    seeds, open_ = A.plan(
        {"m": values}, comps, COMBINATION, [(1, 0), (2, 0), (3, 0)], [True, True, False], np.ones(4), 20, 10
    )
    assert open_.tolist() == [False, True, True]
    assert seeds[1] == 0 and seeds[3] == 0 and seeds[2] > 0 and seeds[0] >= seeds[2]
    assert seeds.sum() <= 20
