"""Two stages against one at equal runs, in a simulated study (docs/statistics.md, "Studies in
stages"): the budget rule (stats/allocation.py) against the fixed design, on the structures and
simulations of stats/calibration.py. benchmarks/verdict_calibration.py prints its table."""

from __future__ import annotations

import numpy as np

from dalle_ablate.stats import verdicts as V
from dalle_ablate.stats.calibration import STAGE2_CAP, Scenario, Structure, simulate, staged


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
