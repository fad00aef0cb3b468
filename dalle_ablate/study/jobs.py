"""A study's jobs as command lines: its own runs' multiruns of its experiment preset, each arm's
seeds as the members of one job or one job per seed, the arms it times as jobs of their own."""

from __future__ import annotations

import sys
from pathlib import Path

from dalle_ablate.fileio import shown
from dalle_ablate.report.study_file import Study, swept_arms, swept_seeds
from dalle_ablate.track.naming import key_of


def stage1_commands(study: Study, folder: Path, swept: list[str], members: bool) -> list[list[str]]:
    """The study's own runs as multiruns of its preset: each arm's seeds the members of one job
    (`members`; else one job per seed) -- but the arms its file times (`timing:`), which train as
    jobs of their own, interleaved seed by seed (every timed arm's seed k, then each one's next),
    so that a step-time finding's replicates are separate timings taken side by side, paired by
    seed (members of one job log one timing between them)."""
    base = [sys.executable, "-m", "dalle_ablate.job", "-m", f"experiment={study.experiment}"]
    base.append(f"hydra.sweep.dir={shown(folder)}")
    arms = swept_arms(study, swept)
    timed = [a for a in arms if a in study.timed]
    if not timed:
        return [[*base, *(as_members(study.experiment, swept) if members else swept)]]
    others = [o for o in swept if key_of(o) != "arm"]
    rest = [a for a in arms if a not in timed]
    out = []
    if rest:
        mine = [*others, f"+arm={','.join(rest)}"]
        out.append([*base, *(as_members(study.experiment, mine) if members else mine)])
    unseeded = [o for o in others if key_of(o) not in ("seed", "seeds")]
    for k in swept_seeds(study.experiment, swept) or [None]:
        out.append([*base, *unseeded, f"+arm={','.join(timed)}", *([] if k is None else [f"seed={k}"])])
    return out


def as_members(experiment: str, overrides: list[str]) -> list[str]:
    """The study's multirun overrides with each arm's seeds trained as members of one job
    (train/loop.py train_members): `seeds=[...]` in place of the seed sweep, and `seed=` the first of them,
    which names the job's own folder (`<arm>-seed<first>`, its first member's). The run folders,
    names and overrides each member records are its separate run's (job.py member_jobs).
    `members.impl=map` unless the overrides choose: each member's own program, so the runs are
    their separate runs bit for bit on a CPU (the page cannot tell how they were made), Shampoo's
    arm runs (vmap refuses it), and on 2 CPU cores it is the faster of the two
    (docs/results/benchmarks/members.md)."""
    seeds = swept_seeds(experiment, overrides)
    if seeds is None or len(seeds) < 2:
        return overrides
    kept = [o for o in overrides if o.split("=", 1)[0] != "seed"]
    impl = [] if any(o.startswith("members.impl=") for o in overrides) else ["members.impl=map"]
    return [*kept, f"seed={seeds[0]}", f"seeds=[{','.join(map(str, seeds))}]", *impl]
