"""The verdict engine (stats/) on simulated studies in the mega-variants study's own structure
(report/findings.py's calibration_structure: its 16 claims over four metrics, 16 arms at 3 seeds
and 6 stress arms at their seeds), every scenario of issue 49 -- arms 3x noisier than the others,
a seed effect not shared, spreads over a 12x range -- held to its target within 2 Monte-Carlo
standard errors; and the engine's outcomes in the page's words (report/prose.py)."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
from scipy import stats as st

from dalle_ablate.report import prose as P
from dalle_ablate.report.study_file import study_path
from dalle_ablate.report.scenarios import calibration_structure, page_scenario
from dalle_ablate.stats import calibration as cal
from dalle_ablate.stats import efficiency as E
from dalle_ablate.stats import verdicts as V


def test_outcomes_read_as_claims_and_as_a_variant_against_its_baseline():
    assert [P.VERDICTS[V.verdict(o, +1)] for o in range(len(P.OUTCOMES))] == [
        "reproduced",
        "reproduced, possibly smaller than Δ",
        "no meaningful effect (equivalent within ±Δ)",
        "contradicted (reversed)",
        "contradicted (reversed)",
        "not resolved",
        "untestable here",
    ]
    assert V.verdict(V.LOWER_BEYOND, -1) == V.REPRODUCED and V.verdict(V.HIGHER_BEYOND, -1) == V.CONTRADICTED
    assert P.against_baseline(V.LOWER_BEYOND, lower_is_better=True) == "better than the baseline by more than Δ"
    assert P.against_baseline(V.LOWER, lower_is_better=False) == "worse than the baseline"
    assert P.against_baseline(V.EQUIVALENT, True) == "equivalent to the baseline within ±Δ"


def test_the_study_structure_is_the_study_file_s():
    import yaml

    s = calibration_structure(study_path("mega-variants"))
    preset = yaml.safe_load((study_path("mega-variants").parents[2] / "conf/experiment/study_mega.yaml").read_text())
    study = yaml.safe_load(study_path("mega-variants").read_text())
    swept = preset["hydra"]["sweeper"]["params"]
    assert len(s.claims) == 16 and set(s.pools) == {"eval_loss", "step_time", "shapes_all", "lr_sensitivity"}
    from dalle_ablate.report.study_file import load_study, own_arms

    own = own_arms(load_study(study_path("mega-variants")))
    assert set(s.pools["eval_loss"]) == set(own) and s.seeds["eval_loss"] == len(swept["seed"].split(","))
    assert set(s.pools["lr_sensitivity"]) == {"sandwich", "normformer", "swish", "baseline", "deepnet", "postln"}
    assert s.seeds["lr_sensitivity"] == len(study["stress"]["seeds"])
    assert s.topped == ("eval_loss", "step_time", "shapes_all")
    # the simulated truth: a claim's difference is its arm's shift; a difference's sd as simulated
    rng = np.random.default_rng(5)
    sc = cal.Scenario("x", rho=0.5, noisier={"normformer": 3.0}, effects=tuple(range(16)))
    t = cal.simulate(rng, s, sc, 20000)
    for i, (m, a, b) in enumerate(s.claims):
        d = t[m][:, s.pools[m].index(a)] - t[m][:, s.pools[m].index(b)]
        assert d.mean() == pytest.approx(i, abs=0.05) and d.std() == pytest.approx(
            cal.difference_sd(s, sc, i), rel=0.03
        )


STUDY = calibration_structure(study_path("mega-variants"))


CHECKS = cal.checks(STUDY)


STUDIES = 4000


@pytest.mark.parametrize("check", CHECKS, ids=[c.label for c in CHECKS])
def test_the_engine_holds_every_scenario_of_the_study_s_structure(check):
    """benchmarks/verdict_calibration.py runs the same checks at more studies and writes the table
    on docs/statistics.md."""
    rng = np.random.default_rng(zlib.crc32(check.label.encode()))
    # the budget rule's studies a quarter as many: its greedy search is most of the check's time
    # (the tolerance is the Monte-Carlo error of the studies run)
    rate, n, seeds = cal.run(rng, STUDY, check, STUDIES // 4 if check.stages == "budget" else STUDIES)
    assert cal.holds(check, rate, n), (check.label, seeds, rate, cal.mc_se(rate, n))
    if check.measure == "false difference" and check.scenario.spread == 1 and not check.scenario.unshared:
        assert rate > 0.01  # the engine uses its error budget: not a test that never rejects


def test_peeking_and_adding_seeds_without_the_combination_test_is_what_the_simulation_catches():
    """The adaptive misuse of the staged rows (calibration.staged), judged by the fixed-design tests on
    all the seeds instead of the combination test: its family-wise rate of a false difference is
    beyond 5 % (issue 63 measured 8.0-8.6 % for a like rule), the combination test's within it."""
    rng = np.random.default_rng(63)
    _, final, seeds2, first, second = cal.staged(rng, STUDY, cal.Scenario("x", rho=0.5), STUDIES, 0.5, "adaptive")
    naive = cal.naive_after(first, second, STUDY.comparisons(0.5), seeds2).any(-1).mean()
    combined = final.any(-1).mean()
    assert naive > 0.05 + 2 * cal.mc_se(0.05, STUDIES)
    assert combined <= 0.05 + 2 * cal.mc_se(0.05, STUDIES)


