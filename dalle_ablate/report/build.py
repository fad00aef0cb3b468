"""`dalle-ablate report`: runs -> reports/<name>/index.html (self-contained: figures inline as
PNG data, no scripts, no network), report.md (figures beside it), runs.csv, and a W&B report
spec (wandb_report.json; saved to W&B when online). Variants are what differs between runs
apart from the seed, labelled as the user typed them; the baseline is the first value listed (a
sweep: the best completed trial) unless `--baseline` says otherwise."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pandas as pd

from dalle_ablate.fileio import atomic_write
from dalle_ablate.registry import ConfigError, first_line
from dalle_ablate.report import figures
from dalle_ablate.report import noise as noise_report
from dalle_ablate.report.load import NOT_A_CHOICE, NOT_A_VARIANT, Run, differing_fields, load_runs
from dalle_ablate.report.tables import (ONE_SEED, SAME_PROMPTS, STABILITY_COLUMNS, final_table, fmt, paired_table,
                                        runs_csv, shapes_noise_table, shapes_tier_table, stability_rows, tier_table)
from dalle_ablate.report.writers import Section, to_html, to_markdown
from dalle_ablate.metrics import headlines
from dalle_ablate.track.wandb_api import report_spec, wandb_report

TITLES = {"overview": "Runs and variants", "final": "Final metrics", "noise": "Noise report", "optuna": "Optuna study",
          "curves": "Loss and gradient norm across seeds", "stability": "Stability", "compute": "Equal-compute views",
          "pareto": "Guidance-scale Pareto curves", "shapes": "Shapes evaluation by tier", "grids": "Prompt grids",
          "config": "Config diff"}
FOLDED = ("noise", "stability", "shapes", "grids", "config")  # long: closed until clicked


def section_keys(sweep: bool) -> list[str]:
    """The summary first; a sweep's study right after it, where its answer is."""
    rest = ["noise", "curves", "stability", "compute", "pareto", "shapes", "grids", "config"]
    return ["overview", "optuna", "final", *rest] if sweep else ["overview", "final", *rest]


def objective(study) -> tuple[str, bool]:
    """(the metric a study optimised, whether lower is better)."""
    names = getattr(study, "metric_names", None)
    return (names[0] if names else "eval/valid/loss"), study.directions[0].name == "MINIMIZE"


def group_variants(runs: list[Run], study) -> tuple[dict[str, list[Run]], list[Run], str]:
    """(variant -> its runs, in the order compared; the runs left out; how the order was chosen).
    A multirun keeps the order of its jobs, so the first value the user listed comes first; a
    sweep compares completed trials only, best objective first."""
    compared = runs if study is None else [r for r in runs if r.status == "finished"]
    left_out = [r for r in runs if r not in compared]
    by_variant: dict[str, list[Run]] = {}
    for r in compared:
        by_variant.setdefault(r.variant, []).append(r)
    if study is None:
        return by_variant, left_out, "the first value listed"
    metric, lower = objective(study)

    def score(v: str) -> float:
        vals = [float(r.summary.get(metric, float("nan"))) for r in by_variant[v]]
        mean = sum(vals) / len(vals)
        return mean if lower else -mean

    ranked = sorted(by_variant, key=lambda v: (pd.isna(score(v)), score(v)))
    return {v: by_variant[v] for v in ranked}, left_out, f"the best completed trial by {metric}"


