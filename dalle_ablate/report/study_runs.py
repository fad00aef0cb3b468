"""How `dalle-ablate study` runs its children: the multirun and the stress runs, each a child
process that dies with the study process and, on Ctrl-C, gets time to save (cli.py cmd_study)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate.registry import RunFailed


@dataclasses.dataclass
class StressOutcome:
    line: str  # for the page's provenance
    failed: list[str]  # stress runs that ended otherwise than finished or diverged


def dies_with_this_process() -> Optional[Callable[[], None]]:
    """A preexec_fn for a child that must not outlive this process: the kernel kills the child when
    this process dies, however (kill -9 included), so a study's multirun or stress run never goes
    on writing the study's run stores beside the next `dalle-ablate study` (Linux's
    PR_SET_PDEATHSIG; None elsewhere)."""
    if sys.platform != "linux":
        return None
    import ctypes
    import signal

    # Resolved here, not in the forked child: importing there could wait on a lock another
    # thread of this process held at the fork.
    prctl, kill, parent = ctypes.CDLL(None, use_errno=True).prctl, int(signal.SIGKILL), os.getpid()

    def preexec() -> None:
        prctl(1, kill)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # this process died before the line above took effect
            os._exit(1)

    return preexec


def call_child(command: list[str], env: dict, preexec: Optional[Callable[[], None]] = None,
               grace: float = 120.0) -> int:
    """subprocess.call, but a Ctrl-C lets the child finish what it does on one: Ctrl-C reaches the
    whole foreground process group, and a run saves its last whole step before it exits (exit
    130). subprocess.call would SIGKILL it 0.25 s after the interrupt. A second Ctrl-C, or
    `grace` seconds, kills it; either way the interrupt is re-raised once the child is gone."""
    import subprocess

    child = subprocess.Popen(command, env=env, preexec_fn=preexec)
    try:
        return child.wait()
    except KeyboardInterrupt:
        try:
            child.wait(timeout=grace)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            child.kill()
            child.wait()
        raise


def run_stress(study_file: Path, experiment: str, folder: Path, overrides: list[str], env: dict,
               preexec: Optional[Callable[[], None]] = None) -> Optional[StressOutcome]:
    """The study's stress runs (report/stress.py), if its file declares them: each arm of its
    stability claims at each rate and seed, one process per run into `<folder>-stress/`; a run that
    finished or diverged before is not started again, a stopped one continues (resume=auto)."""
    import time

    from dalle_ablate.report.stress import job_command, load_stress, run_name, settled, stress_folder

    plan = load_stress(study_file)
    if plan is None:
        return None
    where = stress_folder(folder)
    t, ran, failed = time.perf_counter(), 0, []
    for arm, lr, seed in plan.jobs():
        if settled(where / run_name(arm, lr, seed) / "run", plan.steps):
            continue
        code = call_child(job_command(sys.executable, experiment, where, arm, lr, seed, plan, overrides), env, preexec)
        ran += 1
        if code not in (0, RunFailed.DIVERGED):  # a diverged run is a measurement of its rate
            failed.append(f"{run_name(arm, lr, seed)} (exit {code})")
    line = (f"Stress runs: {len(plan.jobs())} in {where} ({len(plan.arms)} arms x {len(plan.rates)} rates x "
            f"{len(plan.seeds)} seeds, {plan.steps} steps); this invocation started {ran} of them in "
            f"{(time.perf_counter() - t) / 60:.1f} min (those that finished or diverged before are not rerun).")
    return StressOutcome(line, failed)
