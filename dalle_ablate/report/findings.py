"""A study's results page (`dalle-ablate study`): each finding of a published study checked
against the runs of its arms -- the paired difference over the seeds both arms ran, its interval
from the noise pooled over the study's arms, one of five verdicts at a family-wise 5 % (Holm),
the seeds a finding not resolved needs, Welch's interval beside it for comparison, its course
over training -- then the noise floor, every arm's numbers and the figures (docs/statistics.md).

A study is a YAML file (`report/studies/<name>.yaml`): the multirun preset that runs it, its
baseline arm, and its findings, each a claim with the arm it is about, the arm it is compared
with, a metric (`METRICS`), the direction the claim predicts and its margin Δ (`MARGINS`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from scipy import stats as st

from dalle_ablate.registry import ConfigError
from dalle_ablate.report import figures
from dalle_ablate.report.load import Run, read_yaml, series
from dalle_ablate.report import verdicts as V
from dalle_ablate.report.stats import diff_ci, diverged, mean_ci, spikes
from dalle_ablate.report.tables import final_value, fmt, headline_values, shapes_noise_table
from dalle_ablate.report.writers import Section

STUDIES = Path(__file__).parent / "studies"
TOPUPS = "topups.json"  # in a study's folder: each top-up's seeds before and after, and what the rule asked
VERDICTS = V.VERDICTS


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
# Metrics measured on runs of their own, not the study's: their per-seed values reach the verdicts
# through `extra` (write_page reads them), and a study run holds none of them.
MEASURED_ELSEWHERE = {
    "lr_sensitivity": "learning-rate sensitivity over the stress runs (report/stress.py, Wortsman et al. 2023 §2.2), "
                      "nats per token",
}


# The margin Δ of each metric when a finding does not declare its own (docs/statistics.md says
# why each): "N%" of the baseline arm's mean over its finished seeds (blind to every other arm), or
# an absolute value in the metric's units.
MARGINS: dict[str, str] = {
    # Kaplan et al. 2020 (L ~ C^-0.050): 2 % of the loss is what ~1.5x the training compute buys
    # (1.02^20 = 1.49); a variant worth less than half again the compute is no "clearly helps".
    "eval_loss": "2%",
    "train_loss": "2%",
    # a cost under 5 % of a step is within what the machine's own load moves step time by
    "step_time": "5%",
    # 5 points of shapes all-correct: about the 95 % Wilson half-width of one evaluation's rate
    "shapes_all": "0.05",
    # one loss spike per run
    "loss_spikes": "1",
    # a tenth of the baseline's degradation over the stress rates: a variant that moves how much
    # the loss degrades across a 100x range of rates by less than that is no stabler in a way
    # that would change which rate or variant one picks (Wortsman et al. 2023 compare variants
    # whose sensitivities differ by factors, not percents)
    "lr_sensitivity": "10%",
}
def _shapes_all_by_step(run: Run) -> dict[float, float]:
    """step -> shapes all-correct at guidance scale 2, from every evaluation's eval_pareto table
    (tables/eval_pareto_<step>.json), not the last only."""
    out = {}
    for path in (run.root / "tables").glob("eval_pareto_*.json") if isinstance(run.root, Path) else []:
        t = json.loads(path.read_text())
        c = {name: i for i, name in enumerate(t["columns"])}
        for row in t["rows"] if "shapes/all" in c else []:
            if row[c["scale"]] == 2:
                out[float(path.stem.rsplit("_", 1)[1])] = float(row[c["shapes/all"]])
    return out


# The metrics whose course over training the page draws: metric -> a run's values by step.
SERIES: dict[str, Callable[[Run], dict]] = {
    "eval_loss": lambda r: dict(zip(*series(r, "eval/valid/loss"))),
    "train_loss": lambda r: dict(zip(*series(r, "train/loss"))),
    "shapes_all": _shapes_all_by_step,
}


@dataclass
class Finding:
    id: str
    claim: str
    arm: str  # the arm the claim is about
    against: str  # the arm it is compared with
    metric: str  # a key of METRICS
    expect: str  # "lower" | "higher": the arm's value against the other's, if the claim holds
    margin: Optional[str] = None  # Δ: "N%" of the baseline's mean or an absolute value; None: MARGINS[metric]


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
        missing = [k for k in keys if k not in f and k != "margin"]
        if missing:
            raise ConfigError(f"{where}: finding {i} lacks {', '.join(missing)}")
        if f["metric"] not in METRICS and f["metric"] not in MEASURED_ELSEWHERE:
            raise ConfigError(f"{where}: finding {f['id']!r} has metric {f['metric']!r}; valid: "
                              f"{', '.join([*METRICS, *MEASURED_ELSEWHERE])}")
        if f["expect"] not in ("lower", "higher"):
            raise ConfigError(f"{where}: finding {f['id']!r} has expect {f['expect']!r}; valid: lower, higher")
        margin = f.get("margin", MARGINS.get(f["metric"]))
        if margin is None:
            raise ConfigError(f"{where}: finding {f['id']!r} has no margin and metric {f['metric']!r} no default one; "
                              "give margin: a positive number in the metric's units (0.01) or a percentage of the "
                              "baseline's mean (2%)")
        if parse_margin(margin) is None:
            raise ConfigError(f"{where}: finding {f['id']!r} has margin {margin!r}; valid: a positive number in the "
                              f"metric's units (0.01) or a percentage of the baseline's mean (2%)")
        findings.append(Finding(**{k: f[k] for k in keys if k != "margin"}, margin=str(margin)))
    stressed = {a for f in raw["findings"] if f["id"] in ((raw.get("stress") or {}).get("claims") or [])
                for a in (f["arm"], f["against"])}
    for f in findings:  # a percentage of the baseline's mean needs the baseline measured on that metric
        if f.metric in MEASURED_ELSEWHERE and parse_margin(f.margin)[1] and raw["baseline"] not in stressed:
            raise ConfigError(f"{where}: finding {f.id!r} has margin {f.margin} of the baseline's {f.metric}, but the "
                              f"baseline {raw['baseline']!r} is in no stress claim, so it has none; give an absolute "
                              "margin (0.05) or a stress claim with the baseline")
    return Study(raw["name"], raw["title"], raw["source"], raw["experiment"], raw["baseline"], findings,
                 raw.get("scale_note", ""))


def parse_margin(margin) -> Optional[tuple[float, bool]]:
    """(value, relative) of a margin "2%" or 0.01; None if it is not a positive number."""
    text = str(margin).strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        return None
    return (value, text.endswith("%")) if math.isfinite(value) and value > 0 else None


def arm_of(run: Run) -> Optional[str]:
    """The study arm a run belongs to: its `+arm=<name>` override."""
    for o in run.meta.get("overrides", []):
        if o.startswith("+arm="):
            return o.split("=", 1)[1]
    return None


def claims_tables(study: Study, by_arm: dict[str, list[Run]],
                  extra: Optional[dict[str, dict[str, dict]]] = None) -> tuple[list[str], list, dict[str, np.ndarray]]:
    """(arms, seeds, metric -> values[arm, seed]) of the finished runs, NaN where an arm has no
    finished run of a seed. `extra` (metric -> arm -> seed -> value) adds or replaces tables: the
    seam for values measured elsewhere, e.g. a stability claim's per-seed learning-rate
    sensitivity from stress runs."""
    arms = list(dict.fromkeys([*by_arm, *(a for f in study.findings for a in (f.arm, f.against))]))
    done = {a: {r.seed: r for r in by_arm.get(a, []) if r.status == "finished"} for a in arms}
    extra = extra or {}
    seeds = sorted({s for d in done.values() for s in d} | {s for t in extra.values() for d in t.values() for s in d},
                   key=str)
    tables = {}
    for m in dict.fromkeys(f.metric for f in study.findings):
        if m in extra or m in MEASURED_ELSEWHERE:
            given = extra.get(m, {})
            tables[m] = np.array([[float(given.get(a, {}).get(s, math.nan)) for s in seeds] for a in arms])
        else:
            tables[m] = np.array([[METRICS[m][1](done[a][s]) if s in done[a] else math.nan for s in seeds] for a in arms])
    return arms, seeds, tables


def margin_of(f: Finding, baseline_values: np.ndarray) -> float:
    """Δ of a finding in its metric's units: a percentage of the baseline's mean, or absolute."""
    value, relative = parse_margin(f.margin)
    if not relative:
        return value
    base = baseline_values[np.isfinite(baseline_values)]
    return value * abs(float(base.mean())) if len(base) else math.nan


def judge(study: Study, arms: list[str], tables: dict[str, np.ndarray], alpha: float = V.ALPHA) -> tuple[list[V.Claim], dict]:
    """The claims of `study` on these tables and verdicts.analyse's results, with seeds-needed."""
    b = arms.index(study.baseline) if study.baseline in arms else None
    claims = []
    for f in study.findings:
        t = tables[f.metric]
        base = t[b] if b is not None else np.array([math.nan])
        claims.append(V.Claim(f.metric, arms.index(f.arm), arms.index(f.against), 1 if f.expect == "higher" else -1,
                              margin_of(f, base)))
    r = V.analyse(tables, claims, alpha)
    present = np.array([int(np.isfinite(tables[c.metric]).any(1).sum()) for c in claims])
    r["needed"] = np.array([int(V.seeds_needed(sd, c.margin, max(a, 2), len(claims), alpha))
                            for sd, c, a in zip(r["pooled_sd"], claims, present)])
    return claims, r


