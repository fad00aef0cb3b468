"""`dalle-ablate report --stages FILE`: a report's comparisons with the baseline in two declared stages, as a study's
(docs/statistics.md, "Studies in stages"). It trains nothing: it says what stage 2 asks for and judges the stage-2
runs it is given."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from dalle_ablate.metrics import metric
from dalle_ablate.registry import ConfigError
from dalle_ablate.report import prose as P
from dalle_ablate.report import staged
from dalle_ablate.report.study_file import Stages, stages_from
from dalle_ablate.report.load import Run, read_yaml
from dalle_ablate.report.tables import against_baseline, baseline_tables, fmt3
from dalle_ablate.report.writers import Section
from dalle_ablate.stats import stages as S
from dalle_ablate.track.naming import SEEDS, key_of, own

# Overrides of a run that say where or how it ran, not what it is: not in stage 2's command.
NOT_THE_VARIANT = (*SEEDS, "seeds", "members.impl", "mesh.member")


def read_design(path: str) -> Stages:
    """--stages FILE's design, checked: one line naming the file and what would be valid."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--stages {path}: no such file; give a YAML file with a stages: mapping (a study file's)")
    raw = read_yaml(file)
    if not isinstance(raw, dict) or "stages" not in raw:
        raise ConfigError(f"--stages {path}: no stages: mapping in it (docs/statistics.md, 'Studies in stages')")
    return stages_from(raw["stages"], str(file))


def judged(
    by_variant: dict[str, list[Run]], baseline: str, margins: Optional[dict[str, str]], stages: Stages
) -> tuple[dict, dict]:
    """(tables.against_baseline's rows, each comparison's verdict, difference and intervals from
    the two looks; the plan's record: stage 1's seeds, Δ of each comparison from stage 1's
    baseline, stage 2's seeds per variant by the rule and why)."""
    # stage 1: the finished runs on seeds below stage 2's, so that the plan is the same at every report
    # of them (a run still training, or on a seed of neither stage, is in no stage)
    done = {
        v: [r for r in rs if r.status == "finished" and _below(r.seed, stages.seeds_from)]
        for v, rs in by_variant.items()
    }
    stage1 = sorted({r.seed for rs in done.values() for r in rs})
    _, seeds1, tables1, comps, keys = baseline_tables(done, baseline, margins)
    first1, _ = staged.split(list(done), seeds1, tables1, {"stage1": stage1, "stage2": {}})
    ids = [f"{v} / {m}" for v, m in keys]
    every = np.ones(len(comps), bool)
    account = staged.plan_tables(stages, list(done), first1, comps, every, staged.seconds_per_run(done), ids, "report")
    record = {"declared": stages.declared, "design": staged.design_of(stages), "stage1": stage1, **account}
    variants, seeds, tables, _, _ = baseline_tables(by_variant, baseline, margins)
    first, second = staged.split(variants, seeds, tables, record)
    rows = against_baseline(by_variant, baseline, margins)
    for (v, m), c, look in zip(keys, comps, S.looks(first, second, comps, stages.design, ~every)):
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


def _below(seed, start: int) -> bool:
    return isinstance(seed, int) and seed < start


def stage2_command(runs: list[Run], seeds: list[int]) -> str:
    """The command that trains a variant's stage-2 seeds: its runs' own overrides, the seeds of
    stage 2 in place of theirs."""
    given = own(runs[0].meta.get("overrides") or [])
    mine = [o for o in given if key_of(o) not in NOT_THE_VARIANT]
    return " ".join(["python run.py -m", *mine, f"seed={','.join(map(str, seeds))}"])


def section(stages: Stages, record: dict, judged_rows: dict, by_variant: dict[str, list[Run]]) -> Section:
    """The stages of a report: the design as declared, stage 1's seeds, what the rule asked for and
    the commands that train it, then per comparison its verdict at look 1, the rule's reason, its
    seeds per stage and its verdict by look 2."""
    s = Section("stages", P.STAGES_TITLE)
    s.text.append(P.REPORT_STAGES.format(**staged.design_words(stages)))
    settled = sum(j["look1"] != "not resolved" for j in judged_rows.values())
    s.text.append(
        P.REPORT_STAGE1.format(seeds=", ".join(map(str, record["stage1"])), settled=settled, n=len(judged_rows))
    )
    if not record["stage2"]:
        s.text.append(P.STAGE2_NONE)
    else:
        asked = "; ".join(f"{v}: {', '.join(map(str, ks))}" for v, ks in record["stage2"].items())
        budget = " ".join(f"{v:g} {k.replace('_', '-')}" for k, v in record["budget"].items())
        s.text.append(P.STAGE2_PLAN.format(spent=fmt3(record["spent"]), budget=budget, arms=asked))
        commands = [stage2_command(by_variant[v], ks) for v, ks in record["stage2"].items()]
        s.text.append(P.REPORT_STAGE2_RUN.format(commands="; ".join(f"`{c}`" for c in commands)))
    rows = []
    for (v, m), j in judged_rows.items():
        open_ = record["open"].get(f"{v} / {m}")
        if open_ is None:
            why = P.STAGE2_SETTLED if j["look1"] != "not resolved" else P.STAGE2_UNTESTED
        elif open_["pairs"] == 0:
            why = P.STAGE2_NOTHING
        else:
            why = P.STAGE2_PAIRS.format(k=open_["pairs"], then=f"{open_['chance']:.0%}")
        rows.append([v, m, j["look1"], why, f"{j['stage_n'][0]} + {j['stage_n'][1]}", j["verdict"]])
    s.tables.append((list(P.REPORT_STAGES_COLUMNS), rows))
    return s
