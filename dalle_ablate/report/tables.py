"""The report's tables: final metrics per variant with intervals and differences from the
baseline, stability per run, shapes accuracy per difficulty tier, and runs.csv."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from dalle_ablate.data.scenes import TIERS
from dalle_ablate.fileio import shown
from dalle_ablate.metrics import headlines, metric
from dalle_ablate.report import prose as P
from dalle_ablate.report.load import NOT_A_CHOICE, Run, differing_fields, final_value, series
from dalle_ablate.stats.basic import diverged, mean_ci, spikes

# What the final table compares: the run's own headline metrics that have a better side (the losses).
FINAL_METRICS = tuple(m.key for m in headlines("run") if m.better)
ONE_SEED = "1 seed: no interval"


def fmt(v) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def fmt3(v, unit: str = "") -> str:
    """A number as a study page prints it: three significant digits, trailing zeros kept (0.500,
    12.0, 0.00312; 1230 from 1000 on, 1.23e+05 from 10^5 and 3.12e-04 below 10^-3), then its
    `unit`; "–" for NaN. Integers and text are printed as they are (a count is exact)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (float, np.floating)):
        return str(v) if not unit else f"{v} {unit}"
    v = float(v)
    if math.isnan(v):
        return "–"
    if math.isinf(v) or v == 0:
        text = "0" if v == 0 else ("∞" if v > 0 else "−∞")
    else:
        r = float(f"{v:.3g}")  # rounded first: 9.996 is 10.0, not 10.00
        e = math.floor(math.log10(abs(r)))
        text = f"{r:.{max(0, 2 - e)}f}" if -3 <= e < 5 else f"{r:.2e}"
    return f"{text} {unit}" if unit else text


def baseline_tables(
    by_variant: dict[str, list[Run]],
    baseline: str,
    margins: Optional[dict[str, str]] = None,
    metrics=FINAL_METRICS,
    margin_seeds: Optional[set] = None,
) -> tuple[list[str], list, dict, list, list[tuple[str, str]]]:
    """(variants, seeds, tables: metric -> final values [variant, seed], the comparisons of every
    other variant with the baseline on every metric, their (variant, metric) keys). A margin given
    as a percentage is of the baseline's mean over its runs (over `margin_seeds` only, if given)."""
    from dalle_ablate.stats import verdicts as V

    margins = margins or {}
    variants = list(by_variant)
    seeds = sorted({r.seed for rs in by_variant.values() for r in rs}, key=str)
    tables, comps, keys = {}, [], []
    b = variants.index(baseline)
    of = np.array([margin_seeds is None or s in margin_seeds for s in seeds])
    for m in metrics:
        t = np.full((len(variants), len(seeds)), np.nan)
        for i, v in enumerate(variants):
            for r in by_variant[v]:
                t[i, seeds.index(r.seed)] = final_value(r, m)
        tables[m] = t
        margin = V.parse_margin(margins[m]).of(t[b][of]) if m in margins else math.nan
        for i, v in enumerate(variants):
            if i != b:
                comps.append(V.Comparison(m, i, b, margin))
                keys.append((v, m))
    return variants, seeds, tables, comps, keys


def against_baseline(
    by_variant: dict[str, list[Run]], baseline: str, margins: Optional[dict[str, str]] = None, metrics=FINAL_METRICS
) -> dict[tuple[str, str], dict]:
    """(variant, metric) -> the verdict engine's judgement of its final value against the baseline's
    (paired by seed, else Welch's; Holm over the table; `margins`' Δ): as a study's page judges."""
    from dalle_ablate.stats import verdicts as V

    _, _, tables, comps, keys = baseline_tables(by_variant, baseline, margins, metrics)
    if not comps:
        return {}
    res = V.analyse(tables, comps)
    noise = {"paired": res["paired"], "va": res["va"], "vb": res["vb"]}
    needed = V.seeds_needed(res["sd"], res["margin"], len(comps), **noise)
    # the plan at the observed difference (an unresolved comparison of n seeds needs n + 1 at least)
    plan = V.seeds_to_settle(
        res["d"], res["low"], res["high"], res["sd"], res["margin"], len(comps), **noise, at_least=res["n"] + 1
    )
    out = {}
    for j, (v, m) in enumerate(keys):
        row = {k: float(res[k][j]) for k in ("d", "low", "high", "fw_low", "fw_high", "rho", "sd", "df", "margin", "n")}
        row.update(
            paired=bool(res["paired"][j]),
            outcome=int(res["outcome"][j]),
            needed=int(needed[j]),
            plan=tuple(int(x[j]) for x in plan),
            verdict=P.against_baseline(int(res["outcome"][j]), metric(m).better == "lower"),
        )
        out[(v, m)] = row
    return out


