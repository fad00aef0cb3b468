"""The report's tables: final metrics per variant with intervals and differences from the
baseline, stability per run, shapes accuracy per difficulty tier, and runs.csv."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from dalle_ablate.data.scenes import TIERS
from dalle_ablate.report.load import NOT_A_CHOICE, Run, differing_fields, series
from dalle_ablate.report.stats import diff_ci, diverged, mean_ci, significant, spikes
from dalle_ablate.track import HEADLINES

FINAL_METRICS = ("eval/valid/loss", "train/loss")
ONE_SEED = "1 seed: no interval"
NO_SHARED = "fewer than 2 seeds shared with the baseline"


def fmt(v) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def final_value(run: Run, column: str) -> float:
    _, v = series(run, column)
    return float(v[-1]) if len(v) else math.nan


def paired_vs_baseline(by_variant: dict[str, list[Run]], baseline: str, metric: str) -> dict[str, tuple]:
    """variant -> (low, high, rho, seeds shared, pooled) of its paired difference from the
    baseline over the seeds both ran, the noise pooled over all the variants by value ~ variant
    + seed as a study page pools it (report/verdicts.py, docs/statistics.md); 95 %, per comparison."""
    from dalle_ablate.report.verdicts import Claim, analyse

    variants = list(by_variant)
    seeds = sorted({r.seed for rs in by_variant.values() for r in rs}, key=str)
    table = np.full((len(variants), len(seeds)), np.nan)
    for i, v in enumerate(variants):
        for r in by_variant[v]:
            table[i, seeds.index(r.seed)] = final_value(r, metric)
    b = variants.index(baseline)
    others = [i for i in range(len(variants)) if i != b]
    if not others:
        return {}
    res = analyse({metric: table}, [Claim(metric, i, b, 1, 1.0) for i in others])  # the margin plays no part here
    return {variants[i]: (res["low"][j], res["high"][j], res["rho"][j], int(res["n"][j]), bool(res["pooled"][j]))
            for j, i in enumerate(others)}


def final_table(by_variant: dict[str, list[Run]], baseline: str) -> tuple[list[str], list[list], dict]:
    """Per variant and metric: mean [95% t interval] over seeds, and the difference from the
    baseline with its Welch interval; `*` marks a difference whose interval excludes 0. With one
    seed the interval cells say so instead of showing an empty interval. Where a variant shares
    seeds with the baseline, its paired interval and rho beside Welch's (paired_vs_baseline)."""
    cols = ["variant", "seeds"]
    for m in FINAL_METRICS:
        cols += [m, f"{m} 95% CI", f"Δ {m} vs baseline", "Δ 95% CI", "beyond seed spread", f"Δ {m} paired 95% CI",
                 f"rho {m}"]
    rows, marks = [], {}
    base = {m: [final_value(r, m) for r in by_variant[baseline]] for m in FINAL_METRICS}
    paired = {m: paired_vs_baseline(by_variant, baseline, m) for m in FINAL_METRICS}

    def interval(lo: float, hi: float, n: int) -> str:
        return ONE_SEED if n < 2 else f"[{fmt(lo)}, {fmt(hi)}]"

    for variant, runs in by_variant.items():
        row = [variant + (" (baseline)" if variant == baseline else ""), len(runs)]
        for m in FINAL_METRICS:
            vals = [final_value(r, m) for r in runs]
            mean, lo, hi = mean_ci(vals)
            row += [mean, interval(lo, hi, len(runs))]
            if variant == baseline:
                row += ["", "", "", "", ""]
                continue
            d, dlo, dhi = diff_ci(vals, base[m])
            sig = significant(dlo, dhi)
            marks[(variant, m)] = sig
            row += [d, interval(dlo, dhi, min(len(runs), len(base[m]))), "*" if sig else ""]
            plo, phi, rho, shared, pooled = paired[m].get(variant, (np.nan, np.nan, np.nan, 0, False))
            ok = shared >= 2 and np.isfinite(plo) and np.isfinite(phi)
            row += [f"[{fmt(float(plo))}, {fmt(float(phi))}] ({shared} seeds{', pooled' if pooled else ''})" if ok
                    else NO_SHARED, float(rho) if shared >= 3 else "–"]
        rows.append(row)
    return cols, rows, marks


def warmup_steps(run: Run) -> int:
    return int(run.config.get("schedule.warmup_steps") or 0)


