"""Stability under stress: the arms of a study's stability claims trained across learning rates (its file's `stress:`
section), judged by their LR sensitivity -- the mean over the rates of min(final loss, L0) minus the best, L0 the loss
at initialisation, which a diverged run counts as (Wortsman et al. 2023, §2.2). The runs: docs/guides/studies.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from dalle_ablate.metrics import label, metric
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import figures
import dalle_ablate.report.measures  # noqa: F401 -- lr_sensitivity, computed here
from dalle_ablate.report.study_file import StressClaim, StressPlan, load_stress, stress_folder
from dalle_ablate.report.load import Run, load_runs, machine_time, series
from dalle_ablate.stats.basic import mean_ci, spikes
from dalle_ablate.report.tables import fmt3
from dalle_ablate.report.writers import Section
from dalle_ablate.track.runstore import settled

# measure -> (what it is, for the page; which way is more stable)
MEASURES = {
    "lr_sensitivity": (
        "mean over the rates of min(final eval loss, L0) minus the best of them (Wortsman et al. 2023, "
        "§2.2; nats per image token)",
        "lower",
    ),
    "log10_max_lr": (
        "log10 of the largest rate that trains: a final eval loss below the entropy of the image codes' "
        "frequencies (a model that learned only those ends there), -inf if none does",
        "higher",
    ),
    "divergences": ("rates at which the loss stopped being finite", "lower"),
}


def index(runs: list[Run]) -> dict[tuple[str, float, int], Run]:
    """(arm, rate, seed) -> run, for the runs that have an arm, a rate and a seed."""
    out = {}
    for r in runs:
        arm, lr, seed = r.arm, r.config.get("optim.lr"), r.config.get("seed")
        if arm is not None and lr is not None and seed is not None:
            out[(arm, float(lr), int(seed))] = r
    return out


def final_loss(run: Optional[Run]) -> float:
    """The run's last eval loss; inf if it diverged (or ended on a loss that is not finite); NaN if
    it is missing, did not finish or logged no eval loss (no value)."""
    if run is None:
        return math.nan
    losses = series(run, "train/loss")[1]
    if run.status == "diverged" or not np.all(np.isfinite(losses)):
        return math.inf
    if run.status != "finished":
        return math.nan
    v = series(run, "eval/valid/loss")[1]
    return math.nan if not len(v) else float(v[-1]) if np.isfinite(v[-1]) else math.inf


def initial_loss(run: Optional[Run]) -> float:
    """L0: the loss at initialisation, the train loss of step 1 (computed before the first update)."""
    if run is None:
        return math.nan
    first = run.summary.get("train/first_loss")
    if first is not None and np.isfinite(first):
        return float(first)
    v = series(run, "train/loss")[1]
    return float(v[0]) if len(v) else math.nan


def lr_sensitivity(finals: list[float], l0: float) -> float:
    """Wortsman et al. 2023 (§2.2): mean over the rates of min(final loss, L0) minus the least of
    them. NaN if any rate has no value."""
    f = np.asarray(finals, np.float64)
    if not len(f) or np.isnan(f).any() or not np.isfinite(l0):
        return math.nan
    capped = np.minimum(f, l0)
    return float(capped.mean() - capped.min())


def trains(final: float, floor: float) -> bool:
    """A run trains when its final loss is below `floor`, the entropy of the image codes'
    frequencies (`data/code_unigram_entropy`): the loss of a model that learned nothing of the
    caption or the image so far. Measured for the study file: the baseline at 3e-1 and post-LN at
    1e-1 and 3e-1 all ended at 1.674 against a floor of 1.635, the baseline at 1e-1 at 1.279."""
    return bool(np.isfinite(final) and final < floor)


def unigram_floor(run: Optional[Run]) -> float:
    v = None if run is None else run.summary.get("data/code_unigram_entropy")
    return float(v) if v is not None and np.isfinite(v) else math.nan


@dataclass
class Curve:
    """One arm at one seed across the plan's rates."""

    arm: str
    seed: int
    finals: list[float]  # per rate: final eval loss, inf diverged, NaN missing
    l0: float
    floor: float  # the code unigram entropy (`trains`)
    spikes: list[int]  # per rate: loss spikes (stats.spikes, 1.5x the median of the 20 steps before)


def curves(plan: StressPlan, runs: list[Run]) -> dict[tuple[str, int], Curve]:
    by = index(runs)
    out = {}
    for arm in plan.arms:
        for seed in plan.seeds:
            rs = [by.get((arm, lr, seed)) for lr in plan.rates]
            l0s = [initial_loss(r) for r in rs if r is not None]
            floors = [unigram_floor(r) for r in rs if r is not None]
            out[(arm, seed)] = Curve(
                arm,
                seed,
                [final_loss(r) for r in rs],
                float(np.nanmedian(l0s)) if any(np.isfinite(l0s)) else math.nan,
                float(np.nanmedian(floors)) if any(np.isfinite(floors)) else math.nan,
                [spikes(series(r, "train/loss")[1], factor=1.5) if r is not None else 0 for r in rs],
            )
    return out


