"""`dalle-ablate report`: the report's sections, built from the runs and written to reports/<name>/ (index.html,
report.md, runs.csv, wandb_report.json). What each holds and how the baseline is chosen: docs/guides/reports.md."""

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
from dalle_ablate.report.load import NOT_A_CHOICE, NOT_A_VARIANT, Run, differing_fields, load_runs, read_json
from dalle_ablate.report import prose as P
from dalle_ablate.report import staged
from dalle_ablate.report.study_file import Stages
from dalle_ablate.report.transitions import Rule, late_section
from dalle_ablate.report.tables import (
    FINAL_METRICS,
    ONE_SEED,
    SAME_PROMPTS,
    STABILITY_COLUMNS,
    _needs,
    final_table,
    fmt,
    fmt3,
    paired_table,
    runs_csv,
    shapes_noise_table,
    shapes_tier_table,
    stability_rows,
    tier_table,
)
from dalle_ablate.report.writers import Section, to_html, to_markdown
from dalle_ablate.metrics import headlines, metric
from dalle_ablate.track.wandb_api import report_spec, wandb_report

TITLES = {
    "overview": "Summary",
    "final": "Final metrics",
    "stages": P.STAGES_TITLE,
    "noise": "Noise report",
    "optuna": "Optuna study",
    "curves": "Loss and gradient norm across seeds",
    "late": P.LATE_TITLE,
    "stability": "Stability",
    "compute": "Equal-compute views",
    "pareto": "Guidance-scale Pareto curves",
    "shapes": "Shapes evaluation by tier",
    "grids": "Prompt grids",
    "config": "Config diff",
}
FOLDED = ("noise", "stability", "shapes", "grids", "config")  # long: closed until clicked


def section_keys(sweep: bool, staged: bool = False) -> list[str]:
    """The summary first; a sweep's study right after it, where its answer is; a staged report's
    stages after the final metrics they judge."""
    rest = ["noise", "curves", "late", "stability", "compute", "pareto", "shapes", "grids", "config"]
    rest = ["stages", *rest] if staged else rest
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


def choose_baseline(by_variant: dict[str, list[Run]], baseline: Optional[str], why: str) -> tuple[str, str]:
    """(the baseline variant, why it is): --baseline, matched exactly or as the one variant it is
    part of; else the first variant."""
    if baseline is None:
        return next(iter(by_variant)), why
    matches = [v for v in by_variant if baseline == v] or [v for v in by_variant if baseline in v]
    if len(matches) != 1:
        raise ConfigError(f"--baseline {baseline!r} matches {len(matches)} variants; variants: {'; '.join(by_variant)}")
    return matches[0], "--baseline"


def variant_sentence(variant: str, judged: dict, metrics=FINAL_METRICS) -> str:
    """One variant against the baseline in the verdict engine's words (tables.against_baseline's
    rows): per metric, the verdict, the difference and its 95 % interval, the seeds it is over."""
    parts = []
    for m in metrics:
        j, unit = judged[(variant, m)], metric(m).unit
        diff = ("+" if j["d"] > 0 else "") + fmt3(j["d"])
        if j["n"] < 2:
            parts.append(P.ONE_SEED_JUDGEMENT.format(metric=m, verdict=j["verdict"], diff=diff, unit=unit))
            continue
        how = f"{int(j['n'])} seeds, {'paired' if j['paired'] else 'Welch'}"
        needs = f"; {_needs(j)}" if j["verdict"] == "not resolved" and j["plan"][0] else ""
        parts.append(
            P.JUDGEMENT.format(
                metric=m,
                verdict=j["verdict"],
                diff=diff,
                unit=unit,
                low=fmt3(j["low"]),
                high=fmt3(j["high"]),
                how=how + needs,
            )
        )
    return P.VARIANT.format(variant=variant, judgements="; ".join(parts))