def verdict_text(code: int, needed: int, seeds: int = 0) -> str:
    if code != V.UNRESOLVED:
        return VERDICTS[code]
    if needed == 0:
        return "not resolved: no seed spread to test against"
    if needed <= seeds:  # its seeds would find an effect of Δ 80 % of the time: one between 0 and Δ is likelier
        return f"not resolved at {seeds} seeds, enough for an effect of Δ: the effect is likely smaller"
    more = "more than " if needed > V.MAX_SEEDS else ""
    return f"not resolved: needs {more}{min(needed, V.MAX_SEEDS)} seeds"


def compare(study: Study, by_arm: dict[str, list[Run]], level: float = 0.95,
            extra: Optional[dict[str, dict[str, dict]]] = None) -> list[dict]:
    """One row per finding: both arms' means, the paired difference over the seeds both ran with
    its `level` interval and its family-wise one (Bonferroni over the findings), rho, whether
    the pooled noise was used, Welch's interval for comparison, the margin, seeds-needed and the
    verdict (Holm over the findings at 5 %)."""
    arms, seeds, tables = claims_tables(study, by_arm, extra)
    claims, r = judge(study, arms, tables)
    k = len(claims)
    fw = 1 - V.ALPHA / k
    rows = []
    for i, (f, c) in enumerate(zip(study.findings, claims)):
        t = tables[f.metric]
        a, b = t[c.arm], t[c.against]
        a, b = a[np.isfinite(a)], b[np.isfinite(b)]
        _, wlo, whi = diff_ci(a, b, level) if len(a) and len(b) else (math.nan,) * 3
        half = st.t.ppf(0.5 + fw / 2, r["df"][i]) * r["se"][i] if r["df"][i] > 0 else math.nan
        both = np.isfinite(t[c.arm]) & np.isfinite(t[c.against])
        rows.append({"finding": f, "n": (len(a), len(b)), "seeds": [s for s, ok in zip(seeds, both) if ok],
                     "arm_mean": float(a.mean()) if len(a) else math.nan,
                     "against_mean": float(b.mean()) if len(b) else math.nan,
                     "diff": float(r["d"][i]), "low": float(r["low"][i]), "high": float(r["high"][i]),
                     "fw_low": float(r["d"][i] - half), "fw_high": float(r["d"][i] + half), "fw_level": fw,
                     "welch_low": wlo, "welch_high": whi, "rho": float(r["rho"][i]), "pooled": bool(r["pooled"][i]),
                     "outlier": bool(r["outlier"][i]), "df": float(r["df"][i]), "margin": float(r["margin"][i]),
                     "p_zero": float(r["p_zero"][i]), "p_tost": float(r["p_tost"][i]), "needed": int(r["needed"][i]),
                     "code": int(r["verdict"][i]),
                     "verdict": verdict_text(int(r["verdict"][i]), int(r["needed"][i]), int(r["n"][i]))})
    return rows


