"""`dalle-ablate study`: the study's runs (the multirun and the stress runs, each a child process
that dies with the study process and, on Ctrl-C, gets time to save), then its report and its
results page with the provenance of the runs."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate.fileio import check_url, is_url, pull, shown
from dalle_ablate.registry import ConfigError, RunFailed


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
               preexec: Optional[Callable[[], None]] = None, members: bool = True) -> Optional[StressOutcome]:
    """The study's stress runs (report/stress.py), if its file declares them: each arm of its
    stability claims at each rate and seed into `<folder>-stress/`, the seeds of an arm and rate
    as members of one job (`members`; else one process per run); a run that finished or diverged
    before is not started again, a stopped one continues (resume=auto)."""
    import time

    from dalle_ablate.report.stress import job_command, load_stress, run_name, settled, stress_folder

    plan = load_stress(study_file)
    if plan is None:
        return None
    where = stress_folder(folder)
    t, ran, failed = time.perf_counter(), 0, []
    groups = [(arm, lr, plan.seeds) for arm in plan.arms for lr in plan.rates] if members else \
        [(arm, lr, [seed]) for arm, lr, seed in plan.jobs()]
    for arm, lr, seeds in groups:
        todo = [s for s in seeds if not settled(where / run_name(arm, lr, s) / "run", plan.steps)]
        if not todo:
            continue
        # every seed of the group, settled ones too: a members job leaves a finished or diverged member as it is
        code = call_child(job_command(sys.executable, experiment, where, arm, lr, seeds[0], plan, overrides, seeds),
                          env, preexec)
        ran += len(todo)
        if code not in (0, RunFailed.DIVERGED):  # a diverged run is a measurement of its rate
            failed.append(f"{', '.join(run_name(arm, lr, s) for s in todo)} (exit {code})")
    how = "; the seeds of each arm and rate as members of one job" if members and len(plan.seeds) > 1 else ""
    line = (f"Stress runs: {len(plan.jobs())} in {where} ({len(plan.arms)} arms x {len(plan.rates)} rates x "
            f"{len(plan.seeds)} seeds, {plan.steps} steps{how}); this invocation started {ran} of them in "
            f"{(time.perf_counter() - t) / 60:.1f} min (those that finished or diverged before are not rerun).")
    return StressOutcome(line, failed)


def swept_seeds(experiment: str, overrides: list[str]) -> Optional[list[int]]:
    """The seeds a study's multirun sweeps: its last `seed=` override's values, else its preset's
    `hydra.sweeper.params.seed`; None if it sweeps no seed (one run per arm)."""
    from importlib.resources import files

    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [o for o in overrides if o.split("=", 1)[0] == "seed"]
    if not given:
        preset = files("dalle_ablate.conf").joinpath("experiment", f"{experiment}.yaml")
        params = (((yaml.safe_load(preset.read_text()) or {}).get("hydra") or {}).get("sweeper") or {}).get("params") or {}
        if "seed" not in params:
            return None
        given = [f"seed={params['seed']}"]
    override = OverridesParser.create().parse_overrides(given[-1:])[0]
    values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
    return [int(v) for v in values]


def as_members(experiment: str, overrides: list[str]) -> list[str]:
    """The study's multirun overrides with each arm's seeds trained as members of one job
    (train/members.py): `seeds=[...]` in place of the seed sweep, and `seed=` the first of them,
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