def overview_section(
    by_variant: dict[str, list[Run]],
    left_out: list[Run],
    baseline: str,
    why: str,
    judged: dict,
    margins: Optional[dict[str, str]],
) -> Section:
    """The answer first, a sentence per variant; then what was compared."""
    s = Section("overview", TITLES["overview"])
    given = P.ANSWER_MARGINS.format(margins=", ".join(f"{k} ±{v}" for k, v in margins.items())) if margins else ""
    s.text.append(P.ANSWER.format(baseline=baseline, margins=given))
    s.text += [variant_sentence(v, judged) for v in by_variant if v != baseline]
    s.text.append(
        P.OVERVIEW.format(
            runs=sum(len(rs) for rs in by_variant.values()), variants=len(by_variant), baseline=baseline, why=why
        )
    )
    if left_out:
        s.text.append(P.LEFT_OUT.format(runs=", ".join(f"{r.name} ({r.status})" for r in left_out)))
    if max(len(rs) for rs in by_variant.values()) == 1:
        s.text.append(P.ONE_SEED)
    s.tables.append(
        (
            ["variant", "runs", "seeds", "status"],
            [
                [v, len(rs), ", ".join(str(r.seed) for r in rs), ", ".join(sorted({r.status for r in rs}))]
                for v, rs in by_variant.items()
            ],
        )
    )
    return s


def final_section(
    by_variant: dict[str, list[Run]], baseline: str, margins: Optional[dict[str, str]], judged: Optional[dict] = None
) -> tuple[Section, dict]:
    cols, rows, judged = final_table(by_variant, baseline, margins, judged)
    given = (
        P.FINAL_MARGIN.format(margins=", ".join(f"{k} ±{v}" for k, v in margins.items()))
        if margins
        else P.FINAL_NO_MARGIN
    )
    return Section("final", TITLES["final"], [P.FINAL.format(margin=given, one_seed=ONE_SEED)], [(cols, rows)]), judged


def curves_section(by_variant: dict[str, list[Run]], palette: dict) -> Section:
    s = Section("curves", TITLES["curves"], [P.CURVES])
    s.images.append(
        (
            "train/loss and train/grad_norm",
            figures.curves_figure(by_variant, ["train/loss", "train/grad_norm"], palette),
        )
    )
    if any("eval/valid/loss" in r.metrics for rs in by_variant.values() for r in rs):
        s.images.append(("eval/valid/loss", figures.curves_figure(by_variant, ["eval/valid/loss"], palette)))
    return s


def stability_section(runs: list[Run]) -> tuple[Section, list[list]]:
    stability = stability_rows(runs)
    return Section("stability", TITLES["stability"], [P.STABILITY], [(STABILITY_COLUMNS, stability)]), stability


def compute_section(compared: list[Run], palette: dict) -> Section:
    column = "eval/valid/loss" if any("eval/valid/loss" in r.metrics for r in compared) else "train/loss"
    return Section(
        "compute",
        TITLES["compute"],
        [P.COMPUTE],
        images=[(f"{column} vs tokens, wall time, FLOPs", figures.compute_figure(compared, column, palette))],
    )


def pareto_section(compared: list[Run], palette: dict) -> Section:
    """Every run's last Pareto curve on one plot, or the reason there is nothing to plot; the shapes
    all-correct by tier."""
    s = Section("pareto", TITLES["pareto"])
    flat = figures.flat_pareto(compared)
    pareto = figures.pareto_figure(compared, palette) if flat is None else None
    if flat is not None:
        s.text.append(P.FLAT_PARETO.format(metric=flat[0], value=fmt3(flat[1])))
    elif pareto is None:
        s.text.append(P.NO_PARETO)
    else:
        s.images.append((f"{pareto[2]} vs {pareto[1]}", pareto[0]))
    tiers = tier_table(compared)
    if tiers is not None:
        s.text.append(P.TIERS)
        s.tables.append(tiers)
    return s


