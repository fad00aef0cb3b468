"""Report figures (matplotlib, Agg) as PNG bytes."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np

from dalle_ablate.metrics import label
from dalle_ablate.report.load import Run, series
from dalle_ablate.stats.basic import t_interval
from dalle_ablate.stats.verdicts import MAX_SEEDS


# The smallest text a figure draws, in points, and the resolution it is written at: 10 pt is 12.5 px
# at 90 dpi, 10 px still where a page shows the figure at 80 % of its width. A study page's figures
# are drawn at most FIT_IN inches wide, what the docs site's content column shows at 1400 px (~850
# px); the report's page is 1200 px wide.
MIN_PT = 10
DPI = 90
FIT_IN = 9.4


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def colors(variants: list[str]) -> dict[str, str]:
    cycle = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
    return {v: cycle[i % len(cycle)] for i, v in enumerate(variants)}


def seed_band(runs: list[Run], column: str, x: str = "step", log: bool = False):
    """(x, mean, low, high) over the x values every run of the group logged. `log`: the mean and
    t interval of the logarithm, mapped back (a geometric mean whose band stays positive, as a
    log axis needs; the arithmetic band of a few seeds crosses 0 there)."""
    curves = [dict(zip(*series(r, column, x))) for r in runs]
    curves = [c for c in curves if c]
    if not curves:
        return (np.zeros(0),) * 4
    xs = np.array(sorted(set.intersection(*(set(c) for c in curves))))
    values = np.array([[c[v] for v in xs] for c in curves])
    if not log:
        return (xs, *t_interval(values, axis=0))
    with np.errstate(divide="ignore", invalid="ignore"):
        mean, low, high = t_interval(np.log(np.where(values > 0, values, np.nan)), axis=0)
    return xs, np.exp(mean), np.exp(low), np.exp(high)


def curves_figure(by_variant: dict[str, list[Run]], columns: list[str], palette: dict) -> bytes:
    plt = _plt()
    fig, axes = plt.subplots(1, len(columns), figsize=(min(5.6 * len(columns), FIT_IN), 3.8))
    for ax, col in zip(np.atleast_1d(axes), columns):
        log = col.endswith("grad_norm")
        for variant, runs in by_variant.items():
            xs, mean, low, high = seed_band(runs, col, log=log)
            if len(xs) == 0:
                continue
            ax.plot(xs, mean, "-o", ms=2, color=palette[variant], lw=1.4)
            if np.isfinite(low).any():
                ax.fill_between(xs, low, high, color=palette[variant], alpha=0.2, lw=0)
        kind = "geometric mean, 95% t-interval of the log" if log else "mean, 95% t-interval"  # across seeds
        ax.set_title(f"{col}\n{kind}", fontsize=MIN_PT)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label(col))
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    fig.tight_layout()
    _legend_below(fig, palette, {v: len(r) for v, r in by_variant.items()})
    return png(fig)


def _legend_below(fig, palette: dict, counts: dict | None = None) -> None:
    """Variant labels can be long: one legend under the axes, not over the curves."""
    plt = _plt()
    handles = [
        plt.Line2D([], [], color=c, label=v + (f" (n={counts[v]})" if counts else "")) for v, c in palette.items()
    ]
    _handles_below(fig, handles, columns=3)


def _handles_below(fig, handles: list, columns: int) -> None:
    """A figure's one legend, under its axes, at most `columns` entries a row."""
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        fontsize=MIN_PT,
        frameon=False,
        ncol=max(1, min(columns, len(handles))),
    )


