"""A study's results page (`dalle-ablate study`): each finding of a published study checked
against the runs of its arms -- the measured difference with its 95% Welch interval across
seeds, a verdict, the figure behind it -- then every arm's numbers and stability counts.

A study is a YAML file (`report/studies/<name>.yaml`): the multirun preset that runs it, its
baseline arm, and its findings, each a claim with the arm it is about, the arm it is compared
with, a metric (`METRICS`) and the direction the claim predicts."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dalle_ablate.registry import ConfigError
from dalle_ablate.report import figures
from dalle_ablate.report.load import Run, read_yaml, series
from dalle_ablate.report.stats import diff_ci, diverged, mean_ci, spikes
from dalle_ablate.report.tables import final_value, fmt, headline_values
from dalle_ablate.report.writers import Section

STUDIES = Path(__file__).parent / "studies"
VERDICTS = ("reproduced", "contradicted", "not resolved at this scale")


def _median_step_time(run: Run) -> float:
    _, v = series(run, "perf/step_time")
    return float(np.median(v)) if len(v) else math.nan


# metric name -> (what it is, for the page; its value for one run)
METRICS: dict[str, tuple[str, Callable[[Run], float]]] = {
    "eval_loss": ("eval/valid/loss at the end", lambda r: final_value(r, "eval/valid/loss")),
    "train_loss": ("train/loss at the end", lambda r: final_value(r, "train/loss")),
    "step_time": ("median seconds per training step (this machine, with its load)", _median_step_time),
    "loss_spikes": ("steps whose train/loss exceeds 1.5x the median of the 20 before",
                    lambda r: float(spikes(series(r, "train/loss")[1], factor=1.5))),
    "shapes_all": ("shapes all-correct at guidance scale 2, the last evaluation",
                   lambda r: headline_values(r).get("shapes/all@s2", math.nan)),
}


@dataclass
class Finding:
    id: str
    claim: str
    arm: str  # the arm the claim is about
    against: str  # the arm it is compared with
    metric: str  # a key of METRICS
    expect: str  # "lower" | "higher": the arm's value against the other's, if the claim holds


@dataclass
class Study:
    name: str
    title: str
    source: str
    experiment: str  # the multirun preset (conf/experiment/) that runs every arm and seed
    baseline: str
    findings: list[Finding]
    scale_note: str = ""  # what this scale can and cannot say, written with the study


def study_path(name: str) -> Path:
    path = STUDIES / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in STUDIES.glob("*.yaml")))
        raise ConfigError(f"study {name!r} is not one of: {known} (or give a study file, <path>.yaml)")
    return path


def load_study(path: Path) -> Study:
    raw = read_yaml(Path(path)) or {}
    where = str(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: not a study file (a YAML mapping with name, title, source, experiment, baseline, "
                          f"findings); it holds a {type(raw).__name__}")
    for key in ("name", "title", "source", "experiment", "baseline", "findings"):
        if key not in raw:
            raise ConfigError(f"{where}: missing '{key}'")
    findings = []
    for i, f in enumerate(raw["findings"]):
        keys = [field.name for field in fields(Finding)]
        missing = [k for k in keys if k not in f]
        if missing:
            raise ConfigError(f"{where}: finding {i} lacks {', '.join(missing)}")
        if f["metric"] not in METRICS:
            raise ConfigError(f"{where}: finding {f['id']!r} has metric {f['metric']!r}; valid: {', '.join(METRICS)}")
        if f["expect"] not in ("lower", "higher"):
            raise ConfigError(f"{where}: finding {f['id']!r} has expect {f['expect']!r}; valid: lower, higher")
        findings.append(Finding(**{k: f[k] for k in keys}))
    return Study(raw["name"], raw["title"], raw["source"], raw["experiment"], raw["baseline"], findings,
                 raw.get("scale_note", ""))


def arm_of(run: Run) -> Optional[str]:
    """The study arm a run belongs to: its `+arm=<name>` override."""
    for o in run.meta.get("overrides", []):
        if o.startswith("+arm="):
            return o.split("=", 1)[1]
    return None


def verdict(low: float, high: float, expect: str) -> str:
    """Reproduced when the interval of (arm - other) excludes 0 on the side the claim predicts,
    contradicted when it excludes 0 on the other side, else not resolved at this scale."""
    if not (np.isfinite(low) and np.isfinite(high)) or low <= 0 <= high:
        return VERDICTS[2]
    higher = low > 0
    return VERDICTS[0] if higher == (expect == "higher") else VERDICTS[1]


def compare(study: Study, by_arm: dict[str, list[Run]], level: float = 0.95) -> list[dict]:
    """One row per finding: the arm's and the other arm's mean, the difference with its Welch
    interval at `level` and at the Bonferroni level over all findings, and both verdicts."""
    k = len(study.findings)
    bonferroni = 1 - (1 - level) / k
    rows = []
    for f in study.findings:
        value = METRICS[f.metric][1]
        a = [value(r) for r in by_arm.get(f.arm, []) if r.status == "finished"]
        b = [value(r) for r in by_arm.get(f.against, []) if r.status == "finished"]
        d, lo, hi = diff_ci(a, b, level) if a and b else (math.nan,) * 3
        _, blo, bhi = diff_ci(a, b, bonferroni) if a and b else (math.nan,) * 3
        rows.append({"finding": f, "n": (len(a), len(b)), "arm_mean": float(np.mean(a)) if a else math.nan,
                     "against_mean": float(np.mean(b)) if b else math.nan, "diff": d, "low": lo, "high": hi,
                     "verdict": verdict(lo, hi, f.expect), "bonferroni_level": bonferroni,
                     "bonferroni_verdict": verdict(blo, bhi, f.expect)})
    return rows


def arm_rows(study: Study, by_arm: dict[str, list[Run]]) -> tuple[list[str], list[list]]:
    """Per arm: seeds, status, each metric's mean [95% t interval], spikes and divergences."""
    cols = ["arm", "seeds", "finished"]
    for m in ("eval_loss", "shapes_all", "step_time"):
        cols += [m, f"{m} 95% CI"]
    cols += ["loss spikes (per run)", "diverged"]
    rows = []
    for arm, runs in by_arm.items():
        done = [r for r in runs if r.status == "finished"]
        row = [arm + (" (baseline)" if arm == study.baseline else ""), ", ".join(str(r.seed) for r in runs),
               f"{len(done)}/{len(runs)}"]
        for m in ("eval_loss", "shapes_all", "step_time"):
            mean, lo, hi = mean_ci([METRICS[m][1](r) for r in done])
            row += [mean, _interval(lo, hi)]
        row += [" / ".join(str(int(METRICS["loss_spikes"][1](r))) for r in runs),
                sum(diverged(series(r, "train/loss")[1], r.status) for r in runs)]
        rows.append(row)
    return cols, rows