def shapes_section(by_variant: dict[str, list[Run]], baseline: str) -> Section:
    """The shapes evaluation per tier, its own noise, and each variant against the baseline prompt
    by prompt, each table under its own heading."""
    s = Section("shapes", TITLES["shapes"], folded=True)
    tiers = shapes_tier_table(by_variant)
    if tiers is None:
        s.text.append(P.NO_SHAPES)
        return s
    s.text.append(P.SHAPES)
    s.tables.append(tiers)
    noise = shapes_noise_table(by_variant)
    if noise is not None:  # runs that logged how many prompts they scored
        s.parts.append(Section("shapes-noise", "The evaluation's own noise", [P.SHAPES_NOISE], [noise]))
    paired = paired_table(by_variant, baseline)
    if paired is not None:
        s.parts.append(
            Section(
                "shapes-paired",
                "Prompt by prompt against the baseline",
                [P.SHAPES_PAIRED.format(same=", ".join(SAME_PROMPTS))],
                [paired],
            )
        )
    return s


def grids_section(by_variant: dict[str, list[Run]], compared: list[Run]) -> Section:
    """Every grid of the last evaluation (list / category / scale), the variants side by side: each
    variant's first seed, the same prompts in the same rows, the same sampling noise."""
    s = Section("grids", TITLES["grids"], folded=True)
    keys = list(dict.fromkeys(key for r in compared for key, path, _ in r.grids if path.exists()))
    s.text.append(P.GRIDS if keys else P.NO_GRIDS)
    for key in keys:
        panels, prompts = [], []
        for variant, rs in by_variant.items():
            found = next(((path, p) for r in rs for k, path, p in r.grids if k == key and path.exists()), None)
            if found is not None:
                panels.append((variant, found[0]))
                prompts = prompts or found[1]
        s.images.append((key + (": " + " | ".join(prompts) if prompts else ""), figures.side_by_side(panels)))
    return s


def config_section(runs: list[Run]) -> Section:
    fields = differing_fields(runs, NOT_A_CHOICE)
    return Section(
        "config",
        TITLES["config"],
        [P.CONFIG.format(n=len(fields))],
        [(["run", *fields], [[r.name, *[fmt(r.config.get(f)) for f in fields]] for r in runs])],
        folded=True,
    )


def optuna_section(study) -> Section:
    s = Section("optuna", TITLES["optuna"])
    metric, lower = objective(study)
    states = pd.Series([t.state.name for t in study.get_trials(deepcopy=False)]).value_counts().to_dict()
    s.text.append(
        P.OPTUNA.format(
            name=study.study_name,
            metric=metric,
            better="lower" if lower else "higher",
            states=", ".join(f"{k} {v}" for k, v in states.items()),
        )
    )
    for name, img in figures.optuna_figures(study, metric).items():
        if isinstance(img, bytes):
            s.images.append((name, img))
        else:
            s.text.append(f"{name}: {img}")
    return s


def build_sections(
    runs: list[Run],
    baseline: Optional[str],
    study=None,
    margins: Optional[dict[str, str]] = None,
    transition: Rule = Rule(),
    stages: Optional[Stages] = None,
) -> tuple[list[Section], dict]:
    """The report's sections in order (section_keys) and what the files beside it need; `transition`: the
    late-seed rule; `stages`: the declared stages (report/staged.py), whose record it returns."""
    by_variant, left_out, why = group_variants(runs, study)
    if not by_variant:
        raise ConfigError(f"report: none of the {len(runs)} runs finished; nothing to compare")
    baseline, why = choose_baseline(by_variant, baseline, why)
    compared = [r for rs in by_variant.values() for r in rs]
    palette = figures.colors(list(by_variant))
    looked, record = staged.judge_report(by_variant, baseline, margins, stages) if stages else (None, None)
    final, judged = final_section(by_variant, baseline, margins, looked)
    noise = noise_report.section(by_variant, [(f"{v} vs {baseline}", v, baseline) for v in by_variant if v != baseline])
    noise.folded = True
    stability, stability_table = stability_section(runs)
    sections = {
        "overview": overview_section(by_variant, left_out, baseline, why, judged, margins),
        "final": final,
        "noise": noise,
        "curves": curves_section(by_variant, palette),
        "late": late_section(by_variant, transition, "late", group="variant"),
        "stability": stability,
        "compute": compute_section(compared, palette),
        "pareto": pareto_section(compared, palette),
        "shapes": shapes_section(by_variant, baseline),
        "grids": grids_section(by_variant, compared),
        "config": config_section(runs),
    }
    if study is not None:
        sections["optuna"] = optuna_section(study)
    if record is not None:
        sections["stages"] = staged.report_section(stages, record, judged, by_variant)
        sections["overview"].text.insert(1, P.REPORT_STAGED_ANSWER)
    for key in FOLDED:
        sections[key].folded = True
    return [sections[k] for k in section_keys(study is not None, record is not None)], {
        "stages": record,
        "baseline": baseline,
        "variants": list(by_variant),
        "judged": judged,
        "stability": stability_table,
    }