FINAL_COLUMNS = [
    "variant",
    "metric",
    "verdict against the baseline",
    "Δ vs baseline",
    "Δ 95% CI",
    "mean",
    "mean 95% CI",
    "seeds",
    "rho",
]


def final_table(
    by_variant: dict[str, list[Run]],
    baseline: str,
    margins: Optional[dict[str, str]] = None,
    judged: Optional[dict] = None,
) -> tuple[list[str], list[list], dict]:
    """A row per variant and metric, the answer first: the verdict against the baseline, the difference
    and its interval, then the mean, seeds and rho. `judged`: rows judged another way (report/staged.py)."""
    rows = []
    judged = against_baseline(by_variant, baseline, margins) if judged is None else judged

    def interval(lo: float, hi: float, n: int) -> str:
        return ONE_SEED if n < 2 else f"[{fmt3(lo)}, {fmt3(hi)}]"

    for variant, runs in by_variant.items():
        for m in FINAL_METRICS:
            mean, lo, hi = mean_ci([final_value(r, m) for r in runs])
            row = [variant + (" (baseline)" if variant == baseline else ""), f"{m} ({metric(m).unit})"]
            if variant == baseline:
                row += ["", "", ""]
            else:
                j = judged[(variant, m)]
                how = f" ({int(j['n'])} seeds, {'paired' if j['paired'] else 'Welch'})" if j["n"] >= 2 else ""
                verdict = j["verdict"] + (f"; {_needs(j)}" if j["verdict"] == "not resolved" and j["plan"][0] else "")
                row += [verdict, j["d"], interval(j["low"], j["high"], int(j["n"])) + how]
            rho = judged[(variant, m)]["rho"] if variant != baseline else math.nan
            rows.append(row + [mean, interval(lo, hi, len(runs)), len(runs), rho if np.isfinite(rho) else "–"])
    return FINAL_COLUMNS, rows, judged


def _needs(j: dict) -> str:
    """What more seeds would do for a comparison not resolved (prose.seeds_words)."""
    from dalle_ablate.report.prose import seeds_words

    return seeds_words(*j["plan"], j["needed"])


def warmup_steps(run: Run) -> int:
    return int(run.config.get("schedule.warmup_steps") or 0)


def stability_rows(runs: list[Run]) -> list[list]:
    """Per run: loss spikes, gradient-norm peaks, the largest norm after warm-up (a fresh initialisation's
    are the largest of almost every run), a non-finite loss, and float16 steps skipped on overflow."""
    rows = []
    for r in runs:
        _, loss = series(r, "train/loss")
        steps, gnorm = series(r, "train/grad_norm")
        after = (steps > warmup_steps(r)) & np.isfinite(gnorm)
        peak = int(np.argmax(np.where(after, gnorm, -np.inf))) if after.any() else None
        rows.append(
            [
                r.name,
                r.variant,
                r.seed,
                r.status,
                spikes(loss, factor=1.5),
                spikes(gnorm, factor=5.0),
                float(gnorm[peak]) if peak is not None else math.nan,
                int(steps[peak]) if peak is not None else "",
                "yes" if diverged(loss, r.status) else "no",
                _count(final_value(r, "train/skipped_steps")),
            ]
        )
    return rows


def _count(v: float):
    """A count logged as a float, printed as the integer it is ("–" where not logged)."""
    return int(v) if np.isfinite(v) else "–"


STABILITY_COLUMNS = [
    "run",
    "variant",
    "seed",
    "status",
    "loss spikes",
    "grad-norm peaks",
    "max grad norm after warm-up",
    "at step",
    "diverged",
    "skipped steps",
]


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
            cells = {
                t: f"{row[c[f'shapes/{t}/all']]:.1%} [{row[c[f'shapes/{t}/all_lo']]:.1%}, "
                f"{row[c[f'shapes/{t}/all_hi']]:.1%}] N={int(row[c[f'shapes/{t}/n']])}"
                for t in found
            }
            rows.append((r, row[c["scale"]], cells))
    if not rows:
        return None
    return ["run", "variant", "scale", *tiers], [
        [r.name, r.variant, f"{scale:g}", *[cells.get(t, "") for t in tiers]] for r, scale, cells in rows
    ]


