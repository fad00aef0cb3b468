"""`dalle-ablate report`: runs -> reports/<name>/index.html (self-contained: figures inline as
PNG data, no scripts, no network), report.md (figures beside it), runs.csv, and the same
structure as a W&B report spec (wandb_report.json; saved to W&B when online)."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from dalle_ablate.data.scenes import TIERS
from dalle_ablate.fileio import atomic_write
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import figures
from dalle_ablate.report.load import NOT_A_CHOICE, NOT_A_VARIANT, Run, differing_fields, load_runs, series
from dalle_ablate.report.stats import bootstrap_ci, bootstrap_diff, diverged, significant, spikes
from dalle_ablate.track.wandb_api import report_spec, wandb_report

SECTIONS = ("overview", "curves", "final", "stability", "compute", "pareto", "grids", "config", "optuna")
TITLES = {"overview": "Runs and variants", "curves": "Loss and gradient norm across seeds",
          "final": "Final metrics", "stability": "Stability", "compute": "Equal-compute views",
          "pareto": "Guidance-scale Pareto curves", "grids": "Prompt grids", "config": "Config diff",
          "optuna": "Optuna study"}
FINAL_METRICS = ("eval/valid/loss", "train/loss")


@dataclass
class Section:
    key: str
    text: list[str] = field(default_factory=list)  # paragraphs (plain text, escaped on output)
    tables: list[tuple[list[str], list[list]]] = field(default_factory=list)
    images: list[tuple[str, bytes]] = field(default_factory=list)  # (caption, png)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def final_value(run: Run, column: str) -> float:
    _, v = series(run, column)
    return float(v[-1]) if len(v) else math.nan


def final_table(by_variant: dict[str, list[Run]], baseline: str) -> tuple[list[str], list[list], dict]:
    """Per variant and metric: mean [95% bootstrap interval] over seeds, and the difference from
    the baseline with its interval; `*` marks a difference whose interval excludes 0."""
    cols = ["variant", "seeds"]
    for m in FINAL_METRICS:
        cols += [m, f"{m} 95% CI", f"Δ {m} vs baseline", "Δ 95% CI", "beyond seed spread"]
    rows, marks = [], {}
    base = {m: [final_value(r, m) for r in by_variant[baseline]] for m in FINAL_METRICS}
    for variant, runs in by_variant.items():
        row = [variant + (" (baseline)" if variant == baseline else ""), len(runs)]
        for m in FINAL_METRICS:
            vals = [final_value(r, m) for r in runs]
            mean, lo, hi = bootstrap_ci(vals)
            row += [mean, f"[{_fmt(lo)}, {_fmt(hi)}]"]
            if variant == baseline:
                row += ["", "", ""]
                continue
            d, dlo, dhi = bootstrap_diff(vals, base[m])
            sig = significant(dlo, dhi)
            marks[(variant, m)] = sig
            row += [d, f"[{_fmt(dlo)}, {_fmt(dhi)}]", "*" if sig else ""]
        rows.append(row)
    return cols, rows, marks


def stability_rows(runs: list[Run]) -> list[list]:
    rows = []
    for r in runs:
        _, loss = series(r, "train/loss")
        _, gnorm = series(r, "train/grad_norm")
        rows.append([r.name, r.variant, r.seed, r.status, spikes(loss, factor=1.5), spikes(gnorm, factor=5.0),
                     float(np.nanmax(gnorm)) if len(gnorm) else math.nan, "yes" if diverged(loss, r.status) else "no"])
    return rows


def build_sections(runs: list[Run], baseline: Optional[str], study=None) -> tuple[list[Section], dict]:
    by_variant: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (r.variant, str(r.seed))):
        by_variant.setdefault(r.variant, []).append(r)
    if baseline is None:
        baseline = next(iter(by_variant))
    else:
        matches = [v for v in by_variant if baseline == v] or [v for v in by_variant if baseline in v]
        if len(matches) != 1:
            raise ConfigError(f"--baseline {baseline!r} matches {len(matches)} variants; variants: {'; '.join(by_variant)}")
        baseline = matches[0]
    palette = figures.colors(list(by_variant))
    sections: dict[str, Section] = {k: Section(k) for k in SECTIONS}

    s = sections["overview"]
    s.text.append(f"{len(runs)} runs in {len(by_variant)} variants (what differs between runs apart from the seed); "
                  f"baseline: {baseline}.")
    s.tables.append((["variant", "runs", "seeds", "status"],
                     [[v, len(rs), ", ".join(str(r.seed) for r in rs), ", ".join(sorted({r.status for r in rs}))]
                      for v, rs in by_variant.items()]))

    s = sections["curves"]
    s.text.append("Lines are the mean over a variant's seeds; the band is the 95% Student-t interval of that mean "
                  "(none with one seed).")
    s.images.append(("train/loss and train/grad_norm", figures.curves_figure(by_variant, ["train/loss", "train/grad_norm"], palette)))
    if any("eval/valid/loss" in r.metrics for r in runs):
        s.images.append(("eval/valid/loss", figures.curves_figure(by_variant, ["eval/valid/loss"], palette)))

    s = sections["final"]
    cols, rows, marks = final_table(by_variant, baseline)
    s.text.append("Last logged value per run; mean over seeds with a 95% percentile-bootstrap interval (10,000 resamples "
                  "of the seeds). Δ is the variant's mean minus the baseline's, its interval from resampling both sides' "
                  "seeds; * marks a difference whose interval excludes 0, i.e. beyond the seed spread. With fewer than about 5 seeds "
                  "a percentile bootstrap is too narrow (it cannot see spread the seeds did not show): read the marker as a "
                  "hint there.")
    s.tables.append((cols, rows))

    s = sections["stability"]
    s.text.append("Per run: loss spikes (steps whose train/loss exceeds 1.5x the median of the 20 steps before), gradient-"
                  "norm peaks (5x), the largest gradient norm, and whether the loss stopped being finite.")
    stability = stability_rows(runs)
    s.tables.append((["run", "variant", "seed", "status", "loss spikes", "grad-norm peaks", "max grad norm", "diverged"],
                     stability))

    s = sections["compute"]
    s.text.append("The eval loss against tokens seen, training wall time (the sum of step times) and training FLOPs "
                  "(steps x the model's FLOPs per step): variants of different cost compared at equal compute.")
    column = "eval/valid/loss" if any("eval/valid/loss" in r.metrics for r in runs) else "train/loss"
    s.images.append((f"{column} vs tokens, wall time, FLOPs", figures.compute_figure(runs, column, palette)))

    s = sections["pareto"]
    pareto = figures.pareto_figure(runs, palette)
    if pareto is None:
        s.text.append("No run has a sampling evaluation (eval.metrics) with a Pareto table.")
    else:
        s.images.append((f"{pareto[2]} vs {pareto[1]}", pareto[0]))
    tiers = tier_table(runs)
    if tiers is not None:
        s.text.append("Shapes all-correct by difficulty tier at each guidance scale of the last evaluation: the rate, its "
                      "95% Wilson interval and N (prompts of that tier).")
        s.tables.append(tiers)

    s = sections["grids"]
    shown = [(r, key, path, prompts) for r in runs for key, path, prompts in r.grids[:3] if path.exists()]
    if not shown:
        s.text.append("No prompt grids (eval.grids) were drawn in these runs.")
    else:
        s.text.append("The last evaluation's grids, up to three per run (rows: prompts, columns: samples with seeds fixed "
                      "across scales and checkpoints).")
    for r, key, path, prompts in shown[:27]:
        s.images.append((f"{r.name}: {key}" + (": " + " | ".join(prompts) if prompts else ""), path.read_bytes()))

    s = sections["config"]
    fields = differing_fields(runs, NOT_A_CHOICE)
    s.text.append(f"The {len(fields)} config fields whose values differ between runs (others are the same everywhere).")
    s.tables.append((["run", *fields], [[r.name, *[_fmt(r.config.get(f)) for f in fields]] for r in runs]))

    s = sections["optuna"]
    if study is None:
        s.text.append("Not an Optuna sweep (no optuna.db in the source folder).")
    else:
        states = pd.Series([t.state.name for t in study.get_trials(deepcopy=False)]).value_counts().to_dict()
        s.text.append(f"Study {study.study_name!r}: " + ", ".join(f"{k} {v}" for k, v in states.items()) + ".")
        for name, img in figures.optuna_figures(study).items():
            if isinstance(img, bytes):
                s.images.append((name, img))
            else:
                s.text.append(f"{name}: {img}")
    return [sections[k] for k in SECTIONS], {"baseline": baseline, "variants": list(by_variant), "marks": marks,
                                             "stability": stability}


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


# -- writers ------------------------------------------------------------------------------------
CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.4em 0}section{margin-bottom:2.2em}
figcaption{font-size:12px;color:#555}.sig{color:#b00;font-weight:bold}"""