def run_study(study_arg: str, out: str, report_out: str, page_out: str, overrides: list[str], seeds: Optional[str] = None,
              no_run: bool = False, no_stress: bool = False, members: bool = True) -> None:
    """Run a study's arms and seeds (its multirun preset; runs that finished are left as they are,
    a stopped one continues from its checkpoint) and its stress runs, then write its report and
    its results page. `study_arg` is a study's name or its file; `seeds` tops it up (N or 'auto');
    `members`: each arm's seeds trained as members of one job (False: one job per seed)."""
    import time

    from dalle_ablate.report import build_report
    from dalle_ablate.report.findings import load_study, study_path
    from dalle_ablate.report.page import provenance, write_page

    study_file = Path(study_arg) if study_arg.endswith((".yaml", ".yml")) else study_path(study_arg)
    study = load_study(study_file)
    folder = study_folder(out, study.name)
    if seeds is not None and no_run:
        raise ConfigError("--seeds runs the added seeds; it cannot go with --no-run")
    seed_override, topup = _plan_topup(study, folder, seeds, overrides) if seeds is not None else (None, None)
    swept = [*overrides, *([seed_override] if seed_override else [])]
    command = [sys.executable, "-m", "dalle_ablate.job", "-m", f"experiment={study.experiment}", f"hydra.sweep.dir={shown(folder)}",
               *(as_members(study.experiment, swept) if members else swept)]
    t = time.perf_counter()
    # The seeds of an arm compile the same programs: JAX's persistent compilation cache
    # (jax_compilation_cache_dir) lets every run after the first of its arm load them from disk.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(folder / "jax_cache"))}
    preexec = dies_with_this_process()
    code = 0 if no_run else call_child(command, env, preexec)
    if topup is not None and code == 0:  # logged once its runs are in: a failed top-up is no top-up
        _log_topup(folder, topup)
    stress = None if no_run or no_stress else run_stress(study_file, study.experiment, folder, overrides, env, preexec,
                                                         members)
    elapsed = time.perf_counter() - t
    runs = _study_runs(study.name, folder, code)
    lines = provenance(study_arg, seeds, overrides, command, runs, elapsed, not no_run,
                       stress.line if stress is not None else None)
    if any(r.meta.get("members") for r in runs):
        lines.append(f"{sum(bool(r.meta.get('members')) for r in runs)} of the runs were trained as members of one job per "
                     "arm (seeds=[...], docs/guides/members.md): each in its separate run's folder, with its overrides and "
                     "its numbers; their step time is their share of the job's.")
    report = build_report(str(folder), report_out, study.name, study.baseline)
    page = write_page(study, str(folder), Path(page_out), lines, study_file=study_file)
    print(f"wrote {report}/index.html and {page}")
    if code:
        raise RunFailed(f"study {study.name}: the multirun exited with {code}; the page shows the runs that finished", code)
    if stress is not None and stress.failed:
        raise RunFailed(f"study {study.name}: stress runs failed (not diverged): {', '.join(stress.failed)}")


def study_folder(out: str, name: str) -> Path:
    """The study's folder `<out>/<name>`; with `--out gs://...`, its staging folder, first made the
    bucket's copy (finished runs are found there, and its runs write through it to the bucket)."""
    if not is_url(out):
        return Path(out) / name
    return pull(check_url(f"{out.rstrip('/')}/{name}", "--out"), keep=("jax_cache",))


def _plan_topup(study, folder: Path, seeds: str, overrides: list[str]) -> tuple[str, dict]:
    """(the seed override that tops every arm up, the top-up's record), printed."""
    from dalle_ablate.report.findings import plan_topup

    seed_override, topup = plan_topup(study, folder, seeds, overrides)
    print(f"study {study.name}: topping up from {topup['from']} to {topup['to']} seeds per arm ({seed_override}; the "
          f"rule asks for {topup['rule']})")
    return seed_override, topup


def _log_topup(folder: Path, topup: dict) -> None:
    """Add a finished top-up to the study's log of them (the page prints the rule it followed)."""
    import json
    import time

    from dalle_ablate.fileio import atomic_write
    from dalle_ablate.report.findings import TOPUPS

    log = folder / TOPUPS
    atomic_write(log, json.dumps([*(json.loads(log.read_text()) if log.exists() else []),
                                  {**topup, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}], indent=1))


def _study_runs(name: str, folder: Path, code: int) -> list:
    """The study's run stores, each readable and saying which arm it is (its meta.json)."""
    from dalle_ablate.report.load import find_stores, load_runs

    try:
        find_stores(str(folder))
    except ConfigError:
        raise RunFailed(f"study {name}: no runs under {folder} (the multirun exited with {code})", code or 4) from None
    runs = load_runs(str(folder))  # a torn or unreadable file of a run store: named in one line
    for r in runs:  # its overrides say which arm a run is (report/findings.py arm_of)
        if not (r.root / "meta.json").is_file():
            raise ConfigError(f"{r.root / 'meta.json'}: no such file, so the study cannot tell which arm the run is; delete "
                              f"{r.root.parent} and run the study again to train it anew")
    return runs
