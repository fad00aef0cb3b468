"""A study as the statistics engine's calibration sees it (stats/calibration.py, stats/efficiency.py):
its structure, from its file, and a page's observed effects and noise, read back from the page."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from scipy import stats as st

from dalle_ablate.metrics import STUDY
from dalle_ablate.report.study_file import study_arms
from dalle_ablate.stats import calibration as cal


def calibration_structure(study_file: Path) -> cal.Structure:
    """A study file's structure: the arms its experiment preset runs with the seeds it sweeps for
    the metrics of its own runs; its stress plan's arms and seeds for the metrics judged on the
    stress runs (report/stress.py): what stats/calibration.py simulates studies of."""
    from dalle_ablate.report.study_file import load_stress, load_study, swept_seeds

    study = load_study(study_file)
    plan = load_stress(study_file)
    given = {f.metric for f in study.findings if STUDY[f.metric].reads == "given"}  # measured on the stress runs
    stress_only = {a for f in study.findings if f.metric in given for a in (f.arm, f.against)} - {
        a for f in study.findings if f.metric not in given for a in (f.arm, f.against)
    }
    # the arms the study's own runs measure: its preset's, and any other its findings on them name
    arms = [a for a in study_arms(study, {}) if a not in stress_only or a == study.baseline]
    n = len(swept_seeds(study.experiment, []) or [0])
    pools, seeds = {}, {}
    for f in study.findings:
        elsewhere = STUDY[f.metric].reads == "given"
        pools[f.metric] = plan.arms if elsewhere and plan is not None else arms
        seeds[f.metric] = len(plan.seeds) if elsewhere and plan is not None else n
    return cal.Structure(
        pools,
        seeds,
        [(f.metric, f.arm, f.against) for f in study.findings],
        tuple(m for m in pools if STUDY[m].reads != "given"),
    )


def page_scenario(s: cal.Structure, page: str, margin_share: float = 0.02) -> tuple[cal.Scenario, np.ndarray]:
    """A study page's observed effects and noise as a scenario in Δ units: differences from the summary,
    eval-loss arm spreads from the noise table (Δ = `margin_share` of the baseline's mean loss), other
    metrics' sd from their 95 % intervals. Returns (the scenario, which claims the page tested)."""
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
    return cal.Scenario(
        "the page's observed effects and noise", rho=0.0, effects=tuple(effects), spreads=spreads
    ), np.array(tested)
