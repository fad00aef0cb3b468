"""Studies and reports in two declared stages (docs/statistics.md, "Studies in stages"): stage 2's plan from stage 1's
runs by the declared rule, kept in the record before stage 2 starts and never made again; every finding (a report's
every comparison) judged at both looks; and the page's account of each stage."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from dalle_ablate.fileio import atomic_write
from dalle_ablate.metrics import STUDY, metric
from dalle_ablate.stats import allocation as A
from dalle_ablate.report import prose as P
from dalle_ablate.stats import stages as S
from dalle_ablate.stats import verdicts as V
from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import Stages, Study, stages_from
from dalle_ablate.report.findings import Judged, claims_tables, comparisons, spreads, verdict_text
from dalle_ablate.report.load import Run, machine_time, read_yaml
from dalle_ablate.report.tables import against_baseline, baseline_tables, fmt3
from dalle_ablate.report.writers import Section
from dalle_ablate.track import naming

RECORD = "stages.json"  # in the study's folder: stage 1's seeds, the plan and why, stage 2's seeds
# Overrides of a run that say where or how it ran, not what it is: not in a report's stage-2 command.
NOT_THE_VARIANT = (*naming.SEEDS, "seeds", "members.impl", "mesh.member")


def read_record(folder) -> Optional[dict]:
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def write_record(folder, record: dict) -> None:
    atomic_write(Path(folder) / RECORD, json.dumps(record, indent=1) + "\n")


def kept_stages(stages: Stages) -> dict:
    """What a plan's judgement depends on besides its runs: the declared stages, kept with the plan."""
    return dataclasses.asdict(stages)


def check_stages(plan: dict, stages: Stages, where: str) -> None:
    """Refuse, in one line naming the first difference, to judge a kept plan under a design other
    than the one it was made under (w1 or the boundaries chosen after stage 2 was seen inflate the
    false-difference rate: docs/statistics.md). A plan kept before designs were kept has none."""
    kept = plan.get("design")
    if kept is None:
        return
    now = kept_stages(stages)
    diff = next((k for k in sorted(set(kept) | set(now)) if kept.get(k) != now.get(k)), None)
    if diff is not None:
        raise ConfigError(
            f"{where}: its stage 2 was planned under stages.{diff} = {kept.get(diff)!r}, now {now.get(diff)!r}; "
            "a changed design is a new declaration on fresh seeds, not an edit after the runs were seen"
        )


def read_stages(path: str) -> Stages:
    """--stages FILE's declared stages, checked: one line naming the file and what would be valid."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--stages {path}: no such file; give a YAML file with a stages: mapping (a study file's)")
    raw = read_yaml(file)
    if not isinstance(raw, dict) or "stages" not in raw:
        raise ConfigError(f"--stages {path}: no stages: mapping in it (docs/statistics.md, 'Studies in stages')")
    return stages_from(raw["stages"], str(file))


def one_look(study: Study) -> np.ndarray:
    """The findings no stage 2 adds to: those judged on values measured elsewhere (the stress
    runs, a plan of their own), each with one look, its fixed-design test (stages.reject_by_look)."""
    return np.array([STUDY[f.metric].reads == "given" for f in study.findings])


def split(arms: list[str], seeds: list, tables: dict, record: Optional[dict], given=frozenset()) -> tuple[dict, dict]:
    """(stage 1's tables, stage 2's), NaN outside each: stage 1 the record's stage-1 seeds, stage 2 each
    arm's planned ones (a seed of neither is in no stage). A metric in `given` (measured elsewhere) is all
    stage 1. Without a record every value is stage 1's."""
    if record is None:
        return dict(tables), {m: np.full_like(t, np.nan) for m, t in tables.items()}
    in1 = np.array([s in set(record["stage1"]) for s in seeds])[None, :]
    in2 = np.array([[s in set(record["stage2"].get(a, [])) for s in seeds] for a in arms])
    first = {m: t if m in given else np.where(in1, t, np.nan) for m, t in tables.items()}
    second = {m: np.full_like(t, np.nan) if m in given else np.where(in2, t, np.nan) for m, t in tables.items()}
    return first, second