def measures(plan: StressPlan, runs: list[Run]) -> dict[tuple[str, int], dict[str, float]]:
    """(arm, seed) -> each of MEASURES."""
    out = {}
    for key, c in curves(plan, runs).items():
        complete = not np.isnan(c.finals).any()
        ok = [lr for lr, f in zip(plan.rates, c.finals) if trains(f, c.floor)]
        out[key] = {
            "lr_sensitivity": lr_sensitivity(c.finals, c.l0),
            "log10_max_lr": (math.log10(max(ok)) if ok else -math.inf)
            if complete and np.isfinite(c.floor)
            else math.nan,
            "divergences": float(sum(np.isinf(c.finals))) if complete else math.nan,
        }
    return out


def claim_values(plan: StressPlan, runs: list[Run], measure: str = "lr_sensitivity") -> list[dict]:
    """Per stress claim, what a verdict needs: id, claim, arm, against, measure, expect and "values" {arm:
    {seed: value}} (NaN where a seed's runs are not all done; the arms pair by seed)."""
    if measure not in MEASURES:
        raise ConfigError(f"stress measure {measure!r} is not one of: {', '.join(MEASURES)}")
    m = measures(plan, runs)
    flip = MEASURES[measure][1] == "higher"
    out = []
    for c in plan.claims:
        expect = c.expect if not flip else {"lower": "higher", "higher": "lower"}[c.expect]
        out.append(
            {
                "id": c.id,
                "claim": c.claim,
                "arm": c.arm,
                "against": c.against,
                "measure": measure,
                "expect": expect,
                "values": {a: {s: m[(a, s)][measure] for s in plan.seeds} for a in (c.arm, c.against)},
                "untestable": untrained(plan, m, c),
            }
        )
    return out


def untrained(plan: StressPlan, m: dict[tuple[str, int], dict[str, float]], c: StressClaim) -> str:
    """Why a claim cannot be judged on these stress runs, or "": neither of its arms trains at any
    rate of the grid at any seed (every final loss at or above the code-frequency floor), so
    their sensitivities compare two untrained models and no number of seeds would change that."""
    top = [m[(a, s)]["log10_max_lr"] for a in (c.arm, c.against) for s in plan.seeds]
    if not top or not all(v == -math.inf for v in top):
        return ""
    return (
        f"neither {c.arm} nor {c.against} trains at any rate of the stress grid "
        f"({', '.join(f'{lr:g}' for lr in plan.rates)}) on any seed: both end at or above the code-frequency floor"
    )


# -- the page ----------------------------------------------------------------------------------
def lr_figure(plan: StressPlan, cs: dict[tuple[str, int], Curve], arms: list[str]) -> bytes:
    """Final eval loss against the learning rate per arm (Wortsman et al. 2023): the mean over seeds of
    min(loss, L0), each seed a dot, a diverged run an x at L0, L0 dashed."""
    plt = figures._plt()
    colors = figures.colors(arms)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    l0s = []
    for arm in arms:
        rows = [cs[(arm, s)] for s in plan.seeds if (arm, s) in cs]
        capped = np.array([np.minimum(c.finals, c.l0) for c in rows])
        l0s += [c.l0 for c in rows if np.isfinite(c.l0)]
        # the mean where every seed has a value (a NaN breaks the line there)
        mean = capped.mean(0) if len(rows) else np.full(len(plan.rates), np.nan)
        ax.plot(plan.rates, mean, "-", color=colors[arm], label=arm, lw=1.8)
        for c in rows:
            f = np.asarray(c.finals)
            ok, div = np.isfinite(f), np.isinf(f)
            ax.plot(np.asarray(plan.rates)[ok], f[ok], "o", color=colors[arm], ms=4, alpha=0.6)
            ax.plot(np.asarray(plan.rates)[div], np.full(div.sum(), c.l0), "x", color=colors[arm], ms=8, mew=2)
    if l0s:
        ax.axhline(float(np.mean(l0s)), color="0.5", ls="--", lw=1, label="L0 (loss at initialisation)")
    floors = [cs[(a, s)].floor for a in arms for s in plan.seeds if (a, s) in cs and np.isfinite(cs[(a, s)].floor)]
    if floors:
        ax.axhline(float(np.mean(floors)), color="0.3", ls=":", lw=1, label="entropy of the code frequencies")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (optim.lr)")
    ax.set_ylabel(f"{label('eval/valid/loss')}, min with L0")
    seeds = f"seed{'s' if len(plan.seeds) > 1 else ''} {', '.join(map(str, plan.seeds))}"
    ax.set_title(f"final loss against learning rate, {plan.steps} steps, {seeds}", fontsize=10)
    ax.legend(fontsize=figures.MIN_PT)
    ax.grid(alpha=0.3, which="both")
    return figures.png(fig)


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "diverged" if v > 0 else "none"
    return fmt3(v)  # the study page's numbers, three digits


