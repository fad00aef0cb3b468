"""A study's stress runs (its file's `stress:` plan, report/study_file.py; measured by
report/stress.py): each arm of its stability claims at each rate and seed, one job per arm and
rate with its seeds as members, in `<study folder>-stress/`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate.registry import RunFailed
from dalle_ablate.report.study_file import CONTROLLED, StressPlan, load_stress, run_name, stress_folder
from dalle_ablate.report.load import read_json
from dalle_ablate.study.children import call_child
from dalle_ablate.study.clock import Clock
from dalle_ablate.study.jobs import members_block
from dalle_ablate.track.runstore import settled


@dataclasses.dataclass
class StressOutcome:
    line: str  # for the page's provenance
    failed: list[str]  # stress runs that ended otherwise than finished or diverged


def run_stress(
    study_file: Path,
    experiment: str,
    folder: Path,
    overrides: list[str],
    env: dict,
    preexec: Optional[Callable[[], None]] = None,
    members: bool = True,
    done: frozenset = frozenset(),
    clock: Optional[Clock] = None,
    after: Callable[[], object] = lambda: None,
) -> Optional[StressOutcome]:
    """The study's stress runs (report/stress.py), if its file declares them: each arm of its
    stability claims at each rate and seed into `<folder>-stress/`, the seeds of an arm and rate
    as members of one job (`members`; else one process per run); a run that finished or diverged
    before is not started again, a stopped one continues (resume=auto). `done`: the names of runs
    a study's record holds (not trained again); `clock`: the study's time limit (a job that would
    not end in time is not started); `after`: called after each job (the record takes its runs)."""
    import time

    plan = load_stress(study_file)
    if plan is None:
        return None
    where = stress_folder(folder)
    t, ran, failed = time.perf_counter(), 0, []
    groups = (
        [(arm, lr, plan.seeds) for arm in plan.arms for lr in plan.rates]
        if members
        else [(arm, lr, [seed]) for arm, lr, seed in plan.jobs()]
    )
    for i, (arm, lr, seeds) in enumerate(groups, 1):
        todo = [
            s
            for s in seeds
            if run_name(arm, lr, s) not in done and not _settled(where / run_name(arm, lr, s) / "run", plan.steps)
        ]
        if not todo:
            continue
        if clock is not None and not clock.fits(
            "stress", [arm], len(todo), f"{len(todo)} stress run{'s' if len(todo) > 1 else ''} of {arm} at lr {lr:g}"
        ):
            continue
        print(
            f"stress job {i} of {len(groups)}: {', '.join(str(where / run_name(arm, lr, s)) for s in todo)}", flush=True
        )
        # every seed of the group, settled ones too: a members job leaves a finished or diverged member as
        # it is -- but a run a record holds, which may have no store here: the job is of the others
        group = [s for s in seeds if run_name(arm, lr, s) not in done]
        command = job_command(sys.executable, experiment, where, arm, lr, group[0], plan, overrides, group)
        try:
            code = call_child(command, env, preexec, deadline=None if clock is None else clock.deadline)
        finally:
            after()
        ran += len(todo)
        if code not in (0, RunFailed.DIVERGED):  # a diverged run is a measurement of its rate
            failed.append(f"{', '.join(run_name(arm, lr, s) for s in todo)} (exit {code})")
    how = "; the seeds of each arm and rate as members of one job" if members and len(plan.seeds) > 1 else ""
    line = (
        f"Stress runs: {len(plan.jobs())} in {where} ({len(plan.arms)} arms x {len(plan.rates)} rates x "
        f"{len(plan.seeds)} seeds, {plan.steps} steps{how}); this invocation started {ran} of them in "
        f"{(time.perf_counter() - t) / 60:.1f} min (those that finished or diverged before are not rerun)."
    )
    return StressOutcome(line, failed)


def _settled(store: Path, steps: int) -> bool:
    """A stress run that need not start again (track.runstore.settled: a diverged run is a result,
    the same rate, seed and code diverge again); a torn or corrupt summary is named in one line."""
    path = store / "summary.json"
    return path.exists() and settled(read_json(path), steps)


def job_command(
    python: str,
    experiment: str,
    folder: Path,
    arm: str,
    lr: float,
    seed: int,
    plan: StressPlan,
    overrides: list[str],
    members: list[int] | None = None,
) -> list[str]:
    """One stress run as a single `dalle_ablate.job` process: the study's preset and arm at this
    rate, seed and budget, the plan's overrides, then the study command's own (less CONTROLLED).
    `members`: the seeds of this arm and rate trained as members of the one job (jobs.members_block),
    each in the folder its own run would have (`<arm>-lr<rate>-seed<k>`, the run folder's template
    resolved with seed=k)."""
    from dalle_ablate.track.naming import key_of

    own = [o for o in overrides if key_of(o) not in CONTROLLED]
    folder_of = Path(folder) / run_name(arm, lr, seed)
    seeded = [f"seed={seed}"]
    if members and len(members) > 1:
        seeded = members_block(members, own)
        folder_of = Path(folder) / run_name(arm, lr, seed).replace(f"-seed{seed}", "-seed${seed}")
    return [
        python,
        "-m",
        "dalle_ablate.job",
        f"experiment={experiment}",
        f"+arm={arm}",
        f"optim.lr={lr!r}",
        *seeded,
        f"trainer.steps={plan.steps}",
        "resume=auto",
        *plan.overrides,
        *own,
        f"hydra.run.dir={folder_of}",
    ]