def _given(study: Study) -> set[str]:
    return {f.metric for f in study.findings if STUDY[f.metric].reads == "given"}


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
    keeps -- stage 1's seeds, then plan_tables' account, per finding."""
    arms, seeds, tables = claims_tables(study, by_arm, extra)
    first, _ = split(arms, seeds, tables, {"stage1": stage1, "stage2": {}}, _given(study))
    comps = comparisons(study, arms, first)
    ids = [f.id for f in study.findings]
    account = plan_tables(
        study.stages, arms, first, comps, ~one_look(study), seconds_per_run(by_arm), ids, f"study {study.name}"
    )
    return {"declared": study.stages.declared, "design": kept_stages(study.stages), "stage1": list(stage1), **account}


def plan_tables(
    stages: Stages,
    arms: list[str],
    first: dict[str, np.ndarray],
    comps: list[V.Comparison],
    own: np.ndarray,
    cost_s: dict[str, float],
    ids: list[str],
    who: str,
) -> dict:
    """Stage 2 by the declared rule from stage 1's tables for `comps` (named `ids`; `own`: those stage 2
    can add to; `cost_s`: an arm's seconds per run): each Δ, each arm's stage-2 seeds, the budget spent,
    and per open comparison its planned pairs and chance to settle by look 2 (a plan, not a test)."""
    if not comps:  # one variant: nothing to compare, nothing for stage 2 to add to
        empty = {"margins": {}, "rule": stages.rule, "budget": {stages.unit: stages.budget}, "spent": 0.0}
        return {**empty, "seconds_per_run": {}, "stage2": {}, "open": {}}
    chance, open_ = A.chances(first, comps, stages.combination, own, stages.cap)
    # the arms stage 2 could raise: those of a finding still open that its runs add to (one whose
    # arm has no stage-1 run, left out of this study's `+arm=`, is not open: it was never tested)
    raisable = sorted({i for c, o, op in zip(comps, own, open_) if o and op for i in (c.arm, c.against)})
    if stages.unit == "cpu_hours" and (missing := [arms[i] for i in raisable if arms[i] not in cost_s]):
        raise ConfigError(
            f"{who}: stages.budget is in CPU-hours but {', '.join(missing)} has no finished stage-1 run to "
            "measure a seed's cost on; give stages.budget in runs, or let stage 1 finish"
        )
    per_seed = np.array(
        [(1.0 if stages.unit == "runs" else cost_s[a] / 3600) if i in raisable else 0.0 for i, a in enumerate(arms)]
    )
    ends = np.array([(c.arm, c.against) for c in comps]).T
    if stages.rule == "budget":
        allowed = np.isin(np.arange(len(arms)), raisable)  # never an arm of no open finding, free or not
        k = A.allocate(chance, ends[0], ends[1], per_seed, stages.budget, allowed=allowed)
    else:  # "even": every arm of a finding still open alike, as many seeds as the budget affords
        needed = sorted({i for j, c in enumerate(comps) if open_[j] and own[j] for i in (c.arm, c.against)})
        k = np.zeros(len(arms), int)
        if needed:
            k[needed] = min(stages.cap, int(stages.budget // sum(per_seed[i] for i in needed)))
    pairs = np.minimum(k[ends[0]], k[ends[1]])
    return {
        "margins": {i: float(c.margin) if math.isfinite(c.margin) else None for i, c in zip(ids, comps)},  # None: no Δ
        "rule": stages.rule,
        "budget": {stages.unit: stages.budget},
        "spent": float((k * per_seed).sum()),
        "seconds_per_run": {a: round(cost_s[a], 1) for a in arms if a in cost_s},
        "stage2": {arms[i]: stages.seeds(int(k[i])) for i in range(len(arms)) if k[i] > 0},
        "open": {
            i: {"pairs": int(pairs[j]), "chance": float(chance[j, pairs[j]])}
            for j, i in enumerate(ids)
            if open_[j] and own[j]
        },
    }


def judge_study(
    study: Study, claims: tuple, record: Optional[dict], untestable: Optional[dict[str, str]] = None
) -> list[Judged]:
    """Each finding of `claims` (claims_tables) judged at both looks (`looks`) beside its Spread over every
    seed; Δ is the record's (stage 1's baseline). Before stage 2 is planned, everything is look 1's."""
    arms, seeds, tables = claims
    first, second = split(arms, seeds, tables, record, _given(study))
    comps = comparisons(study, arms, first)
    every, fixed = spreads(study, claims)
    untestable = untestable or {}
    if record is not None and "margins" in record:
        comps = [
            dataclasses.replace(c, margin=_kept(record["margins"], f.id, c.margin))
            for f, c in zip(study.findings, comps)
        ]
    once = one_look(study)
    rows = []
    looks = S.looks(first, second, comps, study.stages.combination, once)
    for f, sp, c, look, one, code in zip(study.findings, every, comps, looks, once, fixed["verdict"]):
        # untestable at one look (no spread, or declared so) is untestable at every look
        tested = f.id not in untestable and code != V.UNTESTABLE
        codes = [V.verdict(look[k], f.side) if tested else V.UNTESTABLE for k in ("look1", "look2")]
        rows.append(
            Judged(
                f,
                sp,
                margin=float(c.margin),
                diff=look["d"],
                **{k: look[k] for k in ("low", "high", "fw_low", "fw_high", "fw_level")},
                outcome=look["look2"],
                code=codes[1],
                verdict=verdict_text(codes[1], sp.needed, min(sp.n), untestable.get(f.id, ""), plan=sp.plan),
                look1=P.VERDICTS[codes[0]],
                stage_n=look["stage_n"],
                one_look=bool(one),
            )
        )
    return rows


