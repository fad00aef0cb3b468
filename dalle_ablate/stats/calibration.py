"""Simulated studies with known truth, in a study file's own structure, judged by the verdict engine itself
(docs/statistics.md, "Calibration"). Arm a, seed s: y = mu[a] + m[a] * (sqrt(rho) * z[s] + sqrt(1 - rho) * e[a, s]),
z and e standard normal; Δ is one unit (the sd of one run's noise at m = 1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from dalle_ablate.stats import allocation as A
from dalle_ablate.stats import stages as S
from dalle_ablate.stats import verdicts as V


@dataclass
class Structure:
    """What a study judges: per metric the arms measured on it and their seeds, and its claims."""

    pools: dict[str, list[str]]  # metric -> the arms that have values of it
    seeds: dict[str, int]  # metric -> seeds per arm
    claims: list[tuple[str, str, str]]  # (metric, arm, against), in the study file's order
    topped: tuple[str, ...]  # the metrics a top-up adds seeds to: those of the study's own runs

    def comparisons(self, margin: float = 1.0) -> list[V.Comparison]:
        return [V.Comparison(m, self.pools[m].index(a), self.pools[m].index(b), margin) for m, a, b in self.claims]


@dataclass
class Scenario:
    name: str
    rho: float = 0.5  # the share of one run's variance that its seed shares with the other arms
    noisier: dict[str, float] = field(default_factory=dict)  # arm -> its seed spread m[a] (others 1)
    unshared: tuple[str, ...] = ()  # arms whose seed effect is their own
    spread: float = 1.0  # > 1: every arm's m[a] drawn log-uniform on [1, spread], per study and metric
    effects: tuple[float, ...] = ()  # each claim's true difference in Δ; () = none anywhere
    # metric -> arm -> its seed spread on that metric, in place of `noisier` there (a page's own noise)
    spreads: dict[str, dict[str, float]] = field(default_factory=dict)

    def multipliers(self, rng, arms: list[str], studies: int, metric: str = "") -> np.ndarray:
        m = np.ones((studies, len(arms)))
        for a, x in self.spreads.get(metric, self.noisier).items():
            if a in arms:
                m[:, arms.index(a)] = x
        if self.spread > 1:
            m = m * np.exp(rng.uniform(0, np.log(self.spread), m.shape))
        return m


def simulate(
    rng, s: Structure, scenario: Scenario, studies: int, seeds: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """metric -> values[study, arm, seed] of `studies` simulated studies (seeds per metric: the
    structure's, or `seeds`)."""
    seeds = {**s.seeds, **(seeds or {})}
    tables = {}
    for metric, arms in s.pools.items():
        n = seeds[metric]
        z = np.broadcast_to(rng.normal(size=(studies, 1, n)), (studies, len(arms), n)).copy()
        for a in scenario.unshared:
            if a in arms:
                z[:, arms.index(a)] = rng.normal(size=(studies, n))
        e = rng.normal(size=(studies, len(arms), n))
        m = scenario.multipliers(rng, arms, studies, metric)[..., None]
        tables[metric] = m * (np.sqrt(scenario.rho) * z + np.sqrt(1 - scenario.rho) * e)
    for (metric, arm, against), effect in zip(s.claims, scenario.effects):
        arms = s.pools[metric]
        # mu[against] = 0, mu[arm] = effect: a claim's arm is in no other claim of its metric
        tables[metric][:, arms.index(arm)] += effect
    return tables


def truth(s: Structure, scenario: Scenario) -> np.ndarray:
    """Each claim's true difference in Δ."""
    return np.array(scenario.effects if scenario.effects else [0.0] * len(s.claims), float)


def difference_sd(s: Structure, scenario: Scenario, claim: int) -> float:
    """The sd of one seed's difference of a claim's two arms (spread 1 unless `noisier`)."""
    metric, arm, against = s.claims[claim]
    ma, mb = scenario.noisier.get(arm, 1.0), scenario.noisier.get(against, 1.0)
    shared = 0.0 if arm in scenario.unshared or against in scenario.unshared else scenario.rho
    return float(np.sqrt(ma**2 + mb**2 - 2 * shared * ma * mb))


def false_difference(result: dict, true: np.ndarray) -> np.ndarray:
    """Per study: whether Holm's test rejected "no difference" for any claim whose true difference
    is 0 -- stricter than counting the verdicts that claim one (reproduced, possibly smaller,
    contradicted): a difference detected inside ±Δ, read as "equivalent", counts too."""
    return (result["differs"] & (true == 0)).any(-1)


def false_equivalence(outcome: np.ndarray, true: np.ndarray, margin: float) -> np.ndarray:
    """Per study: whether any claim whose true difference is at least Δ was found equivalent."""
    return ((outcome == V.EQUIVALENT) & (np.abs(true) >= margin)).any(-1)


def topped_up(
    rng, s: Structure, scenario: Scenario, studies: int, cap: int, margin: float = 1.0
) -> tuple[dict, np.ndarray]:
    """Studies run at their structure's seeds, then topped up once by the rule (verdicts.topup_seeds:
    the largest seeds-needed over the claims of the study's own runs, from each claim's own noise
    at the first stage) to at most `cap` seeds per arm: (their tables, NaN past each study's seeds;
    the seeds each was topped up to)."""
    full = simulate(rng, s, scenario, studies, {m: cap for m in s.topped})
    comps = s.comparisons(margin)
    first = {m: (t[..., : s.seeds[m]] if m in s.topped else t) for m, t in full.items()}
    r = V.analyse(first, comps)
    own = [i for i, (m, _, _) in enumerate(s.claims) if m in s.topped]
    needed = V.seeds_needed(r["sd"][:, own], margin, len(comps), max_seeds=cap)
    start = min(s.seeds[m] for m in s.topped)
    target = np.minimum(np.maximum(np.where(needed > cap, cap, needed).max(-1), start), cap)
    for m in s.topped:
        mask = np.arange(cap)[None, None, :] >= target[:, None, None]
        full[m] = np.where(mask, np.nan, full[m])
    return full, target


# A staged study's simulation: stage 2 adds at most this many seeds per arm; the design declares
# equal weights (stage 2 planned as large as stage 1) and Lan-DeMets O'Brien-Fleming-type spending.
STAGE2_CAP = 12
COMBINATION = S.Combination()
# The misuse's stage 2 goes to the arms of the findings closest to settling at stage 1, this many.
PROMISING = 4
RULES = ("declared", "adaptive", "budget")


def staged(
    rng,
    s: Structure,
    scenario: Scenario,
    studies: int,
    margin: float,
    rule: str,
    cap: int = STAGE2_CAP,
    budget: float | None = None,
) -> tuple[dict, np.ndarray, np.ndarray, dict, dict]:
    """Studies in two stages (stats/stages.py, its combination test, COMBINATION): stage 1 at
    the structure's seeds, stage 2 on new seeds of the study's own runs (the stress runs' metrics
    have none), as `rule` says:
    * "declared": the budget spread evenly over every arm;
    * "adaptive", the misuse it must survive: the study stops after stage 1 as soon as a finding
      settles; else stage 2 is sized from the observed differences -- the seeds the plan at the
      most promising finding's observed difference asks for (verdicts.settle_power), at least 2
      and at most `cap` -- and run only on the arms of the PROMISING findings with the smallest
      stage-1 p;
    * "budget": the declared rule of stats/allocation.py, the budget where it raises the expected
      settled findings most, at most `cap` per arm.
    The budget: `budget` runs, by default stage 1's runs again.
    Returns (analyse_staged's results, the final rejections of "no difference" per study and
    claim, stage 2's seeds per study and arm of the study's own runs, both stages' tables)."""
    comps = s.comparisons(margin)
    first = simulate(rng, s, scenario, studies)
    second = simulate(rng, s, scenario, studies, {m: cap for m in s.pools})
    arms = s.pools[s.topped[0]]  # the arms of the study's own runs: every metric of them has these
    n1 = min(s.seeds[m] for m in s.topped)
    spend = n1 * len(arms) if budget is None else budget
    if rule == "declared":
        seeds2 = np.full((studies, len(arms)), min(int(spend // len(arms)), cap))
    elif rule == "adaptive":
        seeds2 = _promising(first, s, comps, arms, n1, margin, cap)
    elif rule == "budget":
        ends = [(arms.index(a), arms.index(b)) if m in s.topped else (0, 0) for m, a, b in s.claims]
        own = [m in s.topped for m, _, _ in s.claims]
        seeds2, _ = A.plan(first, comps, COMBINATION, ends, own, np.ones(len(arms)), spend, cap)
    else:
        raise ValueError(f"rule {rule!r}: one of {', '.join(RULES)}")
    for m in s.topped:
        second[m] = np.where(np.arange(cap)[None, None, :] < seeds2[..., None], second[m], np.nan)
    for m in set(second) - set(s.topped):
        second[m] = np.full_like(second[m], np.nan)
    # the stress runs' claims have no stage 2: one look each, their fixed-design test
    single = np.array([m not in s.topped for m, _, _ in s.claims])
    res = S.analyse_staged(first, second, comps, COMBINATION, single=single)
    return res, res["differs2"], seeds2, first, second


def _promising(first: dict, s: Structure, comps: list, arms: list[str], n1: int, margin: float, cap: int) -> np.ndarray:
    """The misuse's stage 2 (`staged`, "adaptive"): seeds per study and arm, 0 where it stopped."""
    r = V.analyse(first, comps)
    own = np.array([m in s.topped for m, _, _ in s.claims])
    stopped = (r["outcome"] != V.UNRESOLVED).any(-1)
    order = np.argsort(np.where(own, r["p_zero"], np.inf), -1)[:, :PROMISING]
    best = order[:, 0]
    pick = lambda key: np.take_along_axis(r[key], best[:, None], -1)[:, 0]  # noqa: E731
    n = np.arange(n1 + 1, n1 + cap + 1, dtype=np.float64)
    power = V.settle_power(n, pick("d")[:, None], pick("sd")[:, None], margin, V.ALPHA / len(comps), n - 1)
    plan = np.where((power >= V.POWER).any(-1), n[np.argmax(power >= V.POWER, -1)], n1 + cap)
    n2 = np.where(stopped, 0, np.clip(plan - n1, 2, cap)).astype(int)
    chosen = np.zeros((len(n2), len(arms)), bool)
    for j, (m, arm, against) in enumerate(s.claims):
        if m in s.topped:
            hit = (order == j).any(-1)
            for a in (arm, against):
                chosen[:, arms.index(a)] |= hit
    return np.where(chosen, n2[:, None], 0)


def naive_after(first: dict, second: dict, comps: list, seeds2: np.ndarray) -> np.ndarray:
    """The same stages judged without a combination test -- stage 1's fixed-design verdicts where
    the study stopped (no stage-2 seeds), else the fixed-design tests on all its seeds pooled: what
    peeking and adding seeds does to the error rate. Holm's decisions on the difference."""
    pooled = {m: np.concatenate([first[m], second[m]], -1) for m in first}
    at1, at2 = V.analyse(first, comps)["differs"], V.analyse(pooled, comps)["differs"]
    return np.where((seeds2.sum(-1) == 0)[:, None], at1, at2)


@dataclass
class Check:
    """One row of the calibration: a scenario, the seeds its studies run, what is measured and the
    range it must fall in (a rate per study, or per claim for `power`)."""

    scenario: Scenario
    measure: str  # "false difference" | "false equivalence" | "equivalence found" | "power" | "top-up"
    low: float
    high: float
    seeds: int | None = None  # seeds per arm of every metric; None: the study file's
    margin: float = 0.5  # Δ in units of one run's sd
    stages: str = ""  # a staged study's rule (`staged`: declared, adaptive, budget); "": one stage

    @property
    def label(self) -> str:
        return f"{self.scenario.name}, {self.measure}" + (f", {self.seeds} seeds" if self.seeds else "")


NULL, EQUIVALENCE_MARGIN, POWER_MARGIN, TOPUP_MARGIN, TOPUP_CAP = 0.05, 3.0, 1.0, 2.5, 10


def checks(s: Structure) -> list[Check]:
    """The scenarios of issue 49 in this study's structure. A null claim's Δ is half a run's sd
    (the study's eval loss: Δ 0.0032 against a baseline sd of 0.0072 nats); the equivalence
    scenarios take Δ = 3 sd, where equivalence is within reach at 10 seeds."""
    base = s.claims[0][2]  # the arm the first claim is compared with: the baseline in a study file
    named = [a for _, arm, against in s.claims for a in (arm, against) if a != base]
    other = max(dict.fromkeys(named), key=named.count)  # the arm in the most claims (normformer in mega-variants)
    sides = np.where(np.arange(len(s.claims)) % 2, -1.0, 1.0)  # the ±Δ of a false equivalence, claim by claim
    return _fixed_checks(s, base, other, sides) + _staged_checks(base, other, sides)


def _fixed_checks(s: Structure, base: str, other: str, sides: np.ndarray) -> list[Check]:
    """`checks` of the fixed design (one look): false differences under the null, false and true
    equivalence, power, and the top-up's error."""
    k = len(s.claims)
    fd = "false difference"
    out = [
        Check(Scenario(f"no effect, rho {rho:g}", rho=rho), fd, 0, NULL, seeds)
        for rho in (0.0, 0.5, 0.9)
        for seeds in (None, 6)
    ]
    for rho in (0.5, 0.9):
        out += [
            Check(Scenario(f"{base} 3x the others' spread, rho {rho:g}", rho=rho, noisier={base: 3.0}), fd, 0, NULL),
            Check(Scenario(f"{other} 3x the others' spread, rho {rho:g}", rho=rho, noisier={other: 3.0}), fd, 0, NULL),
        ]
    for arm in (base, other):
        out += [
            Check(Scenario(f"{arm}'s seed effect its own, rho 0.9", rho=0.9, unshared=(arm,)), fd, 0, NULL, seeds)
            for seeds in (None, 5)
        ]
    out += [
        Check(Scenario(f"every arm's spread log-uniform on [1, 12], rho {rho:g}", rho=rho, spread=12.0), fd, 0, NULL)
        for rho in (0.5, 0.9)
    ]
    for seeds in (None, 10):
        out.append(
            Check(
                Scenario("every claim's true difference exactly ±Δ", effects=tuple(sides * EQUIVALENCE_MARGIN)),
                "false equivalence",
                0,
                NULL,
                seeds,
                EQUIVALENCE_MARGIN,
            )
        )
    out.append(Check(Scenario("no effect, rho 0.5"), "equivalence found", 0.5, 1.0, 10, EQUIVALENCE_MARGIN))
    first = tuple([POWER_MARGIN] + [0.0] * (k - 1))
    out += [
        Check(
            Scenario("the first claim's difference exactly Δ, rho 0.5", effects=first),
            "power",
            0.75,
            0.85,
            margin=POWER_MARGIN,
        ),
        Check(
            Scenario(f"the same, {s.claims[0][1]} 3x the others' spread", noisier={s.claims[0][1]: 3.0}, effects=first),
            "power",
            0.75,
            0.85,
            margin=POWER_MARGIN,
        ),
        Check(Scenario("no effect, rho 0.5"), "top-up", 0, NULL, margin=TOPUP_MARGIN),
    ]
    return out


def _staged_checks(base: str, other: str, sides: np.ndarray) -> list[Check]:
    """`checks` of two stages: the null under each rule, then the budget rule in the fixed
    design's scenarios of unequal and unshared noise and of false equivalence."""
    fd = "false difference"
    # two stages (stats/stages.py): declared, and the misuse issue 63 names -- stage 2 sized from
    # the observed differences on the most promising findings' arms, stopping as soon as one settles
    how = {
        "declared": "two declared stages",
        "adaptive": "stage 2 from the observed differences, stopped when one settles",
        "budget": "stage 2 by the declared budget rule",
    }
    out = [
        Check(Scenario(f"no effect, rho {rho:g}, {how[rule]}", rho=rho), fd, 0, NULL, stages=rule)
        for rule in RULES
        for rho in (0.0, 0.5, 0.9)
    ]
    # the budget rule in every other scenario above: arms of unequal and unshared noise, spreads as
    # a page prints them, and effects at ±Δ for a false equivalence
    staged_too = [
        Scenario(f"{base} 3x the others' spread, rho 0.9", rho=0.9, noisier={base: 3.0}),
        Scenario(f"{other} 3x the others' spread, rho 0.9", rho=0.9, noisier={other: 3.0}),
        Scenario(f"{base}'s seed effect its own, rho 0.9", rho=0.9, unshared=(base,)),
        Scenario("every arm's spread log-uniform on [1, 12], rho 0.5", rho=0.5, spread=12.0),
    ]
    out += [
        Check(dataclasses.replace(sc, name=f"{sc.name}, {how['budget']}"), fd, 0, NULL, stages="budget")
        for sc in staged_too
    ]
    out.append(
        Check(
            Scenario(
                f"every claim's true difference exactly ±Δ, {how['budget']}", effects=tuple(sides * EQUIVALENCE_MARGIN)
            ),
            "false equivalence",
            0,
            NULL,
            margin=EQUIVALENCE_MARGIN,
            stages="budget",
        )
    )
    return out


def run(rng, s: Structure, check: Check, studies: int) -> tuple[float, int, str]:
    """(the measured rate, how many trials it is over, the seeds its studies ran, in words)."""
    comps = s.comparisons(check.margin)
    true = truth(s, check.scenario)
    if check.measure == "top-up":
        tables, target = topped_up(rng, s, check.scenario, studies, TOPUP_CAP, check.margin)
        out = V.analyse(tables, comps)
        counts = np.bincount(target, minlength=TOPUP_CAP + 1)
        spread = ", ".join(f"{n}: {c / studies:.0%}" for n, c in enumerate(counts) if c)
        return float(false_difference(out, true).mean()), studies, f"{_seeds(s, None)}, topped up to ({spread})"
    if check.stages:
        res, final, seeds2, _, _ = staged(rng, s, check.scenario, studies, check.margin, check.stages)
        how = f"{_seeds(s, None)}, then {_stage2(seeds2)}"
        if check.measure == "false equivalence":
            outcome = S.outcome_at(res, 2)
            return float(false_equivalence(outcome, true, check.margin).mean()), studies, how
        return float((final & (true == 0)).any(-1).mean()), studies, how
    seeds = None if check.seeds is None else {m: check.seeds for m in s.pools}
    if check.measure == "power":
        n = int(V.seeds_needed(difference_sd(s, check.scenario, 0), check.margin, len(comps)))
        seeds = {**{m: n for m in s.topped}, **(seeds or {})}
        out = V.analyse(simulate(rng, s, check.scenario, studies, seeds), comps)["outcome"][:, 0]
        found = np.isin(out, (V.HIGHER, V.HIGHER_BEYOND) if true[0] > 0 else (V.LOWER, V.LOWER_BEYOND))
        return float(found.mean()), studies, f"{n} (seeds-needed of the first claim, from its sd)"
    out = V.analyse(simulate(rng, s, check.scenario, studies, seeds), comps)
    if check.measure == "false equivalence":
        return float(false_equivalence(out["outcome"], true, check.margin).mean()), studies, _seeds(s, check.seeds)
    if check.measure == "equivalence found":
        return float((out["outcome"] == V.EQUIVALENT).mean()), studies * len(comps), _seeds(s, check.seeds)
    return float(false_difference(out, true).mean()), studies, _seeds(s, check.seeds)


def _stage2(seeds2: np.ndarray) -> str:
    """Stage 2's runs over the studies, in words: how often it ran none, and how many on average."""
    runs = seeds2.sum(-1)
    ran = runs[runs > 0]
    return f"stage 2: none in {(runs == 0).mean():.0%}" + (
        f", else {ran.mean():.1f} runs on average ({ran.min()} to {ran.max()})" if len(ran) else ""
    )


def _seeds(s: Structure, seeds: int | None) -> str:
    if seeds is not None:
        return str(seeds)
    return ", ".join(f"{m} {n}" for m, n in s.seeds.items())


def mc_se(rate: float, n: int) -> float:
    """The Monte-Carlo standard error of a rate measured over n independent trials."""
    return float(np.sqrt(max(rate * (1 - rate), 1e-12) / n))


def holds(check: Check, rate: float, n: int) -> bool:
    """Within the check's range, within 2 Monte-Carlo standard errors of the rate at the bound."""
    tol = lambda bound: 2 * mc_se(bound, n)  # noqa: E731 - the error of a rate at the bound itself
    return check.low - tol(check.low) <= rate <= check.high + tol(check.high)
