"""A study's findings judged (`dalle-ablate study`): each finding of a published study checked
against the runs of its arms by the verdict engine (report/verdicts.py) -- the paired difference
over the seeds both arms ran, its interval from that pair's own noise, one of its verdicts at a
family-wise 5 % (Holm), the seeds a finding not resolved needs, Welch's interval beside it for
comparison, its course over training (docs/statistics.md); and the top-up rule. report/page.py
writes the results page.

A study is a YAML file (`report/studies/<name>.yaml`): the multirun preset that runs it, its
baseline arm, and its findings, each a claim with the arm it is about, the arm it is compared
with, a metric (its study name, as declared beside the code that computes it: dalle_ablate/metrics.py),
the direction the claim predicts and its margin Δ (the metric's declared default where it gives
none)."""

from __future__ import annotations

import json
import math
from importlib import resources
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import yaml

from dalle_ablate.metrics import STUDY, Metric, declare
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import stress  # noqa: F401 -- declares lr_sensitivity, measured on the stress runs
from dalle_ablate.report.load import Run, read_yaml, series
from dalle_ablate.report import verdicts as V
from dalle_ablate.report.stats import diff_ci, spikes
from dalle_ablate.report.tables import final_value
from dalle_ablate.report.transitions import Rule, rule_from

STUDIES = Path(__file__).parent / "studies"
TOPUPS = "topups.json"  # in a study's folder: each top-up's seeds before and after, and what the rule asked
VERDICTS = V.VERDICTS


# The guidance scale a study reads a sampled metric at: 2, where the default job draws the most
# scenes right (docs/quickstart.md; guidance beyond 2-3 hurts).
STUDY_SCALE = 2.0

declare(
    Metric(
        "loss_spikes",
        "steps whose train/loss exceeds 1.5x the median of the 20 before",
        "spikes per run",
        "lower",
        source="report",
        study="loss_spikes",
        margin="1",  # one loss spike per run
        value=lambda r: float(spikes(series(r, "train/loss")[1], factor=1.5)),
    )
)


def reading(m: Metric) -> str:
    """How a study reads one run's value of `m`, in words."""
    if m.reads == "given":
        return "measured on runs of its own, per arm and seed"
    if m.reads == "median":
        return "the median over the run's steps"
    if m.value is not None:
        return "over the run's log"
    return (
        f"at guidance scale {STUDY_SCALE:g}, the last evaluation" if m.source == "samples" else "the last logged value"
    )


def _pareto_by_step(run: Run, key: str) -> dict[float, float]:
    """step -> a sampled metric at STUDY_SCALE, from every evaluation's eval_pareto table
    (tables/eval_pareto_<step>.json), not the last only."""
    out = {}
    for path in (run.root / "tables").glob("eval_pareto_*.json") if isinstance(run.root, Path) else []:
        t = json.loads(path.read_text())
        c = {name: i for i, name in enumerate(t["columns"])}
        for row in t["rows"] if key in c else []:
            if row[c["scale"]] == STUDY_SCALE:
                out[float(path.stem.rsplit("_", 1)[1])] = float(row[c[key]])
    return out


def study_value(m: Metric, run: Run) -> float:
    """One run's value of `m` as a study reads it (`reading`)."""
    if m.value is not None:
        return float(m.value(run))
    if m.source == "samples":  # the last evaluation's table
        c = {name: i for i, name in enumerate(run.pareto["columns"])} if run.pareto else {}
        rows = [r for r in run.pareto["rows"] if r[c["scale"]] == STUDY_SCALE] if m.key in c else []
        return float(rows[0][c[m.key]]) if rows else math.nan
    if m.reads == "median":
        _, v = series(run, m.logged())
        return float(np.median(v)) if len(v) else math.nan
    return final_value(run, m.logged())


def study_series(m: Metric) -> Optional[Callable[[Run], dict]]:
    """A run's values of `m` by step, for its course over training; None for a metric read once."""
    if m.reads != "last" or m.value is not None:
        return None
    if m.source == "samples":
        return lambda r: _pareto_by_step(r, m.key)
    return lambda r: dict(zip(*series(r, m.logged())))


def unit_of(metric: str) -> str:
    """The unit of a study metric's numbers; "" for one not declared."""
    return STUDY[metric].unit if metric in STUDY else ""