def course(study: Study, by_arm: dict[str, list[Run]], level: float = 0.95) -> dict[str, tuple]:
    """finding id -> (steps, paired difference, low, high) at every evaluation of its metric
    (SERIES), the same pooled analysis at each step."""
    arms, _, _ = claims_tables(study, by_arm)
    out = {}
    for m, by_step in SERIES.items():
        found = [f for f in study.findings if f.metric == m]
        if not found:
            continue
        done = {a: {r.seed: by_step(r) for r in by_arm.get(a, []) if r.status == "finished"} for a in arms}
        seeds = sorted({s for d in done.values() for s in d}, key=str)
        steps = sorted({x for d in done.values() for c in d.values() for x in c})
        if not steps or not seeds:
            continue
        t = np.array([[[done[a][s].get(x, math.nan) if s in done[a] else math.nan for s in seeds] for a in arms]
                      for x in steps])
        # the intervals only: the margin plays no part in them
        claims = [V.Claim(m, arms.index(f.arm), arms.index(f.against), 1 if f.expect == "higher" else -1, 1.0)
                  for f in found]
        r = V.analyse({m: t}, claims, level=level)
        for j, f in enumerate(found):
            out[f.id] = (np.array(steps, float), r["d"][:, j], r["low"][:, j], r["high"][:, j])
    return out


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


