"""Two stages against one at equal runs, in a study simulated with a study page's own effects and
noise (docs/statistics.md, "Studies in stages"): issue 63's comparison of the budget rule
(report/allocation.py) with the fixed design, on the structures and simulations of
report/calibration.py. benchmarks/verdict_calibration.py prints its table."""

from __future__ import annotations

import re

import numpy as np
from scipy import stats as st

from dalle_ablate.report import verdicts as V
from dalle_ablate.report.calibration import STAGE2_CAP, Scenario, Structure, simulate, staged


def page_scenario(s: Structure, page: str, margin_share: float = 0.02) -> tuple[Scenario, np.ndarray]:
    """A study page's observed effects and noise as a scenario, in Δ units (the study's margins):
    each finding's difference from the summary table; the eval-loss spreads of its arms from the
    noise table (one run's sd over Δ, Δ = `margin_share` of the baseline's mean loss); on the other
    metrics, each claim's sd of a seed's difference from its 95 % interval (half-width sqrt(n) /
    t(0.975, n - 1)), split as an arm spread for the arm it is compared with (the smallest claim's
    over sqrt 2) and one for its arm. rho 0: the page's ρ run from -0.6 to 0.9. Returns (the scenario,
    which claims the page tested -- a number, not "untestable here")."""
    rows = re.findall(r"^\| [^|]+ \| [^|]+ \| [^|]+ \| ([^|]+) \| (\d+) / [^|]+ \|$", page, re.M)
    if len(rows) != len(s.claims):
        raise ValueError(f"the page's summary has {len(rows)} findings, its study {len(s.claims)}")
    effects, tested, sigma = [], [], {}
    for (cell, n), (metric, arm, against) in zip(rows, s.claims):
        got = re.fullmatch(r"\s*([-+\d.e]+) \[([-\d.e]+), ([-\d.e]+)\]\s*", cell)
        tested.append(got is not None)
        effects.append(float(got[1]) if got else 0.0)
        if got:
            sigma[arm, against, metric] = (
                (float(got[3]) - float(got[2])) / 2 * np.sqrt(int(n)) / st.t.ppf(0.975, int(n) - 1)
            )
    noise = {
        a: (mean, sd) for a, mean, sd in re.findall(r"^\| (\w+) \| \d+ \| ([\d.e-]+) \| ([\d.e-]+) \| \[", page, re.M)
    }
    delta = margin_share * float(noise[s.claims[0][2]][0])
    spreads: dict[str, dict[str, float]] = {m: {} for m in s.pools}
    for m in s.pools:
        if m == "eval_loss":
            spreads[m] = {a: float(sd) / delta for a, (_, sd) in noise.items()}
            continue
        mine = {(a, b): x for (a, b, mm), x in sigma.items() if mm == m}
        for (a, b), x in mine.items():
            base = min(y for (_, bb), y in mine.items() if bb == b) / np.sqrt(2)
            spreads[m][b] = base
            spreads[m][a] = float(np.sqrt(max(x**2 - base**2, (0.1 * base) ** 2)))
    return Scenario(
        "the page's observed effects and noise", rho=0.0, effects=tuple(effects), spreads=spreads
    ), np.array(tested)


def efficiency(rng, s: Structure, scenario: Scenario, studies: int, counted: np.ndarray, extra: int) -> list[tuple]:
    """Settled findings (among `counted`) per study, for designs of equal runs on the study's own
    runs: the fixed design at stage 1's seeds and at `extra` more per arm; two stages, stage 2 of
    `extra` seeds on every arm (declared) or of the same runs spent by the budget rule. Rows of
    (design, runs per study on average, settled findings on average, its Monte-Carlo se)."""
    n1 = min(s.seeds[m] for m in s.topped)
    arms = len(s.pools[s.topped[0]])
    comps = s.comparisons()
    rows = []
    for n in (n1, n1 + extra):
        out = V.analyse(simulate(rng, s, scenario, studies, {m: n for m in s.topped}), comps)["outcome"]
        settled = ((out != V.UNRESOLVED) & counted).sum(-1)
        rows.append((f"one stage, {n} seeds per arm", n * arms, settled.mean(), settled.std() / np.sqrt(studies)))
    for rule, name in (
        ("declared", f"two stages, {n1} + {extra} seeds on every arm"),
        ("budget", f"two stages, {n1} + {extra * arms} runs by the budget rule"),
    ):
        res, _, seeds2, _, _ = staged(rng, s, scenario, studies, 1.0, rule, max(extra, STAGE2_CAP), extra * arms)
        settled = ((res["differs2"] | res["equivalent2"]) & counted).sum(-1)
        rows.append((name, n1 * arms + seeds2.sum(-1).mean(), settled.mean(), settled.std() / np.sqrt(studies)))
    return rows