@dataclass
class Finding:
    id: str
    claim: str
    arm: str  # the arm the claim is about
    against: str  # the arm it is compared with
    metric: str  # a study metric's name (dalle_ablate/metrics.py: STUDY)
    expect: str  # "lower" | "higher": the arm's value against the other's, if the claim holds
    # Δ: "N%" of the baseline's mean or an absolute value; None: the metric's declared margin
    margin: Optional[str] = None
    note: Optional[str] = None  # what a reader needs to know to read its verdict (how this study tests the claim)


@dataclass
class Study:
    name: str
    title: str
    source: str
    experiment: str  # the multirun preset (conf/experiment/) that runs every arm and seed
    baseline: str
    findings: list[Finding]
    scale_note: str = ""  # what this scale can and cannot say, written with the study
    # the late-seed view's rule (report/transitions.py): the file's `transition:`, else the defaults
    transition: Rule = field(default_factory=Rule)


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
        raise ConfigError(
            f"{where}: not a study file (a YAML mapping with name, title, source, experiment, baseline, "
            f"findings); it holds a {type(raw).__name__}"
        )
    for key in ("name", "title", "source", "experiment", "baseline", "findings"):
        if key not in raw:
            raise ConfigError(f"{where}: missing '{key}'")
    findings = []
    for i, f in enumerate(raw["findings"]):
        keys = [d.name for d in fields(Finding)]
        missing = [k for k in keys if k not in f and k not in ("margin", "note")]
        if missing:
            raise ConfigError(f"{where}: finding {i} lacks {', '.join(missing)}")
        if f["metric"] not in STUDY:
            raise ConfigError(
                f"{where}: finding {f['id']!r} has metric {f['metric']!r}; valid: {', '.join(sorted(STUDY))}"
            )
        if f["expect"] not in ("lower", "higher"):
            raise ConfigError(f"{where}: finding {f['id']!r} has expect {f['expect']!r}; valid: lower, higher")
        margin = f.get("margin", STUDY[f["metric"]].margin or None)
        if margin is None:
            raise ConfigError(
                f"{where}: finding {f['id']!r} has no margin and metric {f['metric']!r} no default one; "
                "give margin: a positive number in the metric's units (0.01) or a percentage of the "
                "baseline's mean (2%)"
            )
        if parse_margin(margin) is None:
            raise ConfigError(
                f"{where}: finding {f['id']!r} has margin {margin!r}; valid: a positive number in the "
                f"metric's units (0.01) or a percentage of the baseline's mean (2%)"
            )
        if not isinstance(f.get("note", ""), str):
            raise ConfigError(f"{where}: finding {f['id']!r} has note {f['note']!r}; give a sentence of text")
        findings.append(
            Finding(**{k: f[k] for k in keys if k not in ("margin", "note")}, margin=str(margin), note=f.get("note"))
        )
    stressed = {
        a
        for f in raw["findings"]
        if f["id"] in ((raw.get("stress") or {}).get("claims") or [])
        for a in (f["arm"], f["against"])
    }
    for f in findings:  # a percentage of the baseline's mean needs the baseline measured on that metric
        if STUDY[f.metric].reads == "given" and parse_margin(f.margin)[1] and raw["baseline"] not in stressed:
            raise ConfigError(
                f"{where}: finding {f.id!r} has margin {f.margin} of the baseline's {f.metric}, but the "
                f"baseline {raw['baseline']!r} is in no stress claim, so it has none; give an absolute "
                "margin (0.05) or a stress claim with the baseline"
            )
    return Study(
        raw["name"],
        raw["title"],
        raw["source"],
        raw["experiment"],
        raw["baseline"],
        findings,
        raw.get("scale_note", ""),
        rule_from(raw.get("transition"), where),
    )


def study_arms(study: Study, by_arm: dict[str, list[Run]]) -> list[str]:
    """The study's arms: the baseline, those its experiment preset runs (its sweeper's `+arm`),
    then any other that has runs or a finding names."""
    preset = resources.files("dalle_ablate.conf") / "experiment" / f"{study.experiment}.yaml"
    raw = yaml.safe_load(preset.read_text()) if preset.is_file() else None
    swept = str((((raw or {}).get("hydra") or {}).get("sweeper") or {}).get("params", {}).get("+arm") or "")
    return list(
        dict.fromkeys(
            [
                study.baseline,
                *(a.strip() for a in swept.split(",") if a.strip()),
                *by_arm,
                *(a for f in study.findings for a in (f.arm, f.against)),
            ]
        )
    )