TOPUP_RULE = ("Adding seeds (dalle-ablate study NAME --seeds auto): the study is topped up once, to the largest "
              "seeds-needed over all its findings, resolved or not -- a number computed from the pooled residual noise "
              "and the declared margins only, never from an effect -- and judged again on all its seeds with the same "
              "tests. The residual noise of the additive model is independent of the arms' differences, so the choice "
              "of N carries no information about them (a blinded internal pilot, Wittes & Brittain 1990; Kieser & "
              "Friede 2003); tests/report/test_verdicts.py simulates the family-wise error of this rule. A top-up to "
              "any other N (--seeds N) is valid only if N was fixed without looking at the verdicts.")


def _arms_by(runs: list[Run]) -> dict[str, list[Run]]:
    by_arm: dict[str, list[Run]] = {}
    for r in runs:
        arm = arm_of(r)
        if arm is not None:
            by_arm.setdefault(arm, []).append(r)
    return by_arm


def topup_target(study: Study, runs: list[Run]) -> tuple[int, int]:
    """(seeds per arm now, seeds per arm the top-up rule asks for)."""
    by_arm = _arms_by(runs)
    arms, seeds, tables = claims_tables(study, by_arm)
    _, r = judge(study, arms, tables)
    now = max((sum(r.status == "finished" for r in rs) for rs in by_arm.values()), default=0)
    own = [int(n) for n, f in zip(r["needed"], study.findings) if n > 0 and f.metric not in MEASURED_ELSEWHERE]
    return now, V.topup_seeds(own, now)


