"""A study in two declared stages (its file's `stages:`, report/design.py; docs/statistics.md,
"Studies in stages"): stage 2's plan from stage 1's runs by the declared rule (report/allocation.py),
every finding judged at both looks by the combination test inside Holm's closed procedure
(report/stages.py), with repeated confidence intervals, and the page's account of each stage.

The study runner (dalle_ablate/study/runner.py) asks `plan` for stage 2 once stage 1 has run,
keeps the answer in the study's folder (RECORD) before stage 2 starts -- a rerun reads it back and
never plans again -- and runs what it asks for; the page reads the same record."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from dalle_ablate.fileio import atomic_write
from dalle_ablate.metrics import STUDY
from dalle_ablate.report import allocation as A
from dalle_ablate.report import prose as P
from dalle_ablate.report import stages as S
from dalle_ablate.report import verdicts as V
from dalle_ablate.report.design import Stages, Study, swept_seeds
from dalle_ablate.report.findings import claims_tables, compare, comparisons, verdict_text
from dalle_ablate.report.load import Run, machine_time
from dalle_ablate.report.tables import fmt3
from dalle_ablate.report.writers import Section

RECORD = "stages.json"  # in the study's folder: stage 1's seeds, the plan and why, stage 2's seeds


def read_record(folder) -> Optional[dict]:
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def stage1_seeds(study: Study, record: Optional[dict]) -> list[int]:
    """Stage 1's seeds: as the record kept them, else those the study's preset sweeps."""
    if record is not None:
        return list(record["stage1"])
    return swept_seeds(study.experiment, []) or []


def write_record(folder, record: dict) -> None:
    atomic_write(Path(folder) / RECORD, json.dumps(record, indent=1) + "\n")


def one_look(study: Study) -> np.ndarray:
    """The findings no stage 2 adds to: those judged on values measured elsewhere (the stress
    runs, a plan of their own), each with one look, its fixed-design test (stages.reject_by_look)."""
    return np.array([STUDY[f.metric].reads == "given" for f in study.findings])


def split(seeds: list, tables: dict[str, np.ndarray], stage1) -> tuple[dict, dict]:
    """The tables' columns of stage 1's seeds, and of the others (stage 2's), each NaN elsewhere."""
    first = np.array([s in set(stage1) for s in seeds])
    return (
        {m: np.where(first, t, np.nan) for m, t in tables.items()},
        {m: np.where(first, np.nan, t) for m, t in tables.items()},
    )


def _stage1_comparisons(study: Study, arms: list[str], seeds: list, tables: dict, stage1) -> list[V.Comparison]:
    """The findings as comparisons with Δ from stage 1's baseline: the hypotheses are fixed before
    stage 2 is chosen, whatever stage 2 then adds to the baseline's mean."""
    first, _ = split(seeds, tables, stage1)
    return comparisons(study, arms, first)


def seconds_per_run(by_arm: dict[str, list[Run]]) -> dict[str, float]:
    """Each arm's machine seconds per finished run (load.machine_time: a members job once, over
    its members): what one more seed of it costs."""
    out = {}
    for arm, runs in by_arm.items():
        done = [r for r in runs if r.status == "finished"]
        if done:
            out[arm] = machine_time(done) / len(done)
    return out


def plan(study: Study, by_arm: dict[str, list[Run]], stage1: list[int], extra: Optional[dict] = None) -> dict:
    """Stage 2 by the study's declared rule, from stage 1's finished runs: the record the runner
    keeps -- stage 1's seeds, each arm's stage-2 seeds, what was spent of the budget, and per
    finding open after look 1 its chance to settle by look 2 without stage 2 and with the seeds
    planned (at its observed difference and spread: a plan, not a test)."""
    st_ = study.stages
    arms, seeds, tables = claims_tables(study, by_arm, extra)
    first, _ = split(seeds, tables, stage1)
    comps = _stage1_comparisons(study, arms, seeds, tables, stage1)
    own = ~one_look(study)
    chance, open_ = A.chances(first, comps, st_.design, own, st_.cap)
    cost_s = seconds_per_run(by_arm)
    per_seed = [1.0 if st_.unit == "runs" else cost_s.get(a, math.inf) / 3600 for a in arms]
    ends = np.array([(c.arm, c.against) for c in comps]).T
    if st_.rule == "budget":
        k = A.allocate(chance, ends[0], ends[1], np.array(per_seed), st_.budget)
    else:  # "even": every arm of a finding still open alike, as many seeds as the budget affords
        needed = sorted({i for j, c in enumerate(comps) if open_[j] and own[j] for i in (c.arm, c.against)})
        k = np.zeros(len(arms), int)
        if needed:
            each = min(st_.cap, int(st_.budget // sum(per_seed[i] for i in needed)))
            k[needed] = each
    pairs = np.minimum(k[ends[0]], k[ends[1]])
    return {
        "declared": st_.declared,
        "stage1": list(stage1),
        "rule": st_.rule,
        "budget": {st_.unit: st_.budget},
        "spent": float(sum(k[i] * per_seed[i] for i in range(len(arms)))),
        "seconds_per_run": {a: round(cost_s[a], 1) for a in arms if a in cost_s},
        "stage2": {arms[i]: st_.seeds(int(k[i])) for i in range(len(arms)) if k[i] > 0},
        "open": {
            f.id: {"pairs": int(pairs[j]), "chance_now": float(chance[j, 0]), "chance": float(chance[j, pairs[j]])}
            for j, f in enumerate(study.findings)
            if open_[j]
        },
    }


def judge(
    study: Study,
    by_arm: dict[str, list[Run]],
    record: Optional[dict],
    stage1: list[int],
    extra: Optional[dict] = None,
    untestable: Optional[dict[str, str]] = None,
) -> list[dict]:
    """findings.compare's rows -- their descriptive numbers over every seed -- with each finding's
    verdict, difference and intervals from the two looks: the combined estimate, the 95 % repeated
    confidence interval and the family-wise one (Bonferroni's α / m each side) by look 2, and the
    verdicts at look 1 and by look 2. Before stage 2 ran (no record, or no run of it yet), look 1's."""
    rows = compare(study, by_arm, extra=extra, untestable=untestable)
    arms, seeds, tables = claims_tables(study, by_arm, extra)
    comps = _stage1_comparisons(study, arms, seeds, tables, stage1)
    first, second = split(seeds, tables, stage1)
    design = study.stages.design
    res = S.analyse_staged(first, second, comps, design, single=one_look(study))
    looks = [S.outcome_at(res, 1, design.w1), S.outcome_at(res, 2, design.w1)]
    m = len(comps)
    for j, (row, f, c) in enumerate(zip(rows, study.findings, comps)):
        d1, se1, df1, d2, se2, df2 = (float(res[k][j]) for k in ("d1", "se1", "df1", "d2", "se2", "df2"))
        side = 1 if f.expect == "higher" else -1
        codes = [V.verdict(int(o[j]), side) for o in looks]
        if row["code"] == V.UNTESTABLE:
            codes = [V.UNTESTABLE, V.UNTESTABLE]
        _, (low, high) = S.repeated_interval(d1, se1, df1, d2, se2, df2, design, V.ALPHA / 2)
        _, (fw_low, fw_high) = S.repeated_interval(d1, se1, df1, d2, se2, df2, design, V.ALPHA / (2 * m))
        plan_ = (row["plan"], row["fewest"], row["most"])
        estimate = S.combined_estimate(d1, se1, df1, d2, se2, df2, design)
        row.update(
            d=estimate,
            diff=estimate,
            low=low,
            high=high,
            fw_low=fw_low,
            fw_high=fw_high,
            fw_level=1 - V.ALPHA / m,
            margin=float(c.margin),
            outcome=int(looks[1][j]),
            code=codes[1],
            look1=V.VERDICTS[codes[0]],
            stage_n=(int(res["n1"][j]), int(res["n2"][j])),
            verdict=verdict_text(codes[1], row["needed"], min(row["n"]), (untestable or {}).get(f.id, ""), plan=plan_)
            if codes[1] != V.UNTESTABLE
            else row["verdict"],
        )
    return rows


def section(study: Study, record: Optional[dict], rows: list[dict], stage1: list[int], statistics: str) -> Section:
    """The stages: the design as declared, stage 1's seeds, look 1's verdicts, what the rule asked
    for and why, stage 2's seeds, the verdicts by look 2; the intervals' kind."""
    st_: Stages = study.stages
    s = Section("stages", P.STAGES_TITLE)
    s.text.append(
        P.STAGES_DESIGN.format(
            declared=st_.declared,
            w1=f"{st_.w1:.3f}",
            kind=st_.boundaries,
            rule=st_.rule,
            budget=f"{st_.budget:g} {st_.unit.replace('_', '-')}",
            cap=st_.cap,
            seeds_from=st_.seeds_from,
            statistics=statistics,
        )
    )
    settled1 = sum(r["look1"] in V.VERDICTS[: V.NOT_RESOLVED] for r in rows)
    s.text.append(P.STAGE1.format(seeds=", ".join(map(str, stage1)), settled=settled1, n=len(rows)))
    if record is None:
        s.text.append(P.STAGE2_NOT_PLANNED)
        return s
    if not record["stage2"]:
        s.text.append(P.STAGE2_NONE)
    else:
        s.text.append(
            P.STAGE2_PLAN.format(
                spent=fmt3(record["spent"]),
                budget=" ".join(f"{v:g} {k.replace('_', '-')}" for k, v in record["budget"].items()),
                arms="; ".join(f"{a}: {', '.join(map(str, ks))}" for a, ks in record["stage2"].items()),
            )
        )
    s.tables.append(
        (
            list(P.STAGES_COLUMNS),
            [
                [
                    r["finding"].id,
                    r["look1"],
                    _why(record["open"].get(r["finding"].id)),
                    f"{r['stage_n'][0]} + {r['stage_n'][1]}",
                    V.VERDICTS[r["code"]],
                ]
                for r in rows
            ],
        )
    )
    return s


def _why(open_: Optional[dict]) -> str:
    """What the rule asked for one finding and why, in the table's words."""
    if open_ is None:
        return "settled at look 1, or judged elsewhere: nothing"
    if open_["pairs"] == 0:
        return P.STAGE2_NOTHING.format(now=f"{open_['chance_now']:.0%}")
    return P.STAGE2_PAIRS.format(k=open_["pairs"], now=f"{open_['chance_now']:.0%}", then=f"{open_['chance']:.0%}")