def _interval(lo: float, hi: float) -> str:
    return f"[{fmt(lo)}, {fmt(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else "–"


def page_sections(study: Study, runs: list[Run], provenance: list[str]) -> tuple[list[Section], list[dict]]:
    """The results page as report sections, and the comparison rows."""
    by_arm: dict[str, list[Run]] = {}
    for r in runs:
        arm = arm_of(r)
        if arm is not None:
            by_arm.setdefault(arm, []).append(r)
    if not by_arm:
        raise ConfigError(f"study {study.name}: none of the {len(runs)} runs has a +arm= override; run its preset "
                          f"experiment={study.experiment}")
    rows = compare(study, by_arm)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
    head = Section("summary", "Summary")
    head.text.append(f"Source: {study.source}.")
    head.text += provenance
    head.text.append(f"{len(rows)} findings: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ". A verdict reads the "
                     "95% Welch t interval of the difference of means across seeds (arm minus the arm it is compared "
                     "with): reproduced when it excludes 0 on the side the claim predicts, contradicted when it excludes "
                     "0 on the other side, not resolved at this scale when it contains 0.")
    used = dict.fromkeys(f.metric for f in study.findings)
    head.text.append("Metrics: " + "; ".join(f"{m}: {METRICS[m][0]}" for m in used) + ". Only finished runs are "
                     "compared; the arms' table counts the others.")
    k = len(rows)
    head.text.append(f"Multiple comparisons: {k} findings are tested, so about {0.05 * k:.1f} would show a 95% interval "
                     f"excluding 0 by chance alone if no claim held. The last column repeats each verdict at the "
                     f"Bonferroni level ({rows[0]['bonferroni_level']:.2%} per finding, 95% for all together).")
    base = by_arm.get(study.baseline) or next(iter(by_arm.values()))
    c, m = base[0].config, base[0].meta
    head.text.append(f"These runs: {c.get('trainer.steps')} steps of {c.get('trainer.batch_size')} at d_model "
                     f"{c.get('model.d_model')}, {c.get('model.encoder_layers')} + {c.get('model.decoder_layers')} layers "
                     f"({m.get('params', '?')} parameters in the baseline), "
                     f"{max(len(rs) for rs in by_arm.values())} seeds per arm at most.")
    if study.scale_note:
        head.text.append(study.scale_note)
    head.tables.append((["finding", "claim", "arm vs", "metric", "arm", "vs", "Δ (arm − vs)", "95% CI", "n", "verdict",
                         "Bonferroni"],
                        [[r["finding"].id, r["finding"].claim, f"{r['finding'].arm} vs {r['finding'].against}",
                          f"{r['finding'].metric} ({r['finding'].expect} if the claim holds)", r["arm_mean"],
                          r["against_mean"], r["diff"], _interval(r["low"], r["high"]), f"{r['n'][0]} vs {r['n'][1]}",
                          r["verdict"], r["bonferroni_verdict"]] for r in rows]))

    arms = Section("arms", "Every arm")
    arms.text.append("Mean over the finished seeds with a 95% Student-t interval; loss spikes per run in seed order; "
                     "runs whose loss stopped being finite. Step time measures the machine's load as well as the arm.")
    arms.tables.append(arm_rows(study, by_arm))

    figs = Section(study.name, "The figures behind the findings")  # key: the figures' file names
    for r in rows:
        f = r["finding"]
        pair = {a: by_arm[a] for a in (f.arm, f.against) if a in by_arm}
        if len(pair) < 2:
            figs.text.append(f"{f.id}: no runs of {', '.join(a for a in (f.arm, f.against) if a not in by_arm)}.")
            continue
        columns = ["train/loss", "eval/valid/loss"] if f.metric != "step_time" else ["train/loss", "perf/step_time"]
        figs.images.append((f"{f.id}: {f.claim} — {f.arm} vs {f.against}, {r['verdict']}",
                            # two colours per figure, the same roles in every one: 16 arms would repeat a 10-colour cycle
                            figures.curves_figure(pair, columns, figures.colors([f.against, f.arm]))))
    return [head, arms, figs], rows


def write_page(study: Study, source: str, page_dir: Path, provenance: list[str]) -> Path:
    """`<page_dir>/<study>.md` with its figures in `<page_dir>/figures/`, from the run stores
    under `source` (the study's multirun folder). Written whole or not at all."""
    from dalle_ablate.fileio import atomic_write
    from dalle_ablate.report.load import load_runs
    from dalle_ablate.report.writers import to_markdown

    page_dir = Path(page_dir)
    (page_dir / "figures").mkdir(parents=True, exist_ok=True)
    sections, _ = page_sections(study, load_runs(source), provenance)
    for old in (page_dir / "figures").glob(f"{study.name}_*.png"):  # an earlier page's, numbered otherwise
        old.unlink()
    path = page_dir / f"{study.name}.md"
    atomic_write(path, to_markdown(study.title, sections, page_dir))
    return path