def _kept(margins: dict, key: str, default: float) -> float:
    """A comparison's Δ as its record keeps it: null is no Δ (NaN); one not kept, `default`."""
    if key not in margins:
        return default
    return math.nan if margins[key] is None else margins[key]


def design_words(stages: Stages) -> dict[str, object]:
    """A declared design's fields as its prose names them (prose.STAGES_DESIGN, REPORT_STAGES)."""
    return {
        "declared": stages.declared,
        "w1": f"{stages.w1:.3f}",
        "kind": stages.boundaries,
        "rule": stages.rule,
        "budget": f"{stages.budget:g} {stages.unit.replace('_', '-')}",
        "cap": stages.cap,
        "seeds_from": stages.seeds_from,
    }


def study_section(stages: Stages, record: Optional[dict], rows: list[Judged], statistics: str) -> Section:
    """A study's stages: the design as declared, stage 1's seeds, look 1's verdicts, what the rule asked
    for and why, stage 2's seeds, the verdicts by look 2."""
    s = Section("stages", P.STAGES_TITLE)
    s.text.append(P.STAGES_DESIGN.format(**design_words(stages), statistics=statistics))
    stage1 = record["stage1"] if record is not None else sorted({x for r in rows for x in r.spread.seeds}, key=str)
    settled1 = sum(r.look1 in P.VERDICTS[: V.NOT_RESOLVED] for r in rows)
    s.text.append(P.STAGE1.format(seeds=", ".join(map(str, stage1)), settled=settled1, n=len(rows)))
    if record is None:
        s.text.append(P.STAGE2_NOT_PLANNED)
        return s
    s.text.append(_stage2_words(record))
    s.tables.append(
        (
            list(P.STAGES_COLUMNS),
            [
                [
                    r.finding.id,
                    r.look1,
                    P.STAGE2_ELSEWHERE
                    if r.one_look
                    else _why(record["open"].get(r.finding.id), r.look1 in P.VERDICTS[: V.NOT_RESOLVED]),
                    f"{r.stage_n[0]} + {r.stage_n[1]}",
                    P.VERDICTS[r.code],
                ]
                for r in rows
            ],
        )
    )
    return s


def _stage2_words(record: dict) -> str:
    """What the rule spent and asked for, in words."""
    if not record["stage2"]:
        return P.STAGE2_NONE
    return P.STAGE2_PLAN.format(
        spent=fmt3(record["spent"]),
        budget=" ".join(f"{v:g} {k.replace('_', '-')}" for k, v in record["budget"].items()),
        arms="; ".join(f"{a}: {', '.join(map(str, ks))}" for a, ks in record["stage2"].items()),
    )


def _why(open_: Optional[dict], settled: bool) -> str:
    """What the rule asked for one comparison and why, in the table's words."""
    if open_ is None:
        return P.STAGE2_SETTLED if settled else P.STAGE2_UNTESTED
    if open_["pairs"] == 0:
        return P.STAGE2_NOTHING
    return P.STAGE2_PAIRS.format(k=open_["pairs"], then=f"{open_['chance']:.0%}")