parse_margin = V.parse_margin


def arm_of(run: Run) -> Optional[str]:
    """The study arm a run belongs to: its `+arm=<name>` override."""
    for o in run.meta.get("overrides", []):
        if o.startswith("+arm="):
            return o.split("=", 1)[1]
    return None


def claims_tables(
    study: Study, by_arm: dict[str, list[Run]], extra: Optional[dict[str, dict[str, dict]]] = None
) -> tuple[list[str], list, dict[str, np.ndarray]]:
    """(arms, seeds, metric -> values[arm, seed]) of the finished runs, NaN where an arm has no
    finished run of a seed. `extra` (metric -> arm -> seed -> value) adds or replaces tables: the
    seam for values measured elsewhere, e.g. a stability claim's per-seed learning-rate
    sensitivity from stress runs."""
    arms = list(dict.fromkeys([*by_arm, *(a for f in study.findings for a in (f.arm, f.against))]))
    done = {a: {r.seed: r for r in by_arm.get(a, []) if r.status == "finished"} for a in arms}
    extra = extra or {}
    seeds = sorted(
        {s for d in done.values() for s in d} | {s for t in extra.values() for d in t.values() for s in d}, key=str
    )
    tables = {}
    for m in dict.fromkeys(f.metric for f in study.findings):
        if m in extra or STUDY[m].reads == "given":
            given = extra.get(m, {})
            tables[m] = np.array([[float(given.get(a, {}).get(s, math.nan)) for s in seeds] for a in arms])
        else:
            read = STUDY[m]
            tables[m] = np.array(
                [[replicate(read, done[a][s]) if s in done[a] else math.nan for s in seeds] for a in arms]
            )
    return arms, seeds, tables


def replicate(m: Metric, run: Run) -> float:
    """One run's value of `m` as one replicate of its arm: NaN for a metric measured once per job
    (Metric.per_job) on a run that shared its job, whose value its members all log."""
    return math.nan if m.per_job and run.job_share > 1 else study_value(m, run)


def shared_jobs(study: Study, by_arm: dict[str, list[Run]]) -> dict[str, str]:
    """Findings on a metric measured once per job whose arms trained too few runs as jobs of their
    own (two each) for a spread, and why: id -> why seeds trained as members of shared jobs cannot
    settle them. Their members' values are left out (claims_tables), so they are in no Holm family."""
    out = {}
    for f in study.findings:
        if not STUDY[f.metric].per_job:
            continue
        done = {a: [r for r in by_arm.get(a, []) if r.status == "finished"] for a in (f.arm, f.against)}
        short = [a for a, runs in done.items() if sum(r.job_share == 1 for r in runs) < 2]
        if short and any(r.job_share > 1 for runs in done.values() for r in runs):
            out[f.id] = (
                f"{' and '.join(short)}'s seeds trained as members of shared jobs, so its {f.metric} is one "
                "measurement per job, not one per seed; time the arms as jobs of their own (dalle-ablate study "
                "--no-members)"
            )
    return out


def margin_of(f: Finding, baseline_values: np.ndarray) -> float:
    """Δ of a finding in its metric's units: a percentage of the baseline's mean, or absolute."""
    return V.margin_value(f.margin, baseline_values)


def comparisons(study: Study, arms: list[str], tables: dict[str, np.ndarray]) -> list[V.Comparison]:
    """Each finding as the verdict engine's comparison: its arm against the other, its margin in
    the metric's units."""
    b = arms.index(study.baseline) if study.baseline in arms else None
    out = []
    for f in study.findings:
        base = tables[f.metric][b] if b is not None else np.array([math.nan])
        out.append(V.Comparison(f.metric, arms.index(f.arm), arms.index(f.against), margin_of(f, base)))
    return out