def _per_run_table(plan: StressPlan, cs: dict, m: dict, unit: str) -> tuple[list[str], list[list]]:
    """One row per arm and seed (its runs at every rate): its measures, its loss spikes per rate and
    its final loss at each rate."""
    cols = [
        "arm",
        "seed",
        *MEASURES,
        "loss spikes (per rate)",
        *[f"final eval loss at lr {lr:g} ({unit})" for lr in plan.rates],
    ]
    rows = []
    for arm in plan.arms:
        for seed in plan.seeds:
            c = cs[(arm, seed)]
            rows.append(
                [
                    arm,
                    seed,
                    *[_fmt(m[(arm, seed)][k]) for k in MEASURES],
                    " / ".join(map(str, c.spikes)),
                    *[_fmt(f) for f in c.finals],
                ]
            )
    return cols, rows


def _per_arm_table(plan: StressPlan, m: dict, unit: str) -> tuple[list[str], list[list]]:
    """One row per stress arm: its LR sensitivity's mean over seeds with a t interval, its diverged runs."""
    summary = []
    for arm in plan.arms:
        mean, lo, hi = mean_ci([m[(arm, seed)]["lr_sensitivity"] for seed in plan.seeds])
        diverged = [m[(arm, seed)]["divergences"] for seed in plan.seeds]
        summary.append(
            [
                arm,
                _fmt(mean),
                "–" if not np.isfinite(lo) else f"[{fmt3(lo)}, {fmt3(hi)}]",
                sum(int(d) for d in diverged if np.isfinite(d)),
            ]
        )
    return ["arm", f"LR sensitivity, mean over seeds ({unit})", f"95% t interval ({unit})", "diverged runs"], summary


def stress_sections(plan: StressPlan, runs: list[Run]) -> tuple[list[Section], list[dict]]:
    """The page's stress section (the plan, the figures, per arm its sensitivity, largest rate that trains,
    divergences, spikes and loss at every rate) and each claim's `claim_values`."""
    cs, m = curves(plan, runs), measures(plan, runs)
    unit = metric("eval/valid/loss").unit
    by = index(runs)
    done = [by[j] for j in plan.jobs() if by.get(j) is not None and settled(by[j].summary, plan.steps)]
    wall = machine_time(done) / 60  # a job of several members once
    s = Section("stress", "Stability under stress")
    s.text.append(
        f"The arms of the stability claims ({', '.join(c.id for c in plan.claims)}) trained at learning rates "
        f"{', '.join(f'{lr:g}' for lr in plan.rates)} for {plan.steps} steps each, seeds "
        f"{', '.join(map(str, plan.seeds))}: {len(done)} of {len(plan.jobs())} runs done (finished or diverged); "
        f"their wall time adds up to {wall:.3g} min (each job's from its trainer's start, as the study's runs "
        f"above: its process's imports and config composition not counted; members of one job share it)."
        + (f" The range: {plan.source}" if plan.source else "")
    )
    s.text.append(
        'Following Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training '
        "instabilities\" (§2.2), a variant's stability is how its final loss degrades as the rate rises. "
        + " ".join(f"{name}: {what}." for name, (what, _) in MEASURES.items())
        + " L0 is the loss at initialisation (step 1's train loss); a diverged run counts as L0. The "
        "dashed lines: L0 and the code frequencies' entropy (below it a run trains)."
    )
    s.tables += [_per_run_table(plan, cs, m, unit), _per_arm_table(plan, m, unit)]
    how = (
        f"the final eval loss ({unit}, at most L0) against the learning rate: per arm the mean over its "
        "seeds as a line, each seed a dot, a diverged run an x at L0"
    )
    s.images.append((f"Every stress arm: {how}", lr_figure(plan, cs, plan.arms)))
    values = claim_values(plan, runs)
    for c, v in zip(plan.claims, values):
        s.images.append(
            (f"{c.id} ({c.claim}), {c.arm} against {c.against}: {how}", lr_figure(plan, cs, [c.against, c.arm]))
        )
    return [s], values


def stress_measures(study_file: Path, source) -> tuple[list[Section], dict[str, dict[str, dict]], dict[str, str]]:
    """A study's stress section, its stability claims' per-seed values (`extra`) and the claims they
    cannot settle (id -> why), from the stress runs beside `source` or given; nothing without a plan."""
    plan = load_stress(study_file)
    runs = stress_runs(source) if isinstance(source, (str, Path)) else list(source)
    if plan is None or not runs:
        return [], {}, {}  # none run yet (or none got as far as its run store)
    sections, claims = stress_sections(plan, runs)
    values: dict[str, dict] = {}
    for c in claims:
        values.setdefault(c["measure"], {}).update(c["values"])
    return sections, values, {c["id"]: c["untestable"] for c in claims if c["untestable"]}


def stress_runs(source) -> list[Run]:
    """The stress runs beside a study's folder, [] where none got as far as its run store."""
    where = stress_folder(Path(source))
    if not where.is_dir() or not any(where.rglob("metrics.jsonl")):
        return []
    return load_runs(str(where))