def headline_values(run: Run) -> dict[str, float]:
    """The last evaluation's headline metrics by scale (`<metric>@s<scale>`) and the last caption
    sensitivity."""
    out: dict[str, float] = {}
    if run.pareto:
        c = {name: i for i, name in enumerate(run.pareto["columns"])}
        for row in run.pareto["rows"]:
            out.update({f"{m.key}@s{row[c['scale']]:g}": row[c[m.key]] for m in headlines("samples") if m.key in c})
    prefix = "eval/caption_sensitivity/"
    for col in run.metrics.columns:
        if col.startswith(prefix) and not col.endswith("_n"):
            out[col[len("eval/") :]] = final_value(run, col)
    return out


def runs_csv(runs: list[Run], stability: list[list]) -> pd.DataFrame:
    """One row per run (`stability`: stability_rows(runs), in the same order): what it is, its
    final losses, headline eval metrics, cost and stability, and the config fields that differ."""
    fields = differing_fields(runs, NOT_A_CHOICE)
    rows = []
    for r, stab in zip(runs, stability):
        row = {
            "run": r.name,
            "store": shown(r.root),
            "variant": r.variant,
            "seed": r.seed,
            "status": r.status,
            "optimizer": r.config.get("optim.name"),
            "parameters": r.meta.get("params"),
            "steps": r.summary.get("steps"),
            "wall_time_s": r.summary.get("wall_time"),
        }
        row.update({m: final_value(r, m) for m in FINAL_METRICS})
        row.update(headline_values(r))
        row.update(
            {
                "loss_spikes": stab[4],
                "grad_norm_peaks": stab[5],
                "max_grad_norm_after_warmup": stab[6],
                "skipped_steps": stab[9] if isinstance(stab[9], int) else math.nan,
                # PowerSGD (optim.powersgd.rank): floats all-reduced without / with compression
                "compression": final_value(r, "comm/compression"),
            }
        )
        row.update({f: r.config.get(f) for f in fields})
        rows.append(row)
    return pd.DataFrame(rows)


# -- the shapes evaluation by tier: conditional rates, the evaluation's own noise, paired arms ----
SHAPES_GROUPS = ("all tiers", *TIERS)  # "all tiers": the columns without a tier prefix


def _shapes_prefix(group: str) -> str:
    return "shapes/" if group == "all tiers" else f"shapes/{group}/"


def _last_rows(run: Run) -> dict[float, dict]:
    """The last evaluation's Pareto rows by guidance scale, as {column: value}."""
    if not run.pareto:
        return {}
    cols = run.pareto["columns"]
    return {float(row[cols.index("scale")]): dict(zip(cols, row)) for row in run.pareto["rows"]}


def _mean(values) -> float:
    v = [float(x) for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(v)) if v else math.nan


def _pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.0%}"


def _by_scale_and_tier(by_variant: dict[str, list[Run]]):
    """(variant, guidance scale, tier group, its column prefix, the last evaluation's row of each
    seed at that scale) for every variant, scale and tier group: what the shapes tables walk."""
    for variant, runs in by_variant.items():
        per_run = [_last_rows(r) for r in runs]
        for scale in sorted({s for rows_ in per_run for s in rows_}):
            have = [rows_[scale] for rows_ in per_run if scale in rows_]
            for group in SHAPES_GROUPS:
                yield variant, scale, group, _shapes_prefix(group), have


def shapes_tier_table(by_variant: dict[str, list[Run]]) -> Optional[tuple[list[str], list[list]]]:
    """Per variant, guidance scale and tier, means over seeds: all-correct; objects found; each
    attribute asked only of found objects (DSG) / over all checks; the relation where both its
    objects were found (VISOR) / over all images, with the share where they were; unparsed."""
    cols = [
        "variant",
        "scale",
        "tier",
        "seeds",
        "all",
        "found",
        "color if found / all",
        "shape if found / all",
        "size if found / all",
        "position if found / all",
        "relation if found / all (coverage)",
        "unparsed",
    ]
    rows = []
    for variant, scale, group, p, have in _by_scale_and_tier(by_variant):
        if not any(f"{p}all" in row for row in have):
            continue

        def m(key: str) -> float:
            return _mean(row.get(p + key) for row in have)

        pair = [
            f"{_pct(m(a + '_if_found'))} / {_pct(m(a))}" if not math.isnan(m(a)) else "–"
            for a in ("color", "shape", "size", "position")
        ]
        rel = (
            f"{_pct(m('relation_if_found'))} / {_pct(m('relation'))} ({_pct(m('relation_coverage'))})"
            if not math.isnan(m("relation"))
            else "–"
        )
        rows.append(
            [variant, f"{scale:g}", group, len(have), _pct(m("all")), _pct(m("found")), *pair, rel, _pct(m("unparsed"))]
        )
    return (cols, rows) if rows else None


