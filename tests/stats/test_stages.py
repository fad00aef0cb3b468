"""Two-stage designs (stats/stages.py): the boundaries against published values, each also
against a simulation of the two looks; the inverse-normal combination against the fixed-sample z
test it reduces to; Holm at each look against closed testing by brute force over every
intersection; the repeated confidence intervals against their test and their coverage; and a small
staged study whose finding settles at stage 2."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as st

from dalle_ablate.stats import stages as S
from dalle_ablate.stats import verdicts as V

# Published two-look boundaries, one-sided alpha 0.025, equal information (t1 = 0.5):
# * O'Brien & Fleming: 2.797, 1.977 -- Jennison & Turnbull 2000, Table 2.3 (C_B(2, 0.05) = 1.977,
#   the first look sqrt(2) times it); rpact's getDesignGroupSequential(kMax = 2, typeOfDesign = "OF")
#   and gsDesign's test.type = 1, sfu = "OF" print 2.7965, 1.9774;
# * Pocock: 2.178 at both looks -- Jennison & Turnbull 2000, Table 2.1 (C_P(2, 0.05) = 2.178);
#   rpact typeOfDesign = "P";
# * Lan & DeMets' O'Brien-Fleming-type spending: 0.00152 spent at the first look, boundaries 2.963,
#   1.969 -- rpact typeOfDesign = "asOF", gsDesign sfLDOF;
# * Lan & DeMets' Pocock-type spending: 2.157, 2.201 -- rpact typeOfDesign = "asP", gsDesign sfLDPocock.
PUBLISHED = {"OF": (2.797, 1.977), "P": (2.178, 2.178), "asOF": (2.963, 1.969), "asP": (2.157, 2.201)}


@pytest.mark.parametrize("kind", S.KINDS)
def test_two_look_boundaries_match_the_published_ones(kind):
    c1, c2 = S.boundaries(0.025, 0.5, kind)
    assert (c1, c2) == pytest.approx(PUBLISHED[kind], abs=1e-3)


def test_lan_demets_of_type_spends_what_is_published_at_half_the_information():
    assert S.spending(0.5, 0.025, "asOF") == pytest.approx(0.00152, abs=1e-5)
    assert S.spending(1.0, 0.025, "asOF") == pytest.approx(0.025) and S.spending(1.0, 0.025, "asP") == pytest.approx(
        0.025
    )


@pytest.mark.parametrize("kind", S.KINDS)
@pytest.mark.parametrize("t1, alpha", [(0.5, 0.025), (0.3, 0.025 / 16)])
def test_the_boundaries_spend_alpha_over_both_looks_in_a_simulation(kind, t1, alpha):
    """Independent of scipy's bivariate normal: two looks of a Brownian motion at information t1
    and 1, counted where either crosses."""
    rng = np.random.default_rng(7)
    n = 2_000_000
    z1 = rng.normal(size=n)
    z = math.sqrt(t1) * z1 + math.sqrt(1 - t1) * rng.normal(size=n)
    c1, c2 = S.boundaries(alpha, t1, kind)
    rate = ((z1 >= c1) | (z >= c2)).mean()
    assert rate == pytest.approx(alpha, abs=3 * math.sqrt(alpha / n))
    if kind.startswith("as"):
        assert (z1 >= c1).mean() == pytest.approx(S.spending(t1, alpha, kind), abs=3 * math.sqrt(alpha / n))


def test_the_inverse_normal_combination_is_the_pooled_z_test_at_weights_of_the_planned_sizes():
    """With known variance and weights sqrt(n_j / N) (Cui, Hung & Wang 1999 at the planned sizes),
    combining the two stages' z tests gives the z test of all the data."""
    rng = np.random.default_rng(3)
    n1, n2 = 4, 12
    x = rng.normal(0.3, 1.0, size=(50, n1 + n2))
    z1 = x[:, :n1].mean(1) * math.sqrt(n1)
    z2 = x[:, n1:].mean(1) * math.sqrt(n2)
    pooled = x.mean(1) * math.sqrt(n1 + n2)
    w1 = math.sqrt(n1 / (n1 + n2))
    assert S.combined_z(z1, z2, w1) == pytest.approx(pooled)
    assert S.inverse_normal(st.norm.sf(z1), st.norm.sf(z2), w1) == pytest.approx(st.norm.sf(pooled))


