"""A study's results page (docs/results/<study>.md), its answer first: the summary, the noise report, then the details.
Markdown with its figures beside it; every number with its unit, to three significant digits; the method is linked
(docs/statistics.md), never restated."""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from dalle_ablate.metrics import STUDY, Metric, metric
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import figures
from dalle_ablate.report import noise as noise_report
from dalle_ablate.report import prose as P
from dalle_ablate.report import staged, stress
from dalle_ablate.stats import verdicts as V
from dalle_ablate.report.findings import STUDY_SCALE, Judged, _arms_by, replicate, study_value, unit_of
from dalle_ablate.report.judgement import Judgement, judge_page
from dalle_ablate.report.study_file import TOPUPS, Finding, Study
from dalle_ablate.report.load import Run, series
from dalle_ablate.stats.basic import diverged, mean_ci
from dalle_ablate.report.tables import fmt3, shapes_noise_table
from dalle_ablate.report.transitions import late_section
from dalle_ablate.report.writers import Section


CONF = resources.files("dalle_ablate.conf")  # the package's config groups: the arms' and experiments' files
STATISTICS = Path(__file__).resolve().parents[2] / "docs" / "statistics.md"  # in a source checkout


def arm_definition(arm: str) -> Optional[tuple[str, list[str]]]:
    """(what the arm is: the comment at the top of its conf/arm/<arm>.yaml; its overrides, as
    `key=value` the way the command line gives them, a config group's choice as `group=option`),
    read from the package's conf; None if the package has no such arm."""
    path = CONF / "arm" / f"{arm}.yaml"
    if not path.is_file():
        return None
    text = path.read_text()
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            comment.append(line.lstrip("#").strip())
    raw = yaml.safe_load(text) or {}
    overrides = []
    for d in raw.pop("defaults", None) or []:
        if isinstance(d, dict):
            overrides += [f"{k.removeprefix('override').strip().lstrip('/')}={v}" for k, v in d.items()]

    def flat(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                flat(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            value = node if isinstance(node, str) else yaml.safe_dump(node, default_flow_style=True).strip()
            overrides.append(f"{prefix}={value.removesuffix(chr(10) + '...')}")

    flat("", raw)
    return " ".join(comment), overrides


def arms_section(study: Study, arms: list[str]) -> Section:
    """What each arm is: its name, the comment of its conf/arm/ file and its overrides."""
    s = Section("definitions", "The arms")
    s.text.append(P.ARMS.format(experiment=study.experiment))
    rows = []
    for arm in arms:
        found = arm_definition(arm)
        what, overrides = found if found is not None else (f"(no conf/arm/{arm}.yaml in this package)", [])
        none = "none: the defaults as they are" if arm == study.baseline else "none"
        rows.append(
            [
                arm + (" (baseline)" if arm == study.baseline else ""),
                what,
                ", ".join(f"`{o}`" for o in overrides) or none,
            ]
        )
    s.tables.append((["arm", "what it is", "overrides"], rows))
    return s


def arm_rows(baseline: str, by_arm: dict[str, list[Run]]) -> tuple[list[str], list[list]]:
    """Per arm: seeds, status, each metric's mean [95% t interval], spikes and divergences."""
    cols = ["arm", "seeds", "finished"]
    for m in ("eval_loss", "shapes_all", "step_time"):
        cols += [f"{m} ({unit_of(m)})", f"{m} 95% CI ({unit_of(m)})"]
    cols += ["loss spikes (per run)", "diverged"]
    rows = []
    for arm, runs in by_arm.items():
        done = [r for r in runs if r.status == "finished"]
        row = [
            arm + (" (baseline)" if arm == baseline else ""),
            ", ".join(str(r.seed) for r in runs),
            f"{len(done)}/{len(runs)}",
        ]
        for m in ("eval_loss", "shapes_all", "step_time"):
            reps = [v for v in (replicate(STUDY[m], r) for r in done) if np.isfinite(v)]
            mean, lo, hi = mean_ci(reps)
            if not reps and done and STUDY[m].per_job:  # only members, who log their job's one measurement
                mean, lo, hi = float(np.nanmean([study_value(STUDY[m], r) for r in done])), math.nan, math.nan
            row += [mean, _interval(lo, hi)]
        row += [
            " / ".join(str(int(study_value(STUDY["loss_spikes"], r))) for r in runs),
            sum(diverged(series(r, "train/loss")[1], r.status) for r in runs),
        ]
        rows.append(row)
    return cols, rows


def _interval(lo: float, hi: float, unit: str = "") -> str:
    return f"[{fmt3(lo)}, {fmt3(hi)}]" + (f" {unit}" if unit else "") if np.isfinite(lo) and np.isfinite(hi) else "–"


def in_margins(r: Judged) -> tuple[float, float, float]:
    """A finding's difference and 95 % interval in units of its margin Δ, + on the side the claim
    predicts (as the forest plot draws them); NaN without a margin."""
    scale = r.finding.side / r.margin if r.margin > 0 else math.nan
    low, high = sorted((r.low * scale, r.high * scale))
    return r.diff * scale, low, high


def summary_row(r: Judged) -> list:
    """A finding's summary row: claim, verdict, difference in units of Δ, and seeds used / planned (at the
    observed difference, its range across the 95 % interval) / needed for a difference of Δ."""
    f = r.finding
    d, low, high = in_margins(r)
    diff = "–" if not np.isfinite(d) else ("+" if d > 0 else "") + fmt3(d) + " " + _interval(low, high)
    verdict = r.verdict.removesuffix(" (equivalent within ±Δ)")  # the table's lead says what ±Δ means
    if r.code == V.UNTESTABLE:  # why: in the claims table below
        verdict = verdict.split(":")[0]
    if verdict.startswith("not resolved"):
        verdict = "not resolved" + (
            ", the effect likely smaller than Δ" if verdict.startswith("not resolved at ") else ""
        )
    untestable = r.code == V.UNTESTABLE
    needed = "–" if r.spread.needed == 0 or untestable else _count(r.spread.needed)
    plan = "–"
    planned, fewest, most = r.spread.plan
    if r.code == V.NOT_RESOLVED and planned:  # a plan only where more seeds are what is missing
        plan = _count(planned) + ("" if fewest == most == planned else f" ({_count(fewest)}–{_count(most)})")
    return [f.id, f"{f.claim} ({f.metric})", verdict, diff, f"{len(r.spread.seeds)} / {plan} / {needed}"]


def _count(n: int) -> str:
    return f"> {V.MAX_SEEDS}" if n > V.MAX_SEEDS else str(n)


def summary_section(name: str, rows: list[Judged], statistics: str) -> Section:
    """The page's first screen: how many findings settled, each claim's verdict and difference in
    units of Δ, and the forest plot of them all."""
    counts = {v: sum(r.code == i for r in rows) for i, v in enumerate(P.VERDICTS)}  # in VERDICTS' order
    settled = sum(r.code in (V.REPRODUCED, V.SMALLER, V.NO_EFFECT, V.CONTRADICTED) for r in rows)
    s = Section(f"{name}_summary", "Summary")  # key: the forest plot's file name, the study's as the others
    s.text.append(
        P.SETTLED.format(k=len(rows), settled=settled, counts=", ".join(f"{n} {v}" for v, n in counts.items() if n))
    )
    s.text.append(P.HOW_TO_READ.format(k=len(rows), statistics=statistics))
    s.tables.append((P.SUMMARY_COLUMNS, [summary_row(r) for r in rows]))
    s.images.append((P.FOREST, figures.forest_figure(rows)))
    return s


def reading(m: Metric) -> str:
    """How a study reads one run's value of `m` (findings.py study_value), in words."""
    if m.reads == "given":
        return "measured on runs of its own, per arm and seed"
    if m.reads == "median":
        return "the median over the run's steps"
    if m.value is not None:
        return "over the run's log"
    return (
        f"at guidance scale {STUDY_SCALE:g}, the last evaluation" if m.source == "samples" else "the last logged value"
    )


def method_section(study: Study, by_arm: dict[str, list[Run]], provenance: list[str], statistics: str) -> Section:
    """Where the page comes from (its provenance lines), what its metrics and runs are, and where
    the method is written."""
    s = Section("method", P.METHOD_TITLE)
    s.text.append(f"Source: {study.source}.")
    s.text += provenance
    s.text.append(P.METHOD.format(statistics=statistics))
    used = [STUDY[m] for m in dict.fromkeys(f.metric for f in study.findings)]
    s.text.append(
        P.METRICS_LINE.format(
            metrics="; ".join(
                P.METRIC.format(name=m.study, key=m.key, what=m.what, reading=reading(m), unit=m.unit) for m in used
            )
        )
    )
    base = by_arm.get(study.baseline) or next(iter(by_arm.values()))
    c, m = base[0].config, base[0].meta
    s.text.append(
        P.RUNS_LINE.format(
            steps=c.get("trainer.steps"),
            batch=c.get("trainer.batch_size"),
            d_model=c.get("model.d_model"),
            enc=c.get("model.encoder_layers"),
            dec=c.get("model.decoder_layers"),
            params=m.get("params", "?"),
            seeds=max(len(rs) for rs in by_arm.values()),
        )
    )
    if study.scale_note:
        s.text.append(study.scale_note)
    return s


def over_training(r: Judged, courses: dict) -> str:
    """At how many evaluations the 95 % interval lay beyond 0 on the predicted side, and on the other."""
    if r.finding.id not in courses:
        return "–"
    _, _, lo, hi = courses[r.finding.id]
    ok = np.isfinite(lo) & np.isfinite(hi)
    pro = int(np.sum(ok & ((lo > 0) if r.finding.side > 0 else (hi < 0))))
    con = int(np.sum(ok & ((hi < 0) if r.finding.side > 0 else (lo > 0))))
    return f"{pro} / {con} of {len(lo)}"


def claim_row(r: Judged, over_training: str) -> list:
    """A finding's row of the full table: every number in its metric's unit, to 3 digits."""
    f, u = r.finding, unit_of(r.finding.metric)
    return [
        f.id,
        f.claim,
        f"{f.arm} vs {f.against}",
        f"{f.metric} ({f.expect} if the claim holds)",
        f"±{fmt3(r.margin, u)}"
        + (f" ({fmt3(100 * f.margin.value)} % of the baseline's mean)" if f.margin.relative else ""),
        fmt3(r.spread.arm_mean, u),
        fmt3(r.spread.against_mean, u),
        fmt3(r.diff, u),
        _interval(r.low, r.high, u),
        _interval(r.fw_low, r.fw_high, u),
        STUDY[f.metric].covers,
        fmt3(r.spread.rho),
        _noise_note(r),
        _interval(r.spread.welch_low, r.spread.welch_high, u),
        ", ".join(str(s) for s in r.spread.seeds) or "–",
        over_training,
        r.verdict,
    ]


def _noise_note(r: Judged) -> str:
    """What the finding's interval is judged on: its own per-seed differences (paired) or Welch's."""
    if not np.isfinite(r.spread.sd) or not r.spread.df > 0:  # NaN df: no replicates (findings.shared_jobs)
        return "–"
    how = "paired differences" if r.spread.paired else "Welch, seeds not shared"
    return f"sd {fmt3(r.spread.sd)} ({how}, df {fmt3(r.spread.df)})"


def claims_section(rows: list[Judged], courses: dict) -> Section:
    s = Section("claims", P.CLAIMS_TITLE)
    s.text.append(P.CLAIMS.format(fw=fmt3(100 * (1 - V.ALPHA / len(rows)))))
    s.tables.append((P.CLAIMS_COLUMNS, [claim_row(r, over_training(r, courses)) for r in rows]))
    return s


def notes_section(findings: list[Finding]) -> Section:
    s = Section("notes", "Notes on the findings")
    s.text += [f"{f.id}: {f.note}" for f in findings if f.note] or [P.NO_NOTES]
    return s


def noise_section(study: Study, by_arm: dict[str, list[Run]], judged: Judgement) -> Section:
    """The noise report (report/noise.py) of the eval-loss findings, then each metric's spreads and seed
    share, the sources the baseline's runs vary one at a time, and the shapes evaluation's own noise."""
    noise = noise_report.section(by_arm, [(f.id, f.arm, f.against) for f in study.findings if f.metric == "eval_loss"])
    spreads = Section("noise-metrics", "Each metric's spread", [P.NOISE_METRICS])
    nrows = [
        [m, unit_of(m), sd, n, lo or "–", lo_sd, hi or "–", hi_sd, share]
        for m, sd, n, lo, lo_sd, hi, hi_sd, share in judged.spreads
    ]
    spreads.tables.append(
        (
            [
                "metric",
                "unit",
                "baseline's sd across seeds",
                "baseline seeds",
                "least spread arm",
                "its sd",
                "most spread arm",
                "its sd",
                "seed share (fraction of one run's variance)",
            ],
            nrows,
        )
    )
    base_runs = [r for r in by_arm.get(study.baseline, []) if r.status == "finished"]
    sources = [[m, unit_of(m), k, sd, df] for m, k, sd, df in judged.sources]
    noise.parts += [
        spreads,
        Section(
            "noise-sources",
            "Data order and initialisation",
            [P.NOISE_SOURCES if sources else P.NOISE_ONE_SOURCE],
            [(["metric", "unit", "source (config field)", "sd", "df"], sources)] if sources else [],
        ),
    ]
    evaluation = shapes_noise_table({study.baseline: base_runs}) if "shapes_all" in judged.claims[2] else None
    if evaluation:  # a caption finding's seed spread holds the evaluator's own noise over its prompts (issue 37)
        noise.parts.append(
            Section("noise-evaluation", "The shapes evaluation's own noise", [P.NOISE_EVALUATION], [evaluation])
        )
    return noise


def topup_section(now: int, target: int, topups: list[dict], statistics: str) -> Section:
    s = Section("topup", "Adding seeds")
    s.text.append(P.TOPUP_RULE.format(statistics=statistics))
    s.text.append(
        P.TOPUP_NOW.format(now=now, target=target, cap=f" (capped at {V.MAX_SEEDS})" if target >= V.MAX_SEEDS else "")
    )
    s.text += [
        P.TOPPED_UP.format(from_=t.get("from"), to=t.get("to"), how=t.get("how"), rule=t.get("rule")) for t in topups
    ]
    return s


def every_arm_section(baseline: str, by_arm: dict[str, list[Run]]) -> Section:
    s = Section("arms", "Every arm")
    s.text.append(P.EVERY_ARM)
    s.tables.append(arm_rows(baseline, by_arm))
    return s


def figures_section(name: str, by_arm: dict[str, list[Run]], rows: list[Judged], courses: dict) -> Section:
    """The findings' courses over training, then each finding's two arms' curves."""
    s = Section(name, "The figures behind the findings")  # key: the figures' file names
    if courses:
        s.images.append(
            (
                P.COURSE,
                figures.course_figure(
                    [(r.finding.id, r.margin, courses[r.finding.id]) for r in rows if r.finding.id in courses]
                ),
            )
        )
    for r in rows:
        f = r.finding
        pair = {a: by_arm[a] for a in (f.arm, f.against) if a in by_arm}
        if len(pair) < 2:
            s.text.append(
                P.NO_RUNS.format(id=f.id, missing=", ".join(a for a in (f.arm, f.against) if a not in by_arm))
            )
            continue
        columns = ["train/loss", "eval/valid/loss"] if f.metric != "step_time" else ["train/loss", "perf/step_time"]
        caption = P.FINDING_CURVES.format(
            id=f.id,
            claim=f.claim,
            verdict=r.verdict,
            arm=f.arm,
            against=f.against,
            columns=" and ".join(f"{c} ({metric(c).unit})" for c in columns),
        )
        # two colours per figure, the same roles in every one: 16 arms would repeat a 10-colour cycle
        s.images.append((caption, figures.curves_figure(pair, columns, figures.colors([f.against, f.arm]))))
    return s


def page_sections(
    study: Study,
    runs: list[Run],
    provenance: list[str],
    topups: Optional[list[dict]] = None,
    extra: Optional[dict[str, dict[str, dict]]] = None,
    untestable: Optional[dict[str, str]] = None,
    record: Optional[dict] = None,
    statistics: str = "../statistics.md",
) -> tuple[list[Section], list[Judged]]:
    """The results page as sections, answer first, and the comparison rows. `topups`: the top-up log;
    `extra`: values measured elsewhere (claims_tables); `untestable`: findings seeds cannot settle, and
    why; `record`: a staged study's record (report/staged.py); `statistics`: the link to its docs."""
    by_arm = _arms_by(runs)
    if not by_arm:
        raise ConfigError(
            f"study {study.name}: none of the {len(runs)} runs has a +arm= override; run its preset "
            f"experiment={study.experiment}"
        )
    judged = judge_page(study, by_arm, extra, untestable, record)  # what every section below reads
    noise = noise_section(study, by_arm, judged)
    # every seed's curve right under the arms' spreads it makes: the finished runs, the seeds the verdicts use
    finished = {a: [r for r in rs if r.status == "finished"] for a, rs in by_arm.items()}
    noise.parts.insert(
        0,
        late_section(finished, study.transition, f"{study.name}_late", where=f"[statistics]({statistics}#late-seeds)"),
    )
    rows = judged.rows
    stages = [] if study.stages is None else [staged.study_section(study.stages, record, rows, statistics)]
    return [
        summary_section(study.name, rows, statistics),
        *stages,
        noise,
        method_section(study, by_arm, provenance, statistics),
        notes_section(study.findings),
        arms_section(study, judged.arms),
        claims_section(rows, judged.courses),
        topup_section(*judged.topup, topups or [], statistics),
        every_arm_section(study.baseline, by_arm),
        figures_section(study.name, by_arm, rows, judged.courses),
    ], rows


@dataclass
class StudyRuns:
    """What a study's page reads besides its file: its runs, stress runs, stages' record (report/staged.py)
    and top-ups' log, from its folder (`in_folder`) or its record (study/record.py)."""

    runs: list[Run]
    stress: list[Run]
    stages: Optional[dict] = None
    topups: list = field(default_factory=list)


def in_folder(source: str) -> StudyRuns:
    """A study's runs from its folder of run stores."""
    from dalle_ablate.report.load import load_runs

    log = Path(source) / TOPUPS
    topups = json.loads(log.read_text()) if log.exists() else []
    return StudyRuns(load_runs(source), stress.stress_runs(source), staged.read_record(source), topups)


def write_page(
    study: Study,
    source,
    page_dir: Path,
    provenance: list[str],
    extra: Optional[dict[str, dict[str, dict]]] = None,
    study_file: Optional[Path] = None,
) -> Path:
    """`<page_dir>/<study>.md` and its figures, from `source`: a study's folder of run stores (its stress
    runs beside it, where `study_file` declares them) or a StudyRuns (its record). Whole or not at all."""
    from dalle_ablate.fileio import atomic_write
    from dalle_ablate.report.writers import to_markdown

    inputs = source if isinstance(source, StudyRuns) else in_folder(str(source))
    if inputs.stages is not None and study.stages is not None:  # judged under the design it was planned under
        staged.check_stages(inputs.stages, study.stages, f"study {study.name}: its kept {staged.RECORD}")
    page_dir = Path(page_dir)
    (page_dir / "figures").mkdir(parents=True, exist_ok=True)
    stress_part, measured, untestable = (
        stress.stress_measures(study_file, inputs.stress) if study_file is not None else ([], {}, {})
    )
    statistics = os.path.relpath(STATISTICS, page_dir.resolve()) if STATISTICS.is_file() else "../statistics.md"
    sections, _ = page_sections(
        study,
        inputs.runs,
        provenance,
        inputs.topups,
        {**measured, **(extra or {})},
        statistics=Path(statistics).as_posix(),
        untestable=untestable,
        record=inputs.stages,
    )
    sections[-1:-1] = stress_part  # before the per-finding figures
    for old in (page_dir / "figures").glob(f"{study.name}_*.png"):  # an earlier page's, numbered otherwise
        old.unlink()
    path = page_dir / f"{study.name}.md"
    atomic_write(path, to_markdown(study.title, sections, page_dir, number=fmt3))
    return path