def judge(
    study: Study, arms: list[str], tables: dict[str, np.ndarray], alpha: float = V.ALPHA
) -> tuple[list[V.Comparison], dict]:
    """The findings of `study` judged on these tables: verdicts.analyse's results, each finding's
    verdict (read against the side it predicts) and seeds-needed from its own noise."""
    comps = comparisons(study, arms, tables)
    r = V.analyse(tables, comps, alpha)
    r["verdict"] = np.array(
        [V.verdict(int(o), 1 if f.expect == "higher" else -1) for o, f in zip(r["outcome"], study.findings)]
    )
    r["needed"] = V.seeds_needed(r["sd"], r["margin"], len(comps), alpha, **_noise(r))
    # an unresolved finding of n seeds needs n + 1 at least, whatever the plan's power says
    r["plan"], r["fewest"], r["most"] = V.seeds_to_settle(
        r["d"], r["low"], r["high"], r["sd"], r["margin"], len(comps), alpha, **_noise(r), at_least=r["n"] + 1
    )
    return comps, r


def _noise(r: dict) -> dict:
    """The noise arguments of seeds_needed and seeds_to_settle from verdicts.analyse's results."""
    return {"paired": r["paired"], "va": r["va"], "vb": r["vb"]}


def verdict_text(code: int, needed: int, seeds: int = 0, why: str = "", *, plan: tuple[int, int, int]) -> str:
    """A verdict in words: a settled one as it is; an untestable one with `why`; one not resolved
    with what more seeds would do (verdicts.seeds_words): `plan`, (plan, fewest, most) from
    verdicts.seeds_to_settle, at the observed difference, and `needed`, for a difference of Δ."""
    if code == V.UNTESTABLE:
        return f"untestable here: {why or 'both arms give the same value on every seed'}"
    if code != V.NOT_RESOLVED:
        return V.VERDICTS[code]
    if needed == 0 and plan[0] == 0:
        return "not resolved: no seed spread to judge it on"
    if 0 < needed <= seeds:  # its seeds would find an effect of Δ 80 % of the time: one between 0 and Δ is likelier
        return (
            f"not resolved at {seeds} seeds, enough for an effect of Δ: the effect is likely smaller; "
            + V.seeds_words(*plan, 0)
        )
    return "not resolved: " + V.seeds_words(*plan, needed)


def compare(
    study: Study,
    by_arm: dict[str, list[Run]],
    level: float = 0.95,
    extra: Optional[dict[str, dict[str, dict]]] = None,
    untestable: Optional[dict[str, str]] = None,
) -> list[dict]:
    """One row per finding: both arms' means, the difference over the seeds both ran (paired; Welch's
    where they share fewer than two) with its `level` interval and its family-wise one
    (Bonferroni over the findings), rho, the sd of one seed's difference it is judged on, Welch's
    interval for comparison, the margin, seeds-needed and the verdict (Holm over the findings at
    5 %). `untestable`: finding id -> why more seeds could not settle it (e.g. neither arm trains
    at any stress rate), its verdict whatever the numbers say."""
    arms, seeds, tables = claims_tables(study, by_arm, extra)
    comps, r = judge(study, arms, tables)
    untestable = {**shared_jobs(study, by_arm), **(untestable or {})}
    rows = []
    for i, (f, c) in enumerate(zip(study.findings, comps)):
        t = tables[f.metric]
        a, b = t[c.arm], t[c.against]
        a, b = a[np.isfinite(a)], b[np.isfinite(b)]
        _, wlo, whi = diff_ci(a, b, level) if len(a) and len(b) else (math.nan,) * 3
        both = np.isfinite(t[c.arm]) & np.isfinite(t[c.against])
        code = V.UNTESTABLE if f.id in untestable else int(r["verdict"][i])
        rows.append(
            {
                "finding": f,
                "n": (len(a), len(b)),
                "seeds": [s for s, ok in zip(seeds, both) if ok],
                "arm_mean": float(a.mean()) if len(a) else math.nan,
                "against_mean": float(b.mean()) if len(b) else math.nan,
                **{
                    k: float(r[k][i])
                    for k in (
                        "d",
                        "low",
                        "high",
                        "fw_low",
                        "fw_high",
                        "rho",
                        "sd",
                        "df",
                        "margin",
                        "p_zero",
                        "p_beyond",
                        "p_tost",
                    )
                },
                "diff": float(r["d"][i]),
                "fw_level": 1 - V.ALPHA / len(comps),
                "welch_low": wlo,
                "welch_high": whi,
                "paired": bool(r["paired"][i]),
                "needed": int(r["needed"][i]),
                **{k: int(r[k][i]) for k in ("plan", "fewest", "most")},
                "outcome": int(r["outcome"][i]),
                "code": code,
                "verdict": verdict_text(
                    code,
                    int(r["needed"][i]),
                    int(r["n"][i]),
                    untestable.get(f.id, ""),
                    plan=(int(r["plan"][i]), int(r["fewest"][i]), int(r["most"][i])),
                ),
            }
        )
    return rows