def plan_topup(study: Study, folder: Path, seeds: str, overrides: list[str]) -> tuple[str, dict]:
    """`dalle-ablate study NAME --seeds N|auto`: (the seed override that tops the finished study
    in `folder` up to that many seeds per arm -- its seeds kept, the smallest unused ones added --
    and the entry for its top-up log). `auto` is the rule: the largest seeds-needed over all the
    findings (TOPUP_RULE). One-line errors for what cannot be topped up."""
    from dalle_ablate.report.load import load_runs

    if any(o.split("=", 1)[0].lstrip("+~") == "seed" for o in overrides):
        raise ConfigError("--seeds chooses the seeds itself; leave out the seed= override")
    if seeds != "auto" and not (seeds.isdigit() and int(seeds) >= 2):
        raise ConfigError(f"--seeds {seeds!r}: give a number of seeds per arm (2 or more) or auto (the top-up rule)")
    log = Path(folder) / TOPUPS
    done = json.loads(log.read_text()) if seeds == "auto" and log.exists() else []
    if any(t.get("how", "").startswith("--seeds auto") for t in done):  # its error rate is simulated for one look
        raise ConfigError(f"--seeds auto: study {study.name} was topped up by the rule already; the rule tops up once "
                          "(a second look at the same data would spend its error rate again)")
    try:
        runs = load_runs(str(folder))
    except ConfigError:
        runs = []
    by_arm = _arms_by(runs)
    if not by_arm:
        raise ConfigError(f"--seeds tops up a study that has run: no runs of study {study.name} under {folder}; run "
                          f"dalle-ablate study {study.name} first")
    now, rule = topup_target(study, runs)
    target = rule if seeds == "auto" else int(seeds)
    if target < now:
        raise ConfigError(f"--seeds {seeds}: study {study.name} already has {now} seeds per arm; a top-up only adds")
    have = sorted({r.seed for rs in by_arm.values() for r in rs if r.seed is not None}, key=str)
    extra = [s for s in range(target + len(have)) if s not in have][: max(0, target - len(have))]
    chosen = [*have, *extra][: max(target, len(have))]
    entry = {"from": now, "to": target, "rule": rule, "seeds": chosen,
             "how": "--seeds auto (the rule)" if seeds == "auto" else f"--seeds {seeds}"}
    return "seed=" + ",".join(str(s) for s in chosen), entry


def noise_sources(runs: list[Run], value: Callable[[Run], float]) -> list[tuple[str, float, int]]:
    """Where one arm's seed spread comes from, when its runs vary one source of randomness at a
    time (Bouthillier et al. 2021): for each seed field of the config other than `seed` itself
    that takes more than one value among `runs` (a data-order seed, an initialisation seed, ...),
    the spread of `value` among runs that agree on every other such field -- (field, sd pooled
    over those groups, its degrees of freedom). Empty when the runs vary only `seed`."""
    keys = sorted({k for r in runs for k in r.config if k != "seed" and k.rsplit(".", 1)[-1].endswith("seed")})
    keys = [k for k in keys if len({repr(r.config.get(k)) for r in runs}) > 1]
    out = []
    for k in keys:
        groups: dict[tuple, list[float]] = {}
        for r in runs:
            v = value(r)
            if np.isfinite(v):
                # agreeing on `seed` too: a field that follows it (its default) varies with every source
                groups.setdefault(tuple(repr(r.config.get(o)) for o in ["seed", *keys] if o != k), []).append(v)
        ss = sum(float(((np.array(g) - np.mean(g)) ** 2).sum()) for g in groups.values())
        df = sum(len(g) - 1 for g in groups.values())
        if df > 0:
            out.append((k, math.sqrt(ss / df), df))
    return out


def _noise_note(r: dict) -> str:
    if r["outlier"]:
        return f"own, df {r['df']:.0f} (an arm's seeds stray from the others')"
    if not r["pooled"]:
        return f"own, df {r['df']:.0f} (the pair varies more than the pool)" if r["df"] > 0 else "–"
    return f"pooled, df {r['df']:.0f}"