def _cell(v) -> str:
    text = html.escape(_fmt(v))
    return f'<td class="sig">{text}</td>' if text == "*" else f"<td>{text}</td>"


def to_html(title: str, sections: list[Section]) -> str:
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{CSS}</style>"
           "</head><body>", f"<h1>{html.escape(title)}</h1>", "<nav>"]
    out += [f'<a href="#{s.key}">{html.escape(TITLES[s.key])}</a> · ' for s in sections]
    out.append("</nav>")
    for s in sections:
        out.append(f'<section id="{s.key}"><h2>{html.escape(TITLES[s.key])}</h2>')
        out += [f"<p>{html.escape(t)}</p>" for t in s.text]
        for cols, rows in s.tables:
            out.append("<table><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in cols) + "</tr>")
            out += ["<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows]
            out.append("</table>")
        for caption, img in s.images:
            data = base64.b64encode(img).decode()
            out.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                       f"<figcaption>{html.escape(caption)}</figcaption></figure>")
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out)


def _md_cell(v) -> str:
    return _fmt(v).replace("|", "\\|").replace("\n", " ")


def to_markdown(title: str, sections: list[Section], folder: Path) -> str:
    out = [f"# {title}", ""]
    for s in sections:
        out += [f"## {TITLES[s.key]}", ""]
        out += [t + "\n" for t in s.text]
        for cols, rows in s.tables:
            out.append("| " + " | ".join(_md_cell(c) for c in cols) + " |")
            out.append("|" + "---|" * len(cols))
            out += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in rows]
            out.append("")
        for i, (caption, img) in enumerate(s.images):
            name = f"figures/{s.key}_{i}.png"
            (folder / name).write_bytes(img)
            out += [f"![{caption}]({name})", ""]
    return "\n".join(out)