def course(study: Study, by_arm: dict[str, list[Run]], level: float = 0.95) -> dict[str, tuple]:
    """finding id -> (steps, difference, low, high) at every evaluation of its metric (a metric read
    at the end: study_series), the same analysis as at the end at each step."""
    arms, _, _ = claims_tables(study, by_arm)
    out = {}
    for m in dict.fromkeys(f.metric for f in study.findings):
        by_step = study_series(STUDY[m])
        found = [f for f in study.findings if f.metric == m]
        if by_step is None:
            continue
        done = {a: {r.seed: by_step(r) for r in by_arm.get(a, []) if r.status == "finished"} for a in arms}
        seeds = sorted({s for d in done.values() for s in d}, key=str)
        steps = sorted({x for d in done.values() for c in d.values() for x in c})
        if not steps or not seeds:
            continue
        t = np.array(
            [[[done[a][s].get(x, math.nan) if s in done[a] else math.nan for s in seeds] for a in arms] for x in steps]
        )
        # the intervals only: no margin
        r = V.analyse({m: t}, [V.Comparison(m, arms.index(f.arm), arms.index(f.against)) for f in found], level=level)
        for j, f in enumerate(found):
            out[f.id] = (np.array(steps, float), r["d"][:, j], r["low"][:, j], r["high"][:, j])
    return out


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
    own = [int(n) for n, f in zip(r["needed"], study.findings) if n > 0 and STUDY[f.metric].reads != "given"]
    return now, V.topup_seeds(own, now)


def plan_topup(study: Study, folder: Path, seeds: str, overrides: list[str]) -> tuple[str, dict]:
    """`dalle-ablate study NAME --seeds N|auto`: (the seed override that tops the finished study
    in `folder` up to that many seeds per arm -- its seeds kept, the smallest unused ones added --
    and the entry for its top-up log). `auto` is the rule: the largest seeds-needed over all the
    findings (prose.TOPUP_RULE, docs/statistics.md). One-line errors for what cannot be topped up."""
    from dalle_ablate.report.load import load_runs

    if any(o.split("=", 1)[0].lstrip("+~") == "seed" for o in overrides):
        raise ConfigError("--seeds chooses the seeds itself; leave out the seed= override")
    if seeds != "auto" and not (seeds.isdigit() and int(seeds) >= 2):
        raise ConfigError(f"--seeds {seeds!r}: give a number of seeds per arm (2 or more) or auto (the top-up rule)")
    log = Path(folder) / TOPUPS
    done = json.loads(log.read_text()) if seeds == "auto" and log.exists() else []
    if any(t.get("how", "").startswith("--seeds auto") for t in done):  # its error rate is simulated for one look
        raise ConfigError(
            f"--seeds auto: study {study.name} was topped up by the rule already; the rule tops up once "
            "(a second look at the same data would spend its error rate again)"
        )
    try:
        runs = load_runs(str(folder))
    except ConfigError:
        runs = []
    by_arm = _arms_by(runs)
    if not by_arm:
        raise ConfigError(
            f"--seeds tops up a study that has run: no runs of study {study.name} under {folder}; run "
            f"dalle-ablate study {study.name} first"
        )
    now, rule = topup_target(study, runs)
    target = rule if seeds == "auto" else int(seeds)
    if target < now:
        raise ConfigError(f"--seeds {seeds}: study {study.name} already has {now} seeds per arm; a top-up only adds")
    have = sorted({r.seed for rs in by_arm.values() for r in rs if r.seed is not None}, key=str)
    extra = [s for s in range(target + len(have)) if s not in have][: max(0, target - len(have))]
    chosen = [*have, *extra][: max(target, len(have))]
    entry = {
        "from": now,
        "to": target,
        "rule": rule,
        "seeds": chosen,
        "how": "--seeds auto (the rule)" if seeds == "auto" else f"--seeds {seeds}",
    }
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