def shapes_noise_table(by_variant: dict[str, list[Run]]) -> Optional[tuple[list[str], list[list]]]:
    """Per variant, scale and tier: all-correct's mean and sd over seeds, beside the evaluation's own
    binomial sd over its N prompts, sqrt(p (1 - p) / N): a seed spread near it is mostly the evaluation's."""
    cols = ["variant", "scale", "tier", "seeds", "all-correct", "seed SD", "prompt SD (one run)", "prompts per run"]
    rows = []
    for variant, scale, group, p, have in _by_scale_and_tier(by_variant):
        n_key = f"{p}n"  # prompts scored: shapes/n over all tiers, shapes/<tier>/n per tier
        vals = [(float(row[f"{p}all"]), float(row[n_key])) for row in have if f"{p}all" in row and n_key in row]
        if not vals:
            continue
        rates = np.array([v for v, _ in vals])
        noise = _mean(math.sqrt(v * (1 - v) / n) for v, n in vals if n > 0)
        seed_sd = float(rates.std(ddof=1)) if len(rates) > 1 else math.nan
        rows.append(
            [
                variant,
                f"{scale:g}",
                group,
                len(vals),
                float(rates.mean()),
                ONE_SEED if len(rates) < 2 else seed_sd,
                noise,
                int(vals[0][1]),
            ]
        )
    return (cols, rows) if rows else None


def mcnemar_p(b: int, c: int) -> float:
    """McNemar's exact test (two-sided) on the discordant pairs: b prompts right only in one run,
    c only in the other; the binomial test of b in b + c at one half (statsmodels' `mcnemar(...,
    exact=True)` computes the same). 1 when no pair is discordant."""
    from scipy.stats import binomtest

    return float(binomtest(int(b), int(b + c), 0.5).pvalue) if b + c else 1.0


def paired_bootstrap(diffs: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of [pairs, prompts] differences, resampling prompts
    (columns) with every pair of runs kept for each: the prompts are what the evaluation draws."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diffs.shape[1], (resamples, diffs.shape[1]))
    means = diffs[:, idx].mean(axis=(0, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


# Settings that fix the evaluation's prompts (data.seed, eval.num_samples) and its sampling noise
# (eval.seed, and eval.batch_size: batch j draws from fold_in(key(eval.seed), j)): runs compared
# prompt by prompt must share them.
SAME_PROMPTS = ("data.seed", "eval.num_samples", "eval.seed", "eval.batch_size")


def paired_table(by_variant: dict[str, list[Run]], baseline: str) -> Optional[tuple[list[str], list[list]]]:
    """Each variant against the baseline prompt by prompt, runs paired by seed: Δ of all-correct per scale
    and tier with a paired bootstrap interval and McNemar's exact p over the discordant prompts."""
    cols = [
        "variant",
        "scale",
        "tier",
        "seed pairs",
        "prompts",
        "baseline",
        "variant rate",
        "Δ",
        "Δ 95% CI (prompts)",
        "right only in variant / only in baseline",
        "McNemar p",
    ]
    rows = []
    base_runs = {r.seed: r for r in by_variant.get(baseline, [])}
    for variant, runs in by_variant.items():
        if variant == baseline:
            continue
        pairs = [
            (base_runs[r.seed], r)
            for r in runs
            if r.seed in base_runs and all(base_runs[r.seed].config.get(k) == r.config.get(k) for k in SAME_PROMPTS)
        ]
        if not pairs:
            continue
        scales = sorted(set.intersection(*[set(_last_rows(a)) & set(_last_rows(b)) for a, b in pairs]))
        for scale in scales:
            for group in SHAPES_GROUPS:
                key = "shapes/verdicts" if group == "all tiers" else f"shapes/{group}/verdicts"
                got = [(_last_rows(a)[scale].get(key), _last_rows(b)[scale].get(key)) for a, b in pairs]
                got = [(x, y) for x, y in got if isinstance(x, str) and isinstance(y, str) and len(x) == len(y) and x]
                if not got or len({len(x) for x, _ in got}) != 1:
                    continue
                base = np.array([[ch == "1" for ch in x] for x, _ in got])
                var = np.array([[ch == "1" for ch in y] for _, y in got])
                diffs = var.astype(float) - base
                b, c = int((var & ~base).sum()), int((base & ~var).sum())
                lo, hi = paired_bootstrap(diffs)
                rows.append(
                    [
                        variant,
                        f"{scale:g}",
                        group,
                        len(got),
                        base.shape[1],
                        float(base.mean()),
                        float(var.mean()),
                        float(diffs.mean()),
                        f"[{fmt3(lo)}, {fmt3(hi)}]",
                        f"{b} / {c}",
                        mcnemar_p(b, c),
                    ]
                )
    return (cols, rows) if rows else None
