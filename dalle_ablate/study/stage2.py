"""A staged study's stage 2 (its file's `stages:`; report/staged.py plans it): planned once, from
stage 1's finished runs, and the plan kept in the study's folder before any stage-2 run starts --
a rerun reads it back and never plans again, so what stage 2 is cannot change after its first run;
then each arm the plan raises trained on its stage-2 seeds, as members of one job (or one job per
seed; the arms the study times, jobs of their own interleaved seed by seed), into the study's
folder beside stage 1's (`<arm>-seed<k>`). Finished runs are left as they are (resume=auto)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate.registry import ConfigError
from dalle_ablate.report import staged
from dalle_ablate.report.study_file import Study, swept_seeds
from dalle_ablate.report.findings import _arms_by
from dalle_ablate.report.page import StudyRuns, in_folder
from dalle_ablate.report.stress import stress_measures
from dalle_ablate.study.children import call_child
from dalle_ablate.study.clock import Clock
from dalle_ablate.study.jobs import Plan, members_block, multirun
from dalle_ablate.track.naming import key_of

# Keys stage 2 sets itself for each of its jobs: the study command's own are not passed on.
SETS = ("arm", "seed", "seeds", "hydra.sweep.dir")


def check_seeds(study: Study, overrides: list[str]) -> None:
    """Stage 2's seeds must be fresh: none of stage 1's (a run of both stages would be one run)."""
    if study.stages is None:
        return
    stage1 = swept_seeds(study.experiment, overrides) or []
    clash = sorted(set(stage1) & set(study.stages.seeds(study.stages.cap)))
    if clash:
        raise ConfigError(
            f"study {study.name}: stages.seeds_from={study.stages.seeds_from} gives stage 2 seeds that stage 1 "
            f"runs ({', '.join(map(str, clash))}); give stages.seeds_from above {max(stage1)}"
        )


@dataclass(frozen=True)
class PlanFrom:
    """What stage 2 is planned from, for a study kept in a record (study/kept.py): where its plan
    is kept, the record's runs, stage 1's declared seeds, and the runs the record holds (never
    trained again)."""

    keep: Path
    inputs: StudyRuns
    stage1: list[int]
    done: frozenset


def run_stage2(
    study: Study,
    study_file: Path,
    plan: Plan,
    preexec: Optional[Callable[[], None]] = None,
    kept: Optional[PlanFrom] = None,
    clock: Optional[Clock] = None,
    after: Callable[[], object] = lambda: None,
) -> int:
    """Plan stage 2 if no plan is kept yet, then train what it asks for; the exit code of the first
    job that failed, else 0. `kept`: a study kept in a record's; else the plan is kept in the
    study's folder and made from its runs there; `plan`: the study's (study/jobs.py). `clock`: the
    study's time limit; `after`: called after each job."""
    folder = plan.folder
    keep, done = (kept.keep, kept.done) if kept else (folder, frozenset())
    record = staged.read_record(keep)
    if record is not None:
        staged.check_stages(record, study.stages, f"study {study.name}: {Path(keep) / staged.RECORD}")
    else:
        inputs = kept.inputs if kept else in_folder(str(folder))
        stage1 = kept.stage1 if kept else list(plan.sweep.seeds)
        _, measured, _ = stress_measures(study_file, inputs.stress)
        record = staged.plan(study, _arms_by(inputs.runs), stage1, measured)
        staged.write_record(keep, record)  # before any stage-2 run: the plan is what stage 1 showed
        asked = "; ".join(f"{a}: {len(s)} seeds" for a, s in record["stage2"].items()) or "no seeds"
        print(f"stage 2 of study {study.name}, by its {record['rule']} rule: {asked}", flush=True)
    own = [o for o in plan.overrides if key_of(o) not in SETS]
    todo = {a: [s for s in seeds if f"{a}-seed{s}" not in done] for a, seeds in record["stage2"].items()}
    todo = {a: seeds for a, seeds in todo.items() if seeds}
    jobs = [
        ([a], job_command(study.experiment, folder, a, seeds, own, plan.members))
        for a, seeds in todo.items()
        if a not in study.timed
    ]
    # the arms the study times: jobs of their own, interleaved seed by seed, as at stage 1
    for k in sorted({s for a, seeds in todo.items() if a in study.timed for s in seeds}):
        timed = [a for a, seeds in todo.items() if a in study.timed and k in seeds]
        jobs.append((timed, job_command(study.experiment, folder, ",".join(timed), [k], own, False)))
    for arms, command in jobs:
        n = max(len(todo[a]) for a in arms) if len(arms) == 1 else 1
        if clock is not None and not clock.fits("runs", arms, n, f"stage 2's job of {', '.join(arms)}"):
            continue
        try:
            code = call_child(command, plan.env, preexec, deadline=None if clock is None else clock.deadline)
        finally:
            after()
        if code:
            return code
    return 0


def job_command(experiment: str, folder: Path, arm: str, seeds: list[int], own: list[str], members: bool) -> list[str]:
    """One arm's stage-2 seeds as a multirun of the study's preset into its folder: one job of them
    as members, or one job per seed."""
    seeded = members_block(seeds, own) if members and len(seeds) > 1 else [f"seed={','.join(map(str, seeds))}"]
    return multirun(experiment, folder, [f"+arm={arm}", *seeded, *own])