def page_sections(study: Study, runs: list[Run], provenance: list[str], topups: Optional[list[dict]] = None,
                  extra: Optional[dict[str, dict[str, dict]]] = None) -> tuple[list[Section], list[dict]]:
    """The results page as report sections, and the comparison rows. `topups`: the study's
    top-up log (cmd_study); `extra`: tables of values measured elsewhere (claims_tables)."""
    by_arm = _arms_by(runs)
    if not by_arm:
        raise ConfigError(f"study {study.name}: none of the {len(runs)} runs has a +arm= override; run its preset "
                          f"experiment={study.experiment}")
    rows = compare(study, by_arm, extra=extra)
    k = len(rows)
    counts = {v: sum(r["code"] == i for r in rows) for i, v in enumerate(VERDICTS)}  # in VERDICTS' order
    counts = {v: n for v, n in counts.items() if n}
    settled = sum(r["code"] in (V.REPRODUCED, V.SMALLER, V.EQUIVALENT, V.CONTRADICTED) for r in rows)
    head = Section("summary", "Summary")
    head.text.append(f"Source: {study.source}.")
    head.text += provenance
    head.text.append(f"{k} findings, {settled} settled: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".")
    head.text.append(
        "How a verdict is read (docs/statistics.md): arms run with the same seed share its data order and initial key, so "
        "each finding is judged on its per-seed differences (arm minus the arm it is compared with, over the seeds both "
        "finished), with the noise of a difference pooled over all the study's arms by the additive model value ~ arm + "
        "seed; a finding whose own differences vary more than the pool allows (the upper 10 % of the F ratio), or that "
        "names an arm whose seeds stray from the others' (the upper 1 %), is judged on its own variance instead. Each "
        "finding has a margin Δ declared in the study file before its runs. Three tests per finding -- the difference "
        "against 0 (two-sided), against Δ on the predicted side, and equivalence within ±Δ (two one-sided tests) -- each "
        f"decided by Holm's procedure over the {k} findings at a family-wise 5 %. Verdicts: reproduced (beyond 0 and "
        "beyond Δ on the predicted side); reproduced, possibly smaller than Δ (beyond 0 only); no meaningful effect "
        "(equivalent within ±Δ, which contradicts a claim of an effect); contradicted (beyond 0 on the other side); not "
        "resolved, with the seeds per arm at which a true effect of Δ would be told from 0 with 80 % power, from the "
        "pooled noise and Δ alone.")
    head.text.append("Over training: at how many of the evaluations the paired 95 % interval lay beyond 0 on the "
                     "predicted side, and on the other (the figures show each course). The table's 95 % interval is "
                     "the paired one; the family-wise interval is at the Bonferroni level "
                     f"({1 - V.ALPHA / k:.2%} per finding), which Holm's decisions never need more than; Welch's "
                     "unpaired interval is beside it to show what pairing bought, with rho, the two arms' correlation "
                     "across seeds.")
    used = dict.fromkeys(f.metric for f in study.findings)
    head.text.append("Metrics: " + "; ".join(f"{m}: {METRICS[m][0]}" if m in METRICS else m for m in used) + ". Only "
                     "finished runs are compared; the arms' table counts the others.")
    base = by_arm.get(study.baseline) or next(iter(by_arm.values()))
    c, m = base[0].config, base[0].meta
    head.text.append(f"These runs: {c.get('trainer.steps')} steps of {c.get('trainer.batch_size')} at d_model "
                     f"{c.get('model.d_model')}, {c.get('model.encoder_layers')} + {c.get('model.decoder_layers')} layers "
                     f"({m.get('params', '?')} parameters in the baseline), "
                     f"{max(len(rs) for rs in by_arm.values())} seeds per arm at most.")
    if study.scale_note:
        head.text.append(study.scale_note)
    courses = course(study, by_arm)

    def over_training(r: dict) -> str:
        """At how many evaluations the 95 % interval lay beyond 0 on the predicted side, and on the other."""
        if r["finding"].id not in courses:
            return "–"
        _, _, lo, hi = courses[r["finding"].id]
        side = 1 if r["finding"].expect == "higher" else -1
        ok = np.isfinite(lo) & np.isfinite(hi)
        pro = int(np.sum(ok & ((lo > 0) if side > 0 else (hi < 0))))
        con = int(np.sum(ok & ((hi < 0) if side > 0 else (lo > 0))))
        return f"{pro} / {con} of {len(lo)}"

    head.tables.append((["finding", "claim", "arm vs", "metric", "Δ margin", "arm", "vs", "paired diff", "95% CI",
                         "family-wise CI", "rho", "noise", "Welch 95% CI", "seeds",
                         "evaluations beyond 0: predicted / other side", "verdict"],
                        [[r["finding"].id, r["finding"].claim, f"{r['finding'].arm} vs {r['finding'].against}",
                          f"{r['finding'].metric} ({r['finding'].expect} if the claim holds)",
                          f"±{fmt(r['margin'])} ({r['finding'].margin})", r["arm_mean"], r["against_mean"], r["diff"],
                          _interval(r["low"], r["high"]), _interval(r["fw_low"], r["fw_high"]), r["rho"],
                          _noise_note(r), _interval(r["welch_low"], r["welch_high"]),
                          ", ".join(str(s) for s in r["seeds"]) or "–", over_training(r), r["verdict"]] for r in rows]))

    noise = Section("noise", "Noise floor")
    noise.text.append("Per metric: the baseline's spread across seeds (one run's noise), the residual noise of the "
                      "additive model pooled over the arms (what is left of a difference once the shared seed is taken "
                      "out) and the seed's share of one run's variance (how much of it the arms share: what pairing "
                      "removes). Where the noise comes from -- data order or initialisation -- a study tells apart only "
                      "by varying one of the two at a time (Bouthillier et al. 2021).")
    arms, seeds, tables = claims_tables(study, by_arm, extra)
    nrows = []
    for metric, t in tables.items():
        out = V.outlying_arms(t, V.OUTLIER)
        s2, df, share = V.blocked_residual(np.where(out[:, None], np.nan, t))
        b = t[arms.index(study.baseline)] if study.baseline in arms else np.array([math.nan])
        b = b[np.isfinite(b)]
        nrows.append([metric, float(b.std(ddof=1)) if len(b) > 1 else math.nan, len(b), float(np.sqrt(s2)), float(df),
                      float(share), ", ".join(a for a, o in zip(arms, out) if o) or "none"])
    noise.tables.append((["metric", "baseline's sd across seeds", "baseline seeds", "pooled residual sd", "its df",
                          "seed share", "arms left out of the pool"], nrows))
    base_runs = [r for r in by_arm.get(study.baseline, []) if r.status == "finished"]
    sources = [[m, k, sd, df] for m in tables if m in METRICS
               for k, sd, df in noise_sources(base_runs, METRICS[m][1])]
    if sources:
        noise.text.append("The baseline's runs vary these sources one at a time: the spread of each metric among runs "
                          "that differ only in that field (pooled over the groups that agree on every other).")
        noise.tables.append((["metric", "source (config field)", "sd", "df"], sources))
    else:
        noise.text.append("The baseline's runs vary every source together (through `seed`): the page cannot split them.")
    evaluation = shapes_noise_table({study.baseline: base_runs}) if "shapes_all" in tables else None
    if evaluation:  # a caption finding's seed spread holds the evaluator's own noise over its prompts (issue 37)
        noise.text.append("The shapes evaluation's own noise, apart from the seeds': the baseline's all-correct per "
                          "guidance scale and tier, its sd across seeds, and the binomial sd over one run's prompts, "
                          "sqrt(p (1 - p) / N). A seed spread near the prompt sd is mostly the evaluation's; every arm "
                          "is scored on the same prompts with the same sampling noise, so a paired difference "
                          "cancels what the prompts share.")
        noise.tables.append(evaluation)

    top = Section("topup", "Adding seeds")
    top.text.append(TOPUP_RULE)
    now = max((sum(r.status == "finished" for r in rs) for rs in by_arm.values()), default=0)
    # the claims judged on the study's own runs: --seeds adds seeds to those, not to the stress runs
    target = V.topup_seeds([r["needed"] for r in rows if r["needed"] > 0 and r["finding"].metric not in MEASURED_ELSEWHERE],
                           now)
    top.text.append(f"Now {now} seeds per arm at most; the rule asks for {target}"
                    + (f" (capped at {V.MAX_SEEDS})" if target >= V.MAX_SEEDS else "") + ".")
    for t in topups or []:
        top.text.append(f"Topped up from {t.get('from')} to {t.get('to')} seeds per arm ({t.get('how')}); the rule then "
                        f"asked for {t.get('rule')}.")

    arms_s = Section("arms", "Every arm")
    arms_s.text.append("Mean over the finished seeds with a 95% Student-t interval; loss spikes per run in seed order; "
                       "runs whose loss stopped being finite. Step time measures the machine's load as well as the arm.")
    arms_s.tables.append(arm_rows(study, by_arm))

    figs = Section(study.name, "The figures behind the findings")  # key: the figures' file names
    figs.images.append(("Every finding's paired difference in units of its margin Δ, the side the claim predicts to "
                        "the right: thick, the 95 % interval; thin, the family-wise one; shaded, ±Δ",
                        figures.forest_figure(rows)))
    if courses:
        figs.images.append(("The paired difference over training at every evaluation, with its 95 % interval (pooled as "
                            "at the end) and ±Δ: a verdict at one budget can differ at another",
                            figures.course_figure([(r["finding"].id, r["margin"], courses[r["finding"].id])
                                                   for r in rows if r["finding"].id in courses])))
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
    return [head, noise, top, arms_s, figs], rows


def stress_measures(study_file: Path, source: str) -> tuple[list[Section], dict[str, dict[str, dict]]]:
    """The stress section of a study's page and its stability claims' per-seed values
    ({"lr_sensitivity": {arm: {seed: value}}}, for `extra`), from the stress runs beside the
    study's folder (report/stress.py); nothing if its file declares none."""
    from dalle_ablate.report import stress
    from dalle_ablate.report.load import load_runs

    plan = stress.load_stress(study_file)
    where = stress.stress_folder(Path(source))
    if plan is None or not where.is_dir() or not any(where.rglob("metrics.jsonl")):
        return [], {}  # none run yet (or none got as far as its run store)
    sections, claims = stress.stress_sections(plan, load_runs(str(where)))
    values: dict[str, dict] = {}
    for c in claims:
        values.setdefault(c["measure"], {}).update(c["values"])
    return sections, values


def write_page(study: Study, source: str, page_dir: Path, provenance: list[str],
               extra: Optional[dict[str, dict[str, dict]]] = None, study_file: Optional[Path] = None) -> Path:
    """`<page_dir>/<study>.md` with its figures in `<page_dir>/figures/`, from the run stores
    under `source` (the study's multirun folder) and, where `study_file` declares stress runs,
    those beside it (their claims judged on them). Written whole or not at all."""
    from dalle_ablate.fileio import atomic_write
    from dalle_ablate.report.load import load_runs
    from dalle_ablate.report.writers import to_markdown

    page_dir = Path(page_dir)
    (page_dir / "figures").mkdir(parents=True, exist_ok=True)
    log = Path(source) / TOPUPS
    topups = json.loads(log.read_text()) if log.exists() else []
    stress_part, measured = stress_measures(study_file, source) if study_file is not None else ([], {})
    sections, _ = page_sections(study, load_runs(source), provenance, topups, {**measured, **(extra or {})})
    sections[-1:-1] = stress_part  # before the per-finding figures
    for old in (page_dir / "figures").glob(f"{study.name}_*.png"):  # an earlier page's, numbered otherwise
        old.unlink()
    path = page_dir / f"{study.name}.md"
    atomic_write(path, to_markdown(study.title, sections, page_dir))
    return path