# Logged keys the W&B report charts besides the losses: headline eval metrics by scale, caption
# sensitivity, the optimizer's own statistics.
REPORT_METRICS = re.compile(
    rf"eval/pareto/s[^/]+/({'|'.join(re.escape(m.key) for m in headlines('samples'))})"
    rf"|{'|'.join(re.escape(m.logged()) for m in headlines('model'))}|optim/.+"
)


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
        raise ConfigError(
            f"{db}: not a readable Optuna database, truncated or corrupt ({first_line(e.orig or e)})"
        ) from None


def _same_plan(kept: dict, now: dict, stages: Stages, path: Path) -> None:
    """A staged report judges what its first report froze beside it: the same design and margins."""
    staged.check_stages(kept, stages, f"--stages: {path}")
    if kept.get("margins") != now.get("margins"):
        raise ConfigError(
            f"--stages: {path} froze the margins {kept.get('margins')}, this report's are {now.get('margins')}; a "
            "changed margin is a new declaration on fresh seeds (another --out)"
        )


def build_report(
    source: str,
    out_dir: str | Path = "reports",
    name: Optional[str] = None,
    baseline: Optional[str] = None,
    wandb_entity: str = "",
    wandb_project: str = "",
    skipped: Optional[list[str]] = None,
    margins: Optional[dict[str, str]] = None,
    transition: Rule = Rule(),
    stages: Optional[Stages] = None,
) -> Path:
    """The report's folder. A run store or sweep database that cannot be read is left out, named
    in the report and in `skipped` (one line each). `transition`: the late-seed view's rule;
    `stages`: the comparisons' declared stages (the plan's record beside the report, stages.json)."""
    skipped = [] if skipped is None else skipped
    runs = load_runs(source, skipped=skipped)
    if source.startswith("wandb:"):
        src = Path(source[len("wandb:") :])
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
    sections, info = build_sections(runs, baseline, study, margins, transition, stages)
    if info["stages"] is not None and (folder / "stages.json").exists():  # what an earlier report froze
        _same_plan(read_json(folder / "stages.json"), info["stages"], stages, folder / "stages.json")
    if skipped:  # in the summary at the top: what the report could not read
        sections[0].text.append(P.UNREADABLE.format(n=len(skipped), what="; ".join(skipped)))
    atomic_write(folder / "index.html", to_html(title, sections, number=fmt3))
    atomic_write(folder / "report.md", to_markdown(title, sections, folder, number=fmt3))
    runs_csv(runs, info["stability"]).to_csv(folder / "runs.csv", index=False)
    if info["stages"] is not None:  # what the rule asked for and why, as a study keeps it
        atomic_write(folder / "stages.json", json.dumps(info["stages"], indent=1) + "\n")
    group = next((r.meta.get("wandb_group") for r in runs if r.meta.get("wandb_group")), None)
    panels = wandb_panels(runs)
    report = wandb_report(title, group, *panels)
    spec = {"title": title, "group": group, "runs": [r.name for r in runs], "report": report_spec(report)}
    atomic_write(folder / "wandb_report.json", json.dumps(spec, indent=1))
    if wandb_entity and wandb_project:  # online: the same report saved to W&B
        saved = wandb_report(title, group, *panels, wandb_entity, wandb_project).save()
        atomic_write(folder / "wandb_report_url.txt", f"{saved.url}\n")
    return folder