def build_sections(runs: list[Run], baseline: Optional[str], study=None,
                   margins: Optional[dict[str, str]] = None) -> tuple[list[Section], dict]:
    by_variant, left_out, why = group_variants(runs, study)
    if not by_variant:
        raise ConfigError(f"report: none of the {len(runs)} runs finished; nothing to compare")
    if baseline is None:
        baseline = next(iter(by_variant))
    else:
        matches = [v for v in by_variant if baseline == v] or [v for v in by_variant if baseline in v]
        if len(matches) != 1:
            raise ConfigError(f"--baseline {baseline!r} matches {len(matches)} variants; variants: {'; '.join(by_variant)}")
        baseline, why = matches[0], "--baseline"
    compared = [r for rs in by_variant.values() for r in rs]
    palette = figures.colors(list(by_variant))
    one_seed = max(len(rs) for rs in by_variant.values()) == 1
    sections = {k: Section(k, TITLES[k], folded=k in FOLDED) for k in section_keys(study is not None)}

    s = sections["overview"]
    s.text.append(f"{len(compared)} runs in {len(by_variant)} variants (what differs between runs apart from the seed, "
                  f"as typed); baseline: {baseline} ({why}).")
    if left_out:
        s.text.append(f"Left out of the comparisons, not completed: {', '.join(f'{r.name} ({r.status})' for r in left_out)}.")
    if one_seed:
        s.text.append("1 seed per variant: no difference can be tested. The tables give each run's value; rerun with "
                      "seed=0,1,2 for intervals.")
    s.tables.append((["variant", "runs", "seeds", "status"],
                     [[v, len(rs), ", ".join(str(r.seed) for r in rs), ", ".join(sorted({r.status for r in rs}))]
                      for v, rs in by_variant.items()]))

    s = sections["final"]
    cols, rows, judged = final_table(by_variant, baseline, margins)
    s.text.append("Last logged value per run; mean over seeds with a 95% Student-t interval (the curves' bands use the "
                  "same). Δ is the variant's mean minus the baseline's, judged as a study's findings are "
                  "(docs/statistics.md): over the seeds both ran, each seed's difference (the same seed shares data "
                  "order and initial keys), or Welch's unpaired interval where they share fewer than two; each "
                  "difference on its own noise; the verdict by Holm's procedure over every difference of this table at "
                  "a family-wise 5 %" + (" with the margins Δ given (" + ", ".join(f"{k} ±{v}" for k, v in margins.items())
                                         + "): equivalent within ±Δ, or better/worse by more than Δ" if margins else
                                         "; --margin METRIC=Δ adds the equivalence test and the seeds a difference of Δ "
                                         "needs") + ". rho is the two runs' correlation across the seeds they share, "
                  f"what pairing bought. A variant of one seed shows '{ONE_SEED}'.")
    s.tables.append((cols, rows))

    sections["noise"] = noise_report.section(by_variant, [(f"{v} vs {baseline}", v, baseline) for v in by_variant
                                                          if v != baseline])
    sections["noise"].folded = True

    s = sections["curves"]
    s.text.append("Lines are the mean over a variant's seeds; the band is the 95% Student-t interval of that mean "
                  "(none with one seed). The gradient norm, on a log axis, shows the geometric mean and the interval of "
                  "its logarithm, which stays positive.")
    s.images.append(("train/loss and train/grad_norm", figures.curves_figure(by_variant, ["train/loss", "train/grad_norm"], palette)))
    if any("eval/valid/loss" in r.metrics for r in compared):
        s.images.append(("eval/valid/loss", figures.curves_figure(by_variant, ["eval/valid/loss"], palette)))

    s = sections["stability"]
    s.text.append("Per run: loss spikes (steps whose train/loss exceeds 1.5x the median of the 20 steps before), gradient-"
                  "norm peaks (5x), the largest gradient norm after warm-up (schedule.warmup_steps) and its step, and "
                  "whether the loss stopped being finite; with float16 gradient scaling, the steps skipped on overflow.")
    stability = stability_rows(runs)
    s.tables.append((STABILITY_COLUMNS, stability))

    s = sections["compute"]
    s.text.append("The eval loss against tokens seen, training wall time (the sum of step times: it measures the machine's "
                  "load as well as the variant) and training FLOPs (steps x the model's FLOPs per step): variants of "
                  "different cost compared at equal compute.")
    column = "eval/valid/loss" if any("eval/valid/loss" in r.metrics for r in compared) else "train/loss"
    s.images.append((f"{column} vs tokens, wall time, FLOPs", figures.compute_figure(compared, column, palette)))

    s = sections["pareto"]
    pareto = figures.pareto_figure(compared, palette)
    if pareto is None:
        s.text.append("No run has a sampling evaluation (eval.metrics) with a Pareto table.")
    else:
        s.images.append((f"{pareto[2]} vs {pareto[1]}", pareto[0]))
    tiers = tier_table(compared)
    if tiers is not None:
        s.text.append("Shapes all-correct by difficulty tier at each guidance scale of the last evaluation: the rate, its "
                      "95% Wilson interval and N (prompts of that tier).")
        s.tables.append(tiers)

    s = sections["shapes"]
    tiers = shapes_tier_table(by_variant)
    if tiers is None:
        s.text.append("No run has the shapes evaluation (eval.metrics=[shapes]).")
    else:
        s.text.append("The last evaluation, per guidance scale and tier, means over a variant's seeds: all-correct; the "
                      "share of caption objects found (drawn at all); each attribute asked only of found objects (DSG) / "
                      "over all checks (a missing object's attributes wrong, every extra object one more wrong check); "
                      "the relation where both its objects were found (VISOR) / over all images, with that coverage; "
                      "images with ink that is no object (unparsed). Chance for captions that do not belong to their "
                      "images: docs/architecture.md, \"The shapes evaluation\".")
        s.tables.append(tiers)
        noise = shapes_noise_table(by_variant)
        if noise is not None:  # runs that logged how many prompts they scored
            s.text.append("The evaluation's own noise apart from the seeds': all-correct's standard deviation over seeds "
                          "beside the binomial standard deviation over the prompts of one run (what re-drawing the "
                          "prompts alone would move it by). A seed spread near the prompt noise is mostly the evaluation's.")
            s.tables.append(noise)
        paired = paired_table(by_variant, baseline)
        if paired is not None:
            s.text.append("Each variant against the baseline prompt by prompt: runs of the same seed, the same prompts and "
                          "the same sampling noise (" + ", ".join(SAME_PROMPTS) + " equal), compared on each prompt's "
                          "all-correct verdict. Δ with a 95% paired bootstrap interval over prompts; McNemar's exact p "
                          "over the prompts right in one run only, pooled over the seed pairs. This is the evaluation's "
                          "resolution at these seeds, not the seed spread (Final metrics compares over seeds).")
            s.tables.append(paired)

    s = sections["grids"]
    # Every grid of the last evaluation (list / category / scale), the variants side by side: each
    # variant's first seed, the same prompts in the same rows, the same sampling noise.
    keys = list(dict.fromkeys(key for r in compared for key, path, _ in r.grids if path.exists()))
    if not keys:
        s.text.append("No prompt grids (eval.grids) were drawn in these runs.")
    else:
        s.text.append("The last evaluation's grids, every list, category and scale, one image each with the variants side "
                      "by side (each variant's first seed; rows: prompts, columns: samples, the noise fixed across "
                      "variants, scales and checkpoints).")
    for key in keys:
        panels, prompts = [], []
        for variant, rs in by_variant.items():
            found = next(((path, p) for r in rs for k, path, p in r.grids if k == key and path.exists()), None)
            if found is not None:
                panels.append((variant, found[0]))
                prompts = prompts or found[1]
        s.images.append((key + (": " + " | ".join(prompts) if prompts else ""), figures.side_by_side(panels)))

    s = sections["config"]
    fields = differing_fields(runs, NOT_A_CHOICE)
    s.text.append(f"The {len(fields)} config fields whose values differ between runs (others are the same everywhere).")
    s.tables.append((["run", *fields], [[r.name, *[fmt(r.config.get(f)) for f in fields]] for r in runs]))

    if study is not None:
        s = sections["optuna"]
        metric, lower = objective(study)
        states = pd.Series([t.state.name for t in study.get_trials(deepcopy=False)]).value_counts().to_dict()
        s.text.append(f"Study {study.study_name!r}, {metric} ({'lower' if lower else 'higher'} is better): "
                      + ", ".join(f"{k} {v}" for k, v in states.items()) + ".")
        for name, img in figures.optuna_figures(study, metric).items():
            if isinstance(img, bytes):
                s.images.append((name, img))
            else:
                s.text.append(f"{name}: {img}")
    return list(sections.values()), {"baseline": baseline, "variants": list(by_variant), "judged": judged,
                                     "stability": stability}


