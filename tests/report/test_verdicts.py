"""The study statistics (report/verdicts.py, report/stats.py): each formula against an independent
oracle (statsmodels' OLS of value ~ arm + seed, its TOST and t-test power, its Holm; scipy's paired
t test), then the verdict code itself on thousands of simulated studies -- 16 arms whose seeds are
correlated, 16 claims -- for its error rates: family-wise false differences with no true effect,
false equivalences with true effects of at least the margin, the power seeds-needed promises, and
the top-up rule's error rate."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as st
from statsmodels.formula.api import ols
from statsmodels.stats.anova import anova_lm
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import ttost_paired

from dalle_ablate.report import verdicts as V
from dalle_ablate.report.stats import blocked_residual, holm, outlying_arms, paired, power, t_tests


def frame(y: np.ndarray) -> pd.DataFrame:
    arms, seeds = np.nonzero(np.isfinite(y))
    return pd.DataFrame({"y": y[arms, seeds], "arm": [f"a{i:02d}" for i in arms], "seed": seeds})


@pytest.mark.parametrize("gap", [None, (2, 1)])
def test_the_pooled_residual_is_statsmodels_ols_of_value_on_arm_and_seed(gap):
    rng = np.random.default_rng(1)
    y = rng.normal(size=(1, 5)) + rng.normal(size=(6, 1)) + 0.3 * rng.normal(size=(6, 5))
    if gap:
        y[gap] = np.nan  # a run that did not finish: least squares, not the closed form
    s2, df, share = blocked_residual(y)
    fit = ols("y ~ C(arm) + C(seed)", frame(y)).fit()
    assert s2 == pytest.approx(fit.mse_resid, rel=1e-10) and df == fit.df_resid
    if gap is None:  # the seed's share from the ANOVA mean squares: E[MS_seed] = s_res^2 + arms s_seed^2
        table = anova_lm(fit)
        ms_seed = table.loc["C(seed)", "mean_sq"]
        seed_var = (ms_seed - fit.mse_resid) / 6
        assert share == pytest.approx(seed_var / (seed_var + fit.mse_resid), rel=1e-10)
    # a batch of tables gives each table's own fit; a seed no arm ran is no seed
    batch = np.stack([y, y * 2, np.concatenate([y, np.full((6, 2), np.nan)], 1)[:, :5]])
    s2b, dfb, _ = blocked_residual(batch)
    assert s2b[0] == pytest.approx(s2) and s2b[1] == pytest.approx(4 * s2) and dfb[0] == df
    wider = np.concatenate([y, np.full((6, 2), np.nan)], 1)
    assert blocked_residual(wider)[0] == pytest.approx(s2) and blocked_residual(wider)[1] == df


def test_a_pooled_claim_s_interval_and_tests_are_the_ols_contrast():
    rng = np.random.default_rng(2)
    arms, seeds = 8, 4
    y = rng.normal(size=(1, seeds)) + 0.2 * rng.normal(size=(arms, seeds)) + np.arange(arms)[:, None] * 0.05
    margin = 0.1
    r = V.analyse({"m": y}, [V.Claim("m", 3, 0, 1, margin)], check=1e-12, outlier=1e-12)  # pooled, whatever the check
    assert r["pooled"][0]
    fit = ols("y ~ C(arm) + C(seed)", frame(y)).fit()
    contrast = "C(arm)[T.a03] = 0"  # a00 is the reference level: the contrast a03 - a00
    test = fit.t_test(contrast)
    assert r["d"][0] == pytest.approx(np.ravel(test.effect)[0]) and r["se"][0] == pytest.approx(np.ravel(test.sd)[0])
    assert r["p_zero"][0] == pytest.approx(np.ravel(test.pvalue)[0])
    lo, hi = fit.conf_int().loc["C(arm)[T.a03]"]
    assert (r["low"][0], r["high"][0]) == pytest.approx((lo, hi))
    # TOST: the larger of the one-sided p-values of the contrast against -margin and +margin
    t_lo = float(fit.t_test("C(arm)[T.a03] = -0.1").tvalue[0, 0])
    t_hi = float(fit.t_test("C(arm)[T.a03] = 0.1").tvalue[0, 0])
    assert r["p_tost"][0] == pytest.approx(max(st.t.sf(t_lo, fit.df_resid), st.t.cdf(t_hi, fit.df_resid)))
    assert r["p_beyond"][0] == pytest.approx(st.t.sf(t_hi, fit.df_resid))


def test_a_claim_judged_on_its_own_variance_is_the_paired_t_test_and_tost():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=5), rng.normal(size=5)
    y = np.stack([a, b, rng.normal(size=5)])
    r = V.analyse({"m": y}, [V.Claim("m", 0, 1, -1, 0.4)], check=1.0)  # check = 1: never pooled
    assert not r["pooled"][0] and r["df"][0] == 4
    ci = st.ttest_rel(a, b).confidence_interval(0.95)
    assert (r["low"][0], r["high"][0]) == pytest.approx((ci.low, ci.high))
    assert r["p_zero"][0] == pytest.approx(st.ttest_rel(a, b).pvalue)
    assert r["p_tost"][0] == pytest.approx(ttost_paired(a, b, -0.4, 0.4)[0])
    d, var, n, rho = paired(a, b)
    assert (d, var, n) == pytest.approx((np.mean(a - b), np.var(a - b, ddof=1), 5)) and rho == pytest.approx(np.corrcoef(a, b)[0, 1])


def test_holm_power_and_seeds_needed_agree_with_statsmodels():
    rng = np.random.default_rng(4)
    p = rng.uniform(0, 0.02, size=(6, 16)) ** rng.uniform(0.5, 2, size=(6, 1))  # multipletests gc.collect()s: few rows
    for row, mine in zip(p, holm(p, 0.05)):
        assert (mine == multipletests(row, 0.05, method="holm")[0]).all()
    for n, df in ((4, 45), (10, 150), (6, 5)):
        assert power(n, 0.5, 0.4, 0.01, df) == pytest.approx(TTestPower().power(0.5 / 0.4, n, 0.01, df=df))
    # seeds-needed: the first n at which the procedure's power reaches 80 %, from the noise and margin only
    n = V.seeds_needed(0.3, 0.4, 16, 16)
    pw = lambda k: (1 - V.CHECK) * power(k, 0.4, 0.3 * np.sqrt(2), 0.05 / 16, 15 * (k - 1)) + \
        V.CHECK * power(k, 0.4, 0.3 * np.sqrt(2), 0.05 / 16, k - 1)
    assert pw(n) >= 0.8 > pw(n - 1)
    assert V.seeds_needed(np.nan, 0.4, 16, 16) == 0 and V.seeds_needed(1.0, 0.001, 16, 16) == V.MAX_SEEDS + 1


def test_t_tests_take_the_predicted_side():
    p = t_tests(np.array([0.5, -0.5]), 0.1, 20, 0.2, np.array([1, -1]))
    assert p["beyond"] == pytest.approx([st.t.sf(3.0, 20)] * 2) and p["zero"] == pytest.approx([2 * st.t.sf(5.0, 20)] * 2)


# ---- calibration: the verdict code on simulated studies ----

ARMS, CLAIMS, RHO, SD = 16, 16, 0.8, 1.0  # a study's shape; rho: the seed's share of one run's variance
STUDIES = 4000


def mc_bound(rate: float, n: int = STUDIES) -> float:
    """The rate plus 3 Monte-Carlo standard errors: a simulated rate above it is a real excess."""
    return rate + 3 * np.sqrt(rate * (1 - rate) / n)


def simulate(rng, seeds: int, effects: np.ndarray, studies: int = STUDIES, unshared: int | None = None) -> np.ndarray:
    """values[study, arm, seed]: a seed effect every arm shares (variance RHO) plus each run's own
    noise; arm i > 0 shifted by effects[i - 1]; `unshared`: an arm whose seed effect is its own."""
    y = rng.normal(0, SD * np.sqrt(RHO), (studies, 1, seeds)) + rng.normal(0, SD * np.sqrt(1 - RHO), (studies, ARMS, seeds))
    if unshared is not None:
        y[:, unshared] = rng.normal(0, SD * np.sqrt(RHO), (studies, seeds)) + rng.normal(0, SD * np.sqrt(1 - RHO), (studies, seeds))
    y[:, 1:] += np.asarray(effects, float)[None, :, None]
    return y


def claims(margin: float, sides=None) -> list[V.Claim]:
    """15 arms against the baseline (arm 0), and one pair of arms, all predicting 'higher'
    unless `sides` says otherwise."""
    sides = sides if sides is not None else [1] * CLAIMS
    pairs = [(i, 0) for i in range(1, ARMS)] + [(2, 1)]
    return [V.Claim("m", a, b, s, margin) for (a, b), s in zip(pairs, sides)]


DIFFERENCE = (V.REPRODUCED, V.SMALLER, V.CONTRADICTED)


@pytest.mark.parametrize("seeds", [3, 6])
def test_with_no_true_effect_the_family_wise_rate_of_a_false_difference_is_5_percent(seeds):
    rng = np.random.default_rng(10 + seeds)
    y = simulate(rng, seeds, np.zeros(ARMS - 1))
    sides = rng.choice([-1, 1], CLAIMS)
    v = V.analyse({"m": y}, claims(0.5, sides))["verdict"]
    rate = np.isin(v, DIFFERENCE).any(-1).mean()
    assert rate <= mc_bound(0.05)
    assert rate > 0.005  # the procedure does use its error budget: not a test that never rejects


@pytest.mark.parametrize("seeds", [3, 8])
def test_with_true_effects_of_at_least_the_margin_a_false_equivalence_is_5_percent(seeds):
    rng = np.random.default_rng(20 + seeds)
    margin = 1.5  # wide enough that equivalence is within reach at these seeds (the second check)
    effects = margin * rng.choice([1.0, 1.0, 1.5], ARMS - 1) * rng.choice([-1, 1], ARMS - 1)  # many at exactly Δ
    y = simulate(rng, seeds, effects)
    v = V.analyse({"m": y}, claims(margin))["verdict"]
    truth = np.append(effects, effects[1] - effects[0])  # the pair's (arm 2 vs arm 1) true difference
    assert (np.abs(truth[:-1]) >= margin).all()
    false_eq = (v == V.EQUIVALENT) & (np.abs(truth) >= margin)
    assert false_eq.any(-1).mean() <= mc_bound(0.05)
    # the same studies with no effect find equivalence often: the test can pass when it should
    v0 = V.analyse({"m": simulate(rng, seeds, np.zeros(ARMS - 1))}, claims(margin))["verdict"]
    assert (v0 == V.EQUIVALENT).mean() > (0.5 if seeds == 8 else 0.05)


def test_a_true_effect_of_the_margin_at_the_printed_seeds_needed_is_found_80_percent_of_the_time():
    rng = np.random.default_rng(30)
    margin = 0.5
    residual_sd = SD * np.sqrt(1 - RHO)
    n = V.seeds_needed(residual_sd, margin, ARMS, CLAIMS)
    assert 4 <= n <= 30
    effects = np.zeros(ARMS - 1)
    effects[0] = margin  # claim 0 is true at exactly Δ, the other 15 null
    v = V.analyse({"m": simulate(rng, int(n), effects)}, claims(margin))["verdict"][:, 0]
    found = np.isin(v, (V.REPRODUCED, V.SMALLER)).mean()
    assert abs(found - 0.80) <= 0.05


def test_the_top_up_rule_keeps_the_family_wise_rate():
    """Stage 1 at 3 seeds; seeds-needed from its pooled noise alone; the study topped up to it
    (at most 10 seeds here) and judged on all its seeds: false differences stay at 5 %."""
    rng = np.random.default_rng(40)
    most, margin = 10, 1.0  # the rule then asks for 4 to 10 seeds, most often 6 to 8
    y = simulate(rng, most, np.zeros(ARMS - 1))
    s2, _, _ = blocked_residual(y[..., :3])
    target = np.minimum(V.seeds_needed(np.sqrt(s2), margin, ARMS, CLAIMS, max_seeds=most), most)
    target = np.maximum(target, 3)
    assert len(np.unique(target)) >= 6 and (target == most).mean() < 0.2  # the rule moves with the noise
    y[np.arange(most)[None, None, :] >= target[:, None, None] + np.zeros((1, ARMS, 1))] = np.nan
    v = V.analyse({"m": y}, claims(margin, rng.choice([-1, 1], CLAIMS)))["verdict"]
    assert np.isin(v, DIFFERENCE).any(-1).mean() <= mc_bound(0.05)
    assert V.topup_seeds([4, 9, 0], 3) == 9 and V.topup_seeds([2], 5) == 5 and V.topup_seeds([500], 3, cap=40) == 40


def test_an_arm_whose_seeds_are_not_shared_is_judged_on_its_own_variance():
    """An arm drawing its own initialisation from the shared key (other parameter shapes): its
    claim's difference varies 5x more than the pool says; the checks catch it far more often
    than they set aside an arm like the others."""
    rng = np.random.default_rng(50)
    y = simulate(rng, 5, np.zeros(ARMS - 1), studies=2000, unshared=5)
    r = V.analyse({"m": y}, claims(0.5))
    assert (~r["pooled"][:, 4]).mean() > 0.6 and (~r["pooled"][:, [0, 1, 2, 3, 5, 6]]).mean() < 0.2
    assert outlying_arms(y)[:, 5].mean() > 5 * outlying_arms(y)[:, 1].mean()


def test_the_outlier_check_holds_its_level_when_only_some_arms_have_values():
    """A metric measured on a few arms only (the stress runs' LR sensitivity): under the null, each
    arm is flagged at the check's level, its deviation from the mean of the arms that have values
    scaled by those arms' count, not the study's."""
    rng = np.random.default_rng(3)
    sims, arms, seeds, present = 4000, 12, 3, 3
    y = rng.normal(size=(sims, 1, seeds)) + rng.normal(size=(sims, arms, seeds))
    y[:, present:, :] = np.nan
    flagged = outlying_arms(y, 0.01)[:, :present].mean()
    assert flagged <= 0.01 + 3 * np.sqrt(0.01 * 0.99 / (sims * present)), flagged


@pytest.mark.parametrize("side", [1, -1])
def test_a_detected_difference_inside_the_margin_is_no_meaningful_effect_on_either_side(side):
    """TOST passes and the difference is told from 0: "equivalent" whether it lies on the predicted
    side or the other (a difference smaller than Δ is no effect in either direction)."""
    rng = np.random.default_rng(0)
    seeds = 12
    base = rng.normal(0, 1, seeds)  # the seeds' shared part, far larger than the arms' own noise
    t = np.stack([base + rng.normal(0, 1e-3, seeds), base + 0.01 * side + rng.normal(0, 1e-3, seeds),
                  base + rng.normal(0, 1e-3, seeds)])
    r = V.analyse({"m": t}, [V.Claim("m", 1, 0, 1, 0.1)])
    assert r["p_zero"][0] < 1e-6 and r["p_tost"][0] < 1e-6
    assert r["verdict"][0] == V.EQUIVALENT