def compute_figure(runs: list[Run], column: str, palette: dict) -> bytes:
    """The metric against tokens, wall time and FLOPs: equal-compute comparisons."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13.2, 3.8), sharey=True)  # one y label: three would overlap the panels
    for r in runs:
        steps, values = series(r, column)
        if len(steps) == 0:
            continue
        m = r.metrics.set_index("step")
        tokens = m["tokens"].reindex(steps).to_numpy(float) if "tokens" in m else np.full(len(steps), np.nan)
        step_time = m["perf/step_time"].fillna(0).cumsum() if "perf/step_time" in m else None
        wall = step_time.reindex(steps).to_numpy(float) if step_time is not None else np.full(len(steps), np.nan)
        flops = steps * float(r.meta.get("flops_per_step") or np.nan)
        for ax, xs in zip(axes, (tokens, wall, flops)):
            ax.plot(xs, values, "-o", ms=2, color=palette[r.variant], lw=1, alpha=0.8)
    for ax, xlabel in zip(
        axes, ("tokens seen", "training wall time (s, steps only;\nincludes machine load)", "training FLOPs")
    ):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(label(column))
    fig.tight_layout()
    _legend_below(fig, palette)
    return png(fig)


def _pareto_tables(runs: list[Run]) -> list[tuple[Run, dict]]:
    """The runs' last Pareto tables that have a line to draw, on the first one's axes."""
    tables = [(r, r.pareto) for r in runs if r.pareto and r.pareto.get("line")]
    return [(r, t) for r, t in tables if list(t["line"]) == list(tables[0][1]["line"])]


def flat_pareto(runs: list[Run]) -> tuple[str, float] | None:
    """(the axis, its one value) where every point of every run's Pareto curve has the same value on
    one axis -- e.g. a caption metric still 0 at every scale after a short run: a curve along an
    axis of zero width trades nothing and says nothing a table does not. None otherwise."""
    tables = _pareto_tables(runs)
    for axis in tables[0][1]["line"] if tables else []:
        values = np.array([row[t["columns"].index(axis)] for _, t in tables for row in t["rows"]], float)
        if np.isfinite(values).all() and np.ptp(values) <= 1e-9 * max(1.0, float(np.abs(values).max())):
            return axis, float(values[0])
    return None


def pareto_figure(runs: list[Run], palette: dict) -> tuple[bytes, str, str] | None:
    tables = _pareto_tables(runs)
    if not tables:
        return None
    x, y = tables[0][1]["line"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    labelled = set()
    for r, t in tables:
        c = {name: i for i, name in enumerate(t["columns"])}
        rows = sorted(t["rows"], key=lambda row: row[c["scale"]])
        xs, ys = [row[c[x]] for row in rows], [row[c[y]] for row in rows]
        ax.plot(xs, ys, "-o", ms=3, color=palette[r.variant], alpha=0.8)
        if f"{y}_lo" in c:  # the rate's 95% Wilson interval
            err = [
                [v - row[c[f"{y}_lo"]] for v, row in zip(ys, rows)],
                [row[c[f"{y}_hi"]] - v for v, row in zip(ys, rows)],
            ]
            ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor=palette[r.variant], alpha=0.4, capsize=2)
        if r.variant not in labelled:  # the scales once per variant, at its ends: labels of every run overlap
            labelled.add(r.variant)
            for row in rows[:: max(1, len(rows) - 1)]:
                ax.annotate(
                    f"s={row[c['scale']]:g}",
                    (row[c[x]], row[c[y]]),
                    fontsize=MIN_PT,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    ax.set_title("guidance-scale Pareto curves, one line per run (error bars: 95% interval)", fontsize=MIN_PT)
    ax.margins(0.12)  # room for the scales' labels at the ends
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _legend_below(fig, palette)
    return png(fig), x, y


def optuna_figures(study, metric: str = "Objective Value") -> dict[str, bytes | str]:
    """Optimisation history, slice plot (a one-parameter sweep's answer), importances (PED-ANOVA: no
    scikit-learn) and parallel coordinates of a single-objective study: PNG bytes, or why optuna drew none."""
    import optuna
    from optuna.visualization import matplotlib as ov

    out = {}
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if len(study.directions) != 1 or not complete:
        return out
    plots = {
        "slice": lambda: ov.plot_slice(study, target_name=metric),
        "history": lambda: ov.plot_optimization_history(study, target_name=metric),
        "parallel coordinates": lambda: ov.plot_parallel_coordinate(study, target_name=metric),
    }
    if len(complete) >= 2 and complete[0].params:
        plots["importances"] = lambda: ov.plot_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator(), target_name=metric
        )
    for name, make in plots.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
            try:
                ax = make()
            except (ValueError, RuntimeError) as e:  # e.g. importances of a single distinct value
                out[name] = str(e)
                continue
        fig = np.atleast_1d(ax)[0].figure
        fig.set_size_inches(7, 4)
        fig.tight_layout()
        out[name] = png(fig)
    return out


def side_by_side(panels: list[tuple[str, Path]], border: int = 3, gap: int = 12) -> bytes:
    """Grid images of one prompt list, category and scale, one per variant, side by side at
    one height, each framed and titled with its variant, so the same prompts read across."""
    from PIL import Image, ImageDraw, ImageFont

    images = [Image.open(path).convert("RGB") for _, path in panels]
    height = max(im.height for im in images)
    images = [
        im if im.height == height else im.resize((round(im.width * height / im.height), height), Image.NEAREST)
        for im in images
    ]
    font = ImageFont.load_default(size=14)
    title = 24
    width = sum(im.width + 2 * border for im in images) + gap * (len(images) - 1)
    canvas = Image.new("RGB", (width, height + 2 * border + title), "white")
    draw = ImageDraw.Draw(canvas)
    x = 0
    for (variant, _), im in zip(panels, images):
        draw.text((x, 2), variant, fill="black", font=font)
        draw.rectangle([x, title, x + im.width + 2 * border - 1, title + height + 2 * border - 1], fill="#444")
        canvas.paste(im, (x + border, title + border))
        x += im.width + 2 * border + gap
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    return buf.getvalue()


def forest_figure(rows: list, clip: float = 8.0) -> bytes:
    """A study's findings, one line each, in units of its margin Δ turned so the predicted side is right
    (units differ; ±Δ is ±1 for all): thick 95 %, thin family-wise, beyond ±`clip` Δ an arrow."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(FIT_IN - 1.4, 0.4 * len(rows) + 1.4))  # the labels either side take ~1.4 in more
    ax.axvspan(-1, 1, color="#dde8f3", zorder=0)
    ax.axvline(0, color="#444", lw=0.8)
    reach = 1.5
    for i, r in enumerate(rows):
        scale = r.finding.side / r.margin if r.margin > 0 else np.nan
        y = len(rows) - 1 - i
        d = r.diff * scale
        lo, hi = sorted((r.low * scale, r.high * scale))
        flo, fhi = sorted((r.fw_low * scale, r.fw_high * scale))
        if not np.isfinite(d):
            continue
        reach = max(reach, *(abs(v) for v in (d, flo, fhi) if np.isfinite(v)))
        for a, b, lw in ((flo, fhi, 1.0), (lo, hi, 3.5)):
            if np.isfinite(a) and np.isfinite(b):
                ax.plot([max(a, -clip), min(b, clip)], [y, y], color="#1f4e79", lw=lw, solid_capstyle="butt")
                for edge, sign in ((a, -1), (b, 1)):
                    if abs(edge) > clip and np.sign(edge) == sign:
                        ax.plot(sign * clip, y, marker=">" if sign > 0 else "<", color="#1f4e79", ms=6)
        ax.plot(np.clip(d, -clip, clip), y, "o", color="#c00000", ms=5, zorder=3)
    reach = min(reach, clip) + 0.5
    ax.set_xlim(-reach, reach)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r.finding.id for r in reversed(rows)], fontsize=MIN_PT)
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    right.set_yticks(range(len(rows)))
    right.set_yticklabels([_short_verdict(r) for r in reversed(rows)], fontsize=MIN_PT)
    ax.tick_params(axis="x", labelsize=MIN_PT)
    ax.set_xlabel(
        "paired difference (arm − vs) in units of its margin Δ, shaded: ±Δ;\nright: the side the claim predicts",
        fontsize=MIN_PT,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return png(fig)


def _short_verdict(r) -> str:
    """A verdict in a few words, for a figure's margin (the page's table has it in full)."""
    v = r.verdict
    for long, short in (
        ("reproduced, possibly smaller than Δ", "reproduced, maybe < Δ"),
        ("no meaningful effect (equivalent within ±Δ)", "equivalent within ±Δ"),
        ("contradicted (reversed)", "contradicted"),
    ):
        if v == long:
            return short
    plan = r.spread.plan[0]
    if v.startswith("not resolved: ") and plan > 0:  # the plan at the observed difference
        return f"needs > {MAX_SEEDS} seeds" if plan > MAX_SEEDS else f"plan: {plan} seeds"
    if v.startswith("not resolved at "):
        return "not resolved, likely < Δ"
    if v.startswith("untestable here"):
        return "untestable here"
    return v


def course_figure(courses: list[tuple[str, float, tuple]], ncols: int = 3) -> bytes:
    """Small multiples, one per finding: its paired difference at every evaluation with the 95 %
    interval as a band, 0 and ±Δ as lines, in the metric's units."""
    plt = _plt()
    nrows = max(1, -(-len(courses) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(FIT_IN, 2.7 * nrows), squeeze=False)
    for ax in axes.flat[len(courses) :]:
        ax.axis("off")
    for ax, (name, margin, (steps, d, lo, hi)) in zip(axes.flat, courses):
        ax.axhspan(-margin, margin, color="#dde8f3", zorder=0)
        ax.axhline(0, color="#444", lw=0.8)
        ax.fill_between(steps, lo, hi, color="#1f4e79", alpha=0.25, lw=0)
        ax.plot(steps, d, "-o", ms=2, color="#1f4e79", lw=1.2)
        ax.set_title(name, fontsize=MIN_PT)
        ax.tick_params(labelsize=MIN_PT)
        ax.yaxis.set_major_locator(_plt().MaxNLocator(4))
        ax.xaxis.set_major_locator(_plt().MaxNLocator(4))
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=MIN_PT)
    fig.tight_layout()
    return png(fig)


def seeds_figure(panels: list[tuple[str, list[tuple]]], level: float, ncols: int = 3) -> bytes:
    """Small multiples, one per arm (report/transitions.py): each seed's eval loss, its transition a dot,
    a late seed thick. `panels`: (arm, [(seed, steps, values, transition step or None, late)])."""
    plt = _plt()
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    seeds = list(dict.fromkeys(str(seed) for _, curves in panels for seed, *_ in curves))
    palette = colors(seeds)
    cols = min(ncols, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(FIT_IN, 2.8 * nrows + 0.4), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (arm, curves) in zip(axes.flat, panels):
        log = all((np.asarray(v) > 0).all() for _, _, v, _, _ in curves)
        ax.axhline(level, color="#444", lw=0.9, ls=":")
        for seed, steps, values, step, late in curves:
            color = palette[str(seed)]
            ax.plot(steps, values, "-", color=color, lw=2.4 if late else 1.1)
            if step is not None:
                ax.plot(step, values[list(steps).index(step)], "o", ms=6, color=color, mec="black", mew=0.8, zorder=3)
        named = [str(seed) for seed, *_, late in curves if late]
        ax.set_title(arm + (f" (late: {', '.join(named)})" if named else ""), fontsize=MIN_PT)
        if log:  # the plateau and the level at the bottom of a curve that starts ~5x higher
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(plt.MaxNLocator(4))
        ax.tick_params(labelsize=MIN_PT)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=MIN_PT)
    for row in axes:
        row[0].set_ylabel(label("eval/valid/loss").split(" (")[0], fontsize=MIN_PT)
    fig.tight_layout()
    handles = [plt.Line2D([], [], color=palette[s], label=f"seed {s}") for s in seeds]
    handles += [
        plt.Line2D([], [], color="#888", marker="o", mec="black", ls="", label="transition"),
        plt.Line2D([], [], color="#444", ls=":", label=f"level {level:g}"),
    ]
    _handles_below(fig, handles, columns=6)
    return png(fig)