def runs_csv(runs: list[Run], stability: list[list]) -> pd.DataFrame:
    """One row per run; `stability`: stability_rows(runs), in the same order."""
    fields = differing_fields(runs, NOT_A_CHOICE)
    rows = []
    for r, stab in zip(runs, stability):
        row = {"run": r.name, "store": str(r.root), "variant": r.variant, "seed": r.seed, "status": r.status}
        row.update({m: final_value(r, m) for m in FINAL_METRICS})
        row.update({"loss_spikes": stab[4], "grad_norm_peaks": stab[5], "max_grad_norm": stab[6]})
        row.update({f: r.config.get(f) for f in fields})
        rows.append(row)
    return pd.DataFrame(rows)


# Logged keys the W&B report charts besides the losses: headline eval metrics by scale, caption
# sensitivity, the optimizer's own statistics.
REPORT_METRICS = re.compile(r"eval/pareto/s[^/]+/(shapes/all|clip/score|fid/fid|shapes_fd/fd)|eval/caption_sensitivity/[a-z]+|optim/.+")


def wandb_panels(runs: list[Run]) -> tuple[list[str], list[str], list[str]]:
    """(the config fields a W&B run set groups by: what varies apart from the seed, the metrics
    to chart, the media keys: Pareto plot, sample grid and prompt grids) of these runs."""
    logged = sorted(set().union(*(r.metrics.columns for r in runs)))
    media = ["eval/pareto_plot", "samples/grid"] + sorted({f"grids/{key}" for r in runs for key, _, _ in r.grids})
    return differing_fields(runs, NOT_A_VARIANT), [k for k in logged if REPORT_METRICS.fullmatch(k)], media


def build_report(source: str, out_dir: str | Path = "reports", name: Optional[str] = None,
                 baseline: Optional[str] = None, wandb_entity: str = "", wandb_project: str = "") -> Path:
    runs = load_runs(source)
    if source.startswith("wandb:"):
        src = Path(source[len("wandb:"):])
    else:
        src = Path(source.split("*")[0]).resolve() if "*" in source else Path(source).resolve()
    name = name or "_".join(src.parts[-2:]) or "report"
    folder = Path(out_dir) / name
    (folder / "figures").mkdir(parents=True, exist_ok=True)
    study = None
    db = src / "optuna.db" if not source.startswith("wandb:") and src.is_dir() else None
    if db is not None and db.exists():
        import optuna

        names = optuna.get_all_study_names(f"sqlite:///{db}")
        study = optuna.load_study(study_name=names[0], storage=f"sqlite:///{db}") if names else None
    title = f"dalle-ablate report: {source}"
    sections, info = build_sections(runs, baseline, study)
    atomic_write(folder / "index.html", to_html(title, sections))
    atomic_write(folder / "report.md", to_markdown(title, sections, folder))
    runs_csv(runs, info["stability"]).to_csv(folder / "runs.csv", index=False)
    group = next((r.meta.get("wandb_group") for r in runs if r.meta.get("wandb_group")), None)
    panels = wandb_panels(runs)
    report = wandb_report(title, group, *panels)
    spec = {"title": title, "group": group, "runs": [r.name for r in runs], "report": report_spec(report)}
    atomic_write(folder / "wandb_report.json", json.dumps(spec, indent=1))
    if wandb_entity and wandb_project:  # online: the same report saved to W&B
        saved = wandb_report(title, group, *panels, wandb_entity, wandb_project).save()
        atomic_write(folder / "wandb_report_url.txt", f"{saved.url}\n")
    return folder
