"""A study's jobs, planned once from its command: multiruns of its experiment preset, each arm's
seeds the members of one job or one job per seed, the arms it times jobs of their own."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dalle_ablate.fileio import shown
from dalle_ablate.report.study_file import Study, own_arms, swept_arms, swept_seeds
from dalle_ablate.track.naming import key_of


@dataclass(frozen=True)
class Job:
    """One multirun of the study's preset. Its overrides keep the study command's order (arm and
    seed among them): the child's command line is the one the command has always written."""

    arms: tuple[str, ...]
    seeds: tuple[int, ...]  # () where the preset sweeps no seed
    overrides: tuple[str, ...]
    members: bool  # its seeds (two or more) trained as members of one job

    def tail(self) -> list[str]:
        """Its overrides as the child gets them: as members, `seeds=[...]` in place of the seed sweep."""
        if not self.members:
            return list(self.overrides)
        kept = [o for o in self.overrides if o.split("=", 1)[0] != "seed"]
        return [*kept, *members_block(self.seeds, self.overrides)]

    def command(self, experiment: str, folder: Path) -> list[str]:
        return multirun(experiment, folder, self.tail())


def multirun(experiment: str, folder: Path, overrides: list[str]) -> list[str]:
    """The command line of a multirun of the study's preset into its folder."""
    return [
        sys.executable,
        "-m",
        "dalle_ablate.job",
        "-m",
        f"experiment={experiment}",
        f"hydra.sweep.dir={shown(folder)}",
        *overrides,
    ]


@dataclass(frozen=True)
class Plan:
    """A study's runs as its command asks for them, planned once and handed on to its checks, its
    stage 1, its stress runs and its stage 2."""

    experiment: str
    folder: Path
    sweep: Job  # every arm and seed as one multirun: what the checks compose, and what stage 1 splits
    overrides: tuple[str, ...]  # the command's own: the stress runs and stage 2 pass on what they do not set
    members: bool  # each arm's seeds trained as members of one job (False: one job per seed)
    # The children's environment. The seeds of an arm compile the same programs: every run keeps
    # them in the compilation cache (compilation_cache.dir), and every run after its arm's first loads them.
    env: dict


def plan_study(study: Study, folder: Path, overrides: list[str], seed_override: Optional[str], members: bool) -> Plan:
    """The study command's plan: its overrides, a top-up's seeds, and the arms its file compares on
    its own runs unless an `+arm=` override chooses."""
    swept = [*overrides, *([seed_override] if seed_override else [])]
    if not any(o.split("=", 1)[0].lstrip("+") == "arm" for o in swept):
        swept.append(f"+arm={','.join(own_arms(study))}")
    return Plan(study.experiment, folder, sweep(study, swept, members), tuple(overrides), members, dict(os.environ))


def sweep(study: Study, swept: list[str], members: bool) -> Job:
    """A study's multirun overrides as one job, its arms and seeds read from them once."""
    seeds = tuple(swept_seeds(study.experiment, swept) or ())
    return Job(tuple(swept_arms(study, swept)), seeds, tuple(swept), members and len(seeds) > 1)


def stage1_jobs(whole: Job, timed: tuple[str, ...], done: Optional[set[str]] = None) -> list[Job]:
    """Stage 1's jobs: each arm's seeds in one job (`whole.members`) -- but the arms the study times,
    jobs of their own interleaved seed by seed, so that a step-time finding's replicates are timings
    taken side by side, paired by seed. `done`: the runs a record holds, left out (the other arms
    grouped by the seeds they lack)."""
    ks = whole.seeds or (None,)  # no seed swept: one job of the timed arms (a record always sweeps seeds)
    todo = {a: [k for k in ks if f"{a}-seed{k}" not in (done or ())] for a in whole.arms}
    others = [o for o in whole.overrides if key_of(o) not in ("arm", "seed", "seeds")]
    rest = [a for a in whole.arms if a not in timed]
    if done is not None:
        groups: dict[tuple, list[str]] = {}
        for a in (a for a in rest if todo[a]):
            groups.setdefault(tuple(todo[a]), []).append(a)
        jobs = [_job(g, s, [*others, _arm(g), _seeds(s)], whole.members) for s, g in groups.items()]
    elif len(rest) == len(whole.arms):
        jobs = [whole]
    else:  # the untimed arms, their seed sweep where the command put it
        mine = [o for o in whole.overrides if key_of(o) != "arm"]
        jobs = [_job(rest, whole.seeds, [*mine, _arm(rest)], whole.members)] if rest else []
    for k in ks:
        arms = [a for a in whole.arms if a in timed and k in todo[a]]
        if arms:
            seed = [] if k is None else [k]
            jobs.append(_job(arms, seed, [*others, _arm(arms), *([_seeds(seed)] if seed else [])], False))
    return jobs


def stage1_commands(study: Study, folder: Path, swept: list[str], members: bool) -> list[list[str]]:
    """The command lines of stage 1's jobs for the multirun overrides `swept`, none run yet."""
    return [j.command(study.experiment, folder) for j in stage1_jobs(sweep(study, swept, members), study.timed)]


def _job(arms, seeds, overrides: list[str], members: bool) -> Job:
    return Job(tuple(arms), tuple(seeds), tuple(overrides), members and len(seeds) > 1)


def _arm(arms) -> str:
    return f"+arm={','.join(arms)}"


def _seeds(seeds) -> str:
    return "seed=" + ",".join(str(s) for s in seeds)


def members_block(seeds, overrides) -> list[str]:
    """A job's seeds as members of one job (train/loop.py train_members): `seed=` the first, which
    names the job's folder (its first member's), and `seeds=[...]`. `members.impl=map` unless the
    overrides choose: each member's own program, so the runs are their separate runs bit for bit on
    a CPU, Shampoo's arm runs (vmap refuses it), and on 2 cores it is the faster
    (docs/results/benchmarks/members.md)."""
    impl = [] if any(o.startswith("members.impl=") for o in overrides) else ["members.impl=map"]
    return [f"seed={seeds[0]}", f"seeds=[{','.join(map(str, seeds))}]", *impl]


def as_members(experiment: str, overrides: list[str]) -> list[str]:
    """The multirun overrides with each arm's seeds as members of one job (one seed, or none swept: as they are)."""
    seeds = tuple(swept_seeds(experiment, overrides) or ())
    return Job((), seeds, tuple(overrides), len(seeds) > 1).tail()