def stability_rows(runs: list[Run]) -> list[list]:
    """Per run: loss spikes, gradient-norm peaks, the largest gradient norm after warm-up (the
    first steps' norms, from a fresh initialisation, are the largest of almost every run) and
    its step, whether the loss stopped being finite, and the float16 steps skipped on overflow
    (trainer.grad_scaling; "–" where not logged)."""
    rows = []
    for r in runs:
        _, loss = series(r, "train/loss")
        steps, gnorm = series(r, "train/grad_norm")
        after = (steps > warmup_steps(r)) & np.isfinite(gnorm)
        peak = int(np.argmax(np.where(after, gnorm, -np.inf))) if after.any() else None
        rows.append([r.name, r.variant, r.seed, r.status, spikes(loss, factor=1.5), spikes(gnorm, factor=5.0),
                     float(gnorm[peak]) if peak is not None else math.nan, int(steps[peak]) if peak is not None else "",
                     "yes" if diverged(loss, r.status) else "no", final_value(r, "train/skipped_steps")])
    return rows


STABILITY_COLUMNS = ["run", "variant", "seed", "status", "loss spikes", "grad-norm peaks", "max grad norm after warm-up",
                     "at step", "diverged", "skipped steps"]


def tier_table(runs: list[Run]) -> Optional[tuple[list[str], list[list]]]:
    """Per run and scale, `shapes/<tier>/all` with its interval and N, tiers in the data's order."""
    rows, tiers = [], []
    for r in runs:
        if not r.pareto:
            continue
        c = {name: i for i, name in enumerate(r.pareto["columns"])}
        found = [t for t in TIERS if f"shapes/{t}/all" in c]
        tiers += [t for t in found if t not in tiers]
        for row in sorted(r.pareto["rows"], key=lambda row: row[c["scale"]]) if found else []:
            cells = {t: f"{row[c[f'shapes/{t}/all']]:.1%} [{row[c[f'shapes/{t}/all_lo']]:.2f}, "
                        f"{row[c[f'shapes/{t}/all_hi']]:.2f}] N={row[c[f'shapes/{t}/n']]}" for t in found}
            rows.append((r, row[c["scale"]], cells))
    if not rows:
        return None
    return ["run", "variant", "scale", *tiers], [[r.name, r.variant, f"{scale:g}", *[cells.get(t, "") for t in tiers]]
                                                for r, scale, cells in rows]


def headline_values(run: Run) -> dict[str, float]:
    """The last evaluation's headline metrics by scale (`<metric>@s<scale>`) and the last caption
    sensitivity."""
    out: dict[str, float] = {}
    if run.pareto:
        c = {name: i for i, name in enumerate(run.pareto["columns"])}
        for row in run.pareto["rows"]:
            out.update({f"{k}@s{row[c['scale']]:g}": row[c[k]] for k in HEADLINES if k in c})
    prefix = "eval/caption_sensitivity/"
    for col in run.metrics.columns:
        if col.startswith(prefix) and not col.endswith("_n"):
            out[col[len("eval/"):]] = final_value(run, col)
    return out


def runs_csv(runs: list[Run], stability: list[list]) -> pd.DataFrame:
    """One row per run (`stability`: stability_rows(runs), in the same order): what it is, its
    final losses, headline eval metrics, cost and stability, and the config fields that differ."""
    fields = differing_fields(runs, NOT_A_CHOICE)
    rows = []
    for r, stab in zip(runs, stability):
        row = {"run": r.name, "store": str(r.root), "variant": r.variant, "seed": r.seed, "status": r.status,
               "optimizer": r.config.get("optim.name"), "parameters": r.meta.get("params"),
               "steps": r.summary.get("steps"), "wall_time_s": r.summary.get("wall_time")}
        row.update({m: final_value(r, m) for m in FINAL_METRICS})
        row.update(headline_values(r))
        row.update({"loss_spikes": stab[4], "grad_norm_peaks": stab[5], "max_grad_norm_after_warmup": stab[6],
                    "skipped_steps": stab[9],
                    # PowerSGD (optim.powersgd.rank): floats all-reduced without / with compression
                    "compression": final_value(r, "comm/compression")})
        row.update({f: r.config.get(f) for f in fields})
        rows.append(row)
    return pd.DataFrame(rows)