def test_stage_wise_t_tests_combine_to_an_exact_level_whatever_stage_1_made_stage_2():
    """Stage 2's size chosen from stage 1's difference (more seeds the closer it came): the
    combined test of t p-values still rejects alpha of the time under the null."""
    rng = np.random.default_rng(5)
    n, alpha, w1 = 200_000, 0.025, math.sqrt(0.5)
    x1 = rng.normal(size=(n, 4))
    t1 = x1.mean(1) / (x1.std(1, ddof=1) / 2)
    z1 = S.stage_z(x1.mean(1), x1.std(1, ddof=1) / 2, 3)
    assert z1 == pytest.approx(st.norm.isf(st.t.sf(t1, 3)))
    n2 = np.where(z1 > 1.0, 2, np.where(z1 > 0, 8, 3))  # a data-driven stage 2
    z2 = np.empty(n)
    for k in np.unique(n2):
        rows = n2 == k
        x2 = rng.normal(size=(rows.sum(), k))
        z2[rows] = S.stage_z(x2.mean(1), x2.std(1, ddof=1) / math.sqrt(k), k - 1)
    rate = (S.inverse_normal(st.norm.sf(z1), st.norm.sf(z2), w1) <= alpha).mean()
    assert rate == pytest.approx(alpha, abs=3 * math.sqrt(alpha / n))
    # the pooled t test on all the seeds after the same choice is not exact: what the combination avoids
    naive = np.empty(n)
    for k in np.unique(n2):
        rows = n2 == k
        x = np.concatenate([x1[rows], rng.normal(size=(rows.sum(), k))], 1)
        naive[rows] = st.ttest_1samp(x, 0.0, axis=1, alternative="greater").pvalue
    assert (naive <= alpha).mean() > alpha + 3 * math.sqrt(alpha / n)


def closed_test(z1, z2, alpha, combination, split, single=None):
    """Closed testing by brute force: H_i is rejected where every intersection containing it is,
    each intersection by Bonferroni over its own members' tests at alpha / |I| -- two-look tests, or
    for a hypothesis of one look (`single`) its fixed-design test, z1 past Φ⁻¹(1 - alpha / |I|)."""
    k = z1[0].shape[-1]
    rejects = {}
    for size in range(1, k + 1):
        level = alpha / (size * split)
        c = S.boundaries(level, combination.w1**2, combination.kind)
        for i in range(k):
            if single is not None and single[i]:
                once = [a[i] >= st.norm.isf(level) for a in z1]
                by = [(x, x) for x in once]
            else:
                by = [S.reject_by_look(a[i], b[i], combination.w1, c) for a, b in zip(z1, z2)]
            combine = any if split == 2 else all
            rejects[i, size] = (combine(b[0] for b in by), combine(b[1] for b in by))
    out = []
    for look in (0, 1):
        out.append(
            [
                all(
                    any(rejects[j, len(subset)][look] for j in subset)
                    for size in range(1, k + 1)
                    for subset in itertools.combinations(range(k), size)
                    if i in subset
                )
                for i in range(k)
            ]
        )
    return out