# -- a report's comparisons with its baseline in stages (`dalle-ablate report --stages FILE`): it trains nothing,
# it says what stage 2 asks for and judges the stage-2 runs it is given
def judge_report(
    by_variant: dict[str, list[Run]], baseline: str, margins: Optional[dict[str, str]], stages: Stages
) -> tuple[dict, dict]:
    """(against_baseline's rows judged at both looks; the plan's record: stage 1's seeds, each Δ from stage
    1's baseline, stage 2's seeds per variant by the rule and why)."""
    # stage 1: the finished runs on seeds below stage 2's, so that the plan is the same at every report
    # of them (a run still training, or on a seed of neither stage, is in no stage)
    done = {
        v: [r for r in rs if r.status == "finished" and isinstance(r.seed, int) and r.seed < stages.seeds_from]
        for v, rs in by_variant.items()
    }
    stage1 = sorted({r.seed for rs in done.values() for r in rs})
    _, seeds1, tables1, comps, keys = baseline_tables(done, baseline, margins)
    first1, _ = split(list(done), seeds1, tables1, {"stage1": stage1, "stage2": {}})
    ids = [f"{v} / {m}" for v, m in keys]
    every = np.ones(len(comps), bool)
    account = plan_tables(stages, list(done), first1, comps, every, seconds_per_run(done), ids, "report")
    record = {"declared": stages.declared, "design": kept_stages(stages), "stage1": stage1, **account}
    variants, seeds, tables, _, _ = baseline_tables(by_variant, baseline, margins)
    first, second = split(variants, seeds, tables, record)
    rows = against_baseline(by_variant, baseline, margins)
    for (v, m), c, look in zip(keys, comps, S.looks(first, second, comps, stages.combination, ~every)):
        lower = metric(m).better == "lower"
        rows[(v, m)].update(
            {k: look[k] for k in ("d", "low", "high", "fw_low", "fw_high", "stage_n")},
            margin=float(c.margin),
            outcome=look["look2"],
            verdict=P.against_baseline(look["look2"], lower),
            look1=P.against_baseline(look["look1"], lower),
            n=sum(look["stage_n"]),  # the seeds judged: both stages'
            plan=(0, 0, 0),  # what more seeds would do is the stages' plan, not the one-look one
        )
    return rows, record


def stage2_command(runs: list[Run], seeds: list[int]) -> str:
    """The command that trains a variant's stage-2 seeds: its runs' own overrides, the seeds of
    stage 2 in place of theirs."""
    given = naming.own(runs[0].meta.get("overrides") or [])
    mine = [o for o in given if naming.key_of(o) not in NOT_THE_VARIANT]
    return " ".join(["python run.py -m", *mine, f"seed={','.join(map(str, seeds))}"])


def report_section(stages: Stages, record: dict, judged_rows: dict, by_variant: dict[str, list[Run]]) -> Section:
    """A report's stages: their declaration, stage 1's seeds, what the rule asked for and the commands that train
    it, then per comparison its verdict at each look, the rule's reason and its seeds per stage."""
    s = Section("stages", P.STAGES_TITLE)
    s.text.append(P.REPORT_STAGES.format(**design_words(stages)))
    settled = sum(j["look1"] != "not resolved" for j in judged_rows.values())
    s.text.append(
        P.REPORT_STAGE1.format(seeds=", ".join(map(str, record["stage1"])), settled=settled, n=len(judged_rows))
    )
    s.text.append(_stage2_words(record))
    if record["stage2"]:
        commands = [stage2_command(by_variant[v], ks) for v, ks in record["stage2"].items()]
        s.text.append(P.REPORT_STAGE2_RUN.format(commands="; ".join(f"`{c}`" for c in commands)))
    rows = []
    for (v, m), j in judged_rows.items():
        why = _why(record["open"].get(f"{v} / {m}"), j["look1"] != "not resolved")
        rows.append([v, m, j["look1"], why, f"{j['stage_n'][0]} + {j['stage_n'][1]}", j["verdict"]])
    s.tables.append((list(P.REPORT_STAGES_COLUMNS), rows))
    return s