def test_a_study_page_becomes_a_scenario_of_its_effects_and_noise():
    """report.scenarios.page_scenario on a page of the mega-variants study's shape: the summary's
    differences; eval loss's arm spreads from the noise table over Δ (2 % of the baseline's mean);
    another metric's from its claims' 95 % intervals."""
    s = cal.Structure(
        {"eval_loss": ["baseline", "a"], "shapes_all": ["baseline", "b"]},
        {"eval_loss": 4, "shapes_all": 4},
        [("eval_loss", "a", "baseline"), ("shapes_all", "b", "baseline"), ("eval_loss", "a", "baseline")],
        ("eval_loss", "shapes_all"),
    )
    page = "\n".join(
        [
            "| finding | claim (metric) | verdict | difference in Δ (95% CI) | seeds used / needed |",
            "|---|---|---|---|---|",
            "| one | a helps (eval_loss) | not resolved | +2.50 [-1.00, 6.00] | 4 / > 200 |",
            "| two | b helps (shapes_all) | not resolved | -1.00 [-3.00, 1.00] | 4 / 67 |",
            "| three | a is fast (eval_loss) | untestable here | – | 0 / – |",
            "",
            "| arm | seeds | final eval loss: mean | sd of one run | its 95% CI | scenes |",
            "|---|---|---|---|---|---|",
            "| baseline | 4 | 0.200 | 0.0120 | [0.01, 0.04] | 512 |",
            "| a | 4 | 0.180 | 0.00200 | [0.001, 0.007] | 512 |",
        ]
    )
    sc, tested = page_scenario(s, page)
    assert sc.effects == (2.5, -1.0, 0.0) and tested.tolist() == [True, True, False]
    assert sc.spreads["eval_loss"] == pytest.approx({"baseline": 0.012 / 0.004, "a": 0.002 / 0.004})
    sigma = 2.0 * math.sqrt(4) / st.t.ppf(0.975, 3)  # half-width 2 at 4 seeds: one seed's difference sd
    b = sc.spreads["shapes_all"]
    assert b["baseline"] == pytest.approx(sigma / math.sqrt(2)) and math.hypot(b["baseline"], b["b"]) == pytest.approx(
        sigma
    )
    with pytest.raises(ValueError, match="the page's summary has 2 findings, its study 3"):
        page_scenario(s, page.replace("| three |", "three"))


def test_the_designs_compared_at_equal_runs_spend_equal_runs():
    """efficiency.efficiency: one stage at n1 + extra seeds and stage 2 of extra seeds on every
    arm spend the same runs; the budget rule at most as many; each settles at least what one stage
    at n1 does, less its Monte-Carlo error."""
    s = calibration_structure(study_path("mega-variants"))
    effects = tuple([8.0, 2.0] + [0.0] * (len(s.claims) - 2))
    counted = np.array([m in s.topped for m, _, _ in s.claims])
    rows = E.efficiency(np.random.default_rng(2), s, cal.Scenario("x", effects=effects), 300, counted, 2)
    arms = len(s.pools[s.topped[0]])
    (_, r4, s4, e4), (_, r6, _, _), (_, declared, sd, ed), (_, budget, sb, eb) = rows
    assert r4 == 4 * arms and r6 == declared == 6 * arms and 4 * arms < budget <= 6 * arms
    assert sd >= s4 - 3 * (e4 + ed) and sb >= s4 - 3 * (e4 + eb)