# Logged keys the W&B report charts besides the losses: headline eval metrics by scale, caption
# sensitivity, the optimizer's own statistics.
REPORT_METRICS = re.compile(rf"eval/pareto/s[^/]+/({'|'.join(re.escape(m.key) for m in headlines('samples'))})"
                            rf"|{'|'.join(re.escape(m.logged()) for m in headlines('model'))}|optim/.+")


def wandb_panels(runs: list[Run]) -> tuple[list[str], list[str], list[str]]:
    """(the config fields a W&B run set groups by: what varies apart from the seed, the metrics
    to chart, the media keys: Pareto plot, sample grid and prompt grids) of these runs."""
    logged = sorted(set().union(*(r.metrics.columns for r in runs)))
    media = ["eval/pareto_plot", "samples/grid"] + sorted({f"grids/{key}" for r in runs for key, _, _ in r.grids})
    return differing_fields(runs, NOT_A_VARIANT), [k for k in logged if REPORT_METRICS.fullmatch(k)], media


def sweep_study(db: Path):
    """The Optuna study of a sweep's optuna.db (None if it holds none), or a ConfigError naming the file."""
    import optuna
    import sqlalchemy

    if db.stat().st_size == 0:  # sqlite would take it for a new database, and optuna write its tables into it
        raise ConfigError(f"{db}: empty, not an Optuna database")
    url = f"sqlite:///{db}"
    try:
        names = optuna.get_all_study_names(url)
        study = optuna.load_study(study_name=names[0], storage=url) if names else None
        if study is not None:
            study.get_trials(deepcopy=False)  # every page the report reads, read now
        return study
    except sqlalchemy.exc.DatabaseError as e:
        raise ConfigError(f"{db}: not a readable Optuna database, truncated or corrupt ({first_line(e.orig or e)})") from None


def build_report(source: str, out_dir: str | Path = "reports", name: Optional[str] = None,
                 baseline: Optional[str] = None, wandb_entity: str = "", wandb_project: str = "",
                 skipped: Optional[list[str]] = None, margins: Optional[dict[str, str]] = None) -> Path:
    """The report's folder. A run store or sweep database that cannot be read is left out, named
    in the report and in `skipped` (one line each)."""
    skipped = [] if skipped is None else skipped
    runs = load_runs(source, skipped=skipped)
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
        try:
            study = sweep_study(db)
        except ConfigError as e:
            skipped.append(f"{e}; the runs are compared as a multirun's, without the sweep's trials")
    title = f"dalle-ablate report: {source}"
    sections, info = build_sections(runs, baseline, study, margins)
    if skipped:  # in the summary at the top: what the report could not read
        sections[0].text.append(f"Left out, unreadable ({len(skipped)}): " + "; ".join(skipped) + ".")
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