@pytest.mark.parametrize("kind", ["asOF", "P"])
@pytest.mark.parametrize("split", [1, 2])
def test_holm_at_each_look_is_the_closed_test_of_the_findings_sequential_tests(kind, split):
    rng = np.random.default_rng(11)
    combination = S.Combination(math.sqrt(0.4), kind)
    for _ in range(60):
        sides = [(rng.normal(1.5, 1.2, 5), rng.normal(1.5, 1.2, 5)) for _ in range(2)]
        got1, got2 = S.holm_by_look(sides, 0.05, combination, np.ones(5, bool), split)
        want1, want2 = closed_test([s[0] for s in sides], [s[1] for s in sides], 0.05, combination, split)
        assert got1.tolist() == want1 and got2.tolist() == want2
        # a family that mixes hypotheses of one look (judged on stress runs) with two-look ones
        single = np.array([True, False, False, True, False])
        got1, got2 = S.holm_by_look(sides, 0.05, combination, np.ones(5, bool), split, single)
        want1, want2 = closed_test([s[0] for s in sides], [s[1] for s in sides], 0.05, combination, split, single)
        assert got1.tolist() == want1 and got2.tolist() == want2


def test_repeated_intervals_agree_with_their_test_and_cover_at_both_looks():
    combination = S.Combination()
    c1, c2 = S.boundaries(0.025, 0.5, combination.kind)
    (lo1, hi1), (lo2, hi2) = S.repeated_interval(1.0, 0.3, 3, 0.8, 0.25, 5, combination, 0.025)
    # at its ends the combined statistic is at the boundary, each side
    for end, sign in ((lo2, 1), (hi2, -1)):
        z = S.combined_z(S.stage_z(1.0, 0.3, 3, end), S.stage_z(0.8, 0.25, 5, end), combination.w1)
        assert z == pytest.approx(sign * c2, abs=1e-6)
    assert S.stage_z(1.0 - lo1 + 1.0, 0.3, 3, 1.0) == pytest.approx(c1)  # look 1's half-width on its t
    rng = np.random.default_rng(2)
    covered, n = 0, 400
    for _ in range(n):
        a, b = rng.normal(0.4, 1.0, 4), rng.normal(0.4, 1.0, 6)
        i1, i2 = S.repeated_interval(
            a.mean(), a.std(ddof=1) / 2, 3, b.mean(), b.std(ddof=1) / math.sqrt(6), 5, combination, 0.025
        )
        covered += i1[0] <= 0.4 <= i1[1] and i2[0] <= 0.4 <= i2[1]
    assert covered / n >= 0.95 - 2 * math.sqrt(0.05 * 0.95 / n)


def test_a_small_staged_study_settles_a_finding_at_stage_2():
    """Two findings, 3 arms: at stage 1 (3 seeds) neither is settled; stage 2 adds 6 seeds to the
    arms of the first, and Holm by look 2 finds its difference, while the second, with no stage 2,
    stays as stage 1 left it."""
    rng = np.random.default_rng(1)
    seed1, seed2 = rng.normal(size=3), rng.normal(size=6)
    first = np.stack([seed1, seed1 + 0.6 + 0.3 * rng.normal(size=3), seed1 + 0.3 * rng.normal(size=3)])
    second = np.full((3, 6), np.nan)
    second[0], second[1] = seed2, seed2 + 0.6 + 0.3 * rng.normal(size=6)
    comps = [V.Comparison("m", 1, 0, 0.2), V.Comparison("m", 2, 0, 0.2)]
    combination = S.Combination(math.sqrt(1 / 3), "asOF")
    r = S.analyse_staged({"m": first}, {"m": second}, comps, combination)
    assert not r["differs1"].any() and r["differs2"].tolist() == [True, False]
    # the oracle: scipy's paired t tests per stage, combined, against the asOF boundaries of Holm's
    # first step (alpha / 2 per side over 2 findings) and its second
    p1 = st.ttest_rel(first[1], first[0], alternative="greater").pvalue
    p2 = st.ttest_rel(second[1], second[0], alternative="greater").pvalue
    z = st.norm.isf(S.inverse_normal(p1, p2, combination.w1))
    assert z >= S.boundaries(0.05 / 4, 1 / 3, "asOF")[1]
    assert st.norm.isf(p1) < S.boundaries(0.05 / 2, 1 / 3, "asOF")[0]
