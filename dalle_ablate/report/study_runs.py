"""`dalle-ablate study`: the study's runs (the multirun and the stress runs, each a child process
that dies with the study process and, on Ctrl-C, gets time to save), then its report and its
results page with the provenance of the runs."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate import interrupts
from dalle_ablate.fileio import check_url, is_url, pull, shown
from dalle_ablate.registry import ConfigError, Interrupted, RunFailed


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

    # Resolved here, not in the forked child: importing there could wait on a lock another
    # thread of this process held at the fork.
    prctl, kill, parent = ctypes.CDLL(None, use_errno=True).prctl, int(signal.SIGKILL), os.getpid()

    def preexec() -> None:
        prctl(1, kill)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # this process died before the line above took effect
            os._exit(1)

    return preexec


def call_child(
    command: list[str], env: dict, preexec: Optional[Callable[[], None]] = None, grace: float = 120.0
) -> int:
    """subprocess.call, but a Ctrl-C lets the child finish what it does on one: Ctrl-C reaches the
    whole foreground process group, and a run saves its last whole step before it exits (exit
    130). subprocess.call would SIGKILL it 0.25 s after the interrupt. A second Ctrl-C, or
    `grace` seconds, kills it; either way KeyboardInterrupt is raised once the child is gone, also
    when the child alone was interrupted (exit 130, or 143 after a SIGTERM). The child leaves the
    line a Ctrl-C ends with to this process (interrupts.PARENT_SAYS): the command that continues
    all of it. A SIGTERM this process takes is passed on to the child (a scheduler may signal the
    first process alone; a second SIGTERM to a child that got the first too is no press)."""
    import subprocess

    interrupts.check()  # a Ctrl-C already pressed: a child started now would not get it
    child = subprocess.Popen(command, env={**env, interrupts.PARENT_SAYS: "1"}, preexec_fn=preexec)
    try:
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                interrupts.check()
    except KeyboardInterrupt:
        if interrupts.word() == interrupts.TERMINATED:  # SIGTERM may have reached this process alone
            child.send_signal(signal.SIGTERM)  # (Kubernetes: the container's first one): the child saves too
        _wait_or_kill(child, grace)
        raise
    if code == 128 + signal.SIGTERM:  # the child alone got SIGTERM: stopped the same way, saying so
        interrupts.terminated()
    if code in (130, 128 + signal.SIGTERM) or interrupts.pending():
        interrupts.check()
        raise KeyboardInterrupt
    return code


def _wait_or_kill(child, grace: float) -> None:
    """Wait for an interrupted child to save and exit; kill it after `grace` s or at the next Ctrl-C."""
    import time

    end = time.monotonic() + grace
    try:
        while child.poll() is None and time.monotonic() < end and not interrupts.pending():
            time.sleep(0.1)
    except KeyboardInterrupt:  # Python's own handler (no interrupts.install): the second Ctrl-C
        pass
    if child.poll() is None:
        child.kill()
    child.wait()


def run_stress(
    study_file: Path,
    experiment: str,
    folder: Path,
    overrides: list[str],
    env: dict,
    preexec: Optional[Callable[[], None]] = None,
    members: bool = True,
) -> Optional[StressOutcome]:
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
    groups = (
        [(arm, lr, plan.seeds) for arm in plan.arms for lr in plan.rates]
        if members
        else [(arm, lr, [seed]) for arm, lr, seed in plan.jobs()]
    )
    for i, (arm, lr, seeds) in enumerate(groups, 1):
        todo = [s for s in seeds if not settled(where / run_name(arm, lr, s) / "run", plan.steps)]
        if not todo:
            continue
        print(
            f"stress job {i} of {len(groups)}: {', '.join(str(where / run_name(arm, lr, s)) for s in todo)}", flush=True
        )
        # every seed of the group, settled ones too: a members job leaves a finished or diverged member as it is
        code = call_child(
            job_command(sys.executable, experiment, where, arm, lr, seeds[0], plan, overrides, seeds), env, preexec
        )
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


def swept_seeds(experiment: str, overrides: list[str]) -> Optional[list[int]]:
    """The seeds a study's multirun sweeps: its last `seed=` override's values, else its preset's
    `hydra.sweeper.params.seed`; None if it sweeps no seed (one run per arm)."""
    from importlib.resources import files

    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [o for o in overrides if o.split("=", 1)[0] == "seed"]
    if not given:
        preset = files("dalle_ablate.conf").joinpath("experiment", f"{experiment}.yaml")
        params = (((yaml.safe_load(preset.read_text()) or {}).get("hydra") or {}).get("sweeper") or {}).get(
            "params"
        ) or {}
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


def run_study(
    study_arg: str,
    out: str,
    report_out: str,
    page_out: str,
    overrides: list[str],
    seeds: Optional[str] = None,
    no_run: bool = False,
    no_stress: bool = False,
    members: bool = True,
    again: str = "",
) -> None:
    """Run a study's arms and seeds (its multirun preset; runs that finished are left as they are,
    a stopped one continues from its checkpoint) and its stress runs, then write its report and
    its results page. `study_arg` is a study's name or its file; `seeds` tops it up (N or 'auto');
    `members`: each arm's seeds trained as members of one job (False: one job per seed); `again`:
    the command, for the line a Ctrl-C ends the study with (which continues all of it)."""
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
    jobs = as_members(study.experiment, swept) if members else swept
    stages = ["while checking it, before anything ran"]
    with _one_line_on_ctrl_c(study.name, again, stages):
        if not no_run:  # what its runs would meet, before any of them starts: one line and exit 2
            check_before_running(study, study_file, folder, jobs, overrides, stress=not no_stress)
        command = [
            sys.executable,
            "-m",
            "dalle_ablate.job",
            "-m",
            f"experiment={study.experiment}",
            f"hydra.sweep.dir={shown(folder)}",
            *jobs,
        ]
        t = time.perf_counter()
        # The seeds of an arm compile the same programs: every run keeps them in the compilation
        # cache (compilation_cache.dir), and every run after the first of its arm loads them.
        env = dict(os.environ)
        preexec = dies_with_this_process()
        stages.append("during its runs (the multirun of its arms)")
        code = 0 if no_run else call_child(command, env, preexec)
        if topup is not None and code == 0:  # logged once its runs are in: a failed top-up is no top-up
            _log_topup(folder, topup)
        stages.append("during its stress runs")  # not after a multirun that refused its config (exit 2)
        stress = (
            None
            if no_run or no_stress or code == 2
            else run_stress(study_file, study.experiment, folder, overrides, env, preexec, members)
        )
        elapsed = time.perf_counter() - t
        stages.append("while writing its report and page")
        runs = _study_runs(study.name, folder, code)
        lines = provenance(
            study_arg, seeds, overrides, command, runs, elapsed, not no_run, stress.line if stress is not None else None
        )
        if any(r.meta.get("members") for r in runs):
            lines.append(
                f"{sum(bool(r.meta.get('members')) for r in runs)} of the runs were trained as members of one job "
                "per arm (seeds=[...], docs/guides/members.md): each in its separate run's folder, with its "
                "overrides and its numbers; their step time is their share of the job's."
            )
        report = build_report(str(folder), report_out, study.name, study.baseline, transition=study.transition)
        interrupts.check()
        page = write_page(study, str(folder), Path(page_out), lines, study_file=study_file)
    print(f"wrote {report}/index.html and {page}")
    if code:
        raise RunFailed(
            f"study {study.name}: the multirun exited with {code}; the page shows the runs that finished", code
        )
    if stress is not None and stress.failed:
        raise RunFailed(f"study {study.name}: stress runs failed (not diverged): {', '.join(stress.failed)}")


def study_folder(out: str, name: str) -> Path:
    """The study's folder `<out>/<name>`; with `--out gs://...`, its staging folder, first made the
    bucket's copy (finished runs are found there, and its runs write through it to the bucket)."""
    if not is_url(out):
        return Path(out) / name
    return pull(check_url(f"{out.rstrip('/')}/{name}", "--out"), keep=("jax_cache",))


@contextlib.contextmanager
def _one_line_on_ctrl_c(name: str, again: str, stages: list[str]):
    """A Ctrl-C in the block (taken at a check, here or in a run the study waits for) ends the
    study with one line: the stage it stopped (the last of `stages`), what is kept, the command
    that continues all of it (a run's own line is left to this one: interrupts.PARENT_SAYS)."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(
            f"study {name} {interrupts.word()} {stages[-1]}; the runs that finished are kept, a stopped one "
            f"continues from its checkpoint; resume with: {again or 'the same command'}"
        ) from None


# -- checked before anything runs -----------------------------------------------------------------
def known_arms() -> list[str]:
    """The arms a study can run: the options of the `arm` config group (dalle_ablate/conf/arm/)."""
    from importlib.resources import files

    return sorted(
        p.name[: -len(".yaml")]
        for p in files("dalle_ablate.conf").joinpath("arm").iterdir()
        if p.name.endswith(".yaml")
    )


def check_arm(what: str, name, arms: list[str]) -> None:
    """A ConfigError unless `name` is an arm: `what` names where it was given, the line the
    closest arm (a typo) and the valid ones."""
    if name in arms:
        return
    close = difflib.get_close_matches(str(name), arms, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    raise ConfigError(f"{what}: not an arm (dalle_ablate/conf/arm/){hint} valid: {', '.join(arms)}")


def multirun_jobs(experiment: str, jobs: list[str]) -> list[list[str]]:
    """One override list per arm the study's multirun runs (each other swept key at its first
    value): what composing its jobs needs to meet every arm and every override. The arms are
    those of an `+arm=` override, else its preset's `hydra.sweeper.params`."""
    from importlib.resources import files

    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parse = OverridesParser.create().parse_overrides
    parsed = parse(jobs)
    arm = [o for o in parsed if o.key_or_group == "arm"]
    if not arm:
        preset = files("dalle_ablate.conf").joinpath("experiment", f"{experiment}.yaml")
        params = (((yaml.safe_load(preset.read_text()) or {}).get("hydra") or {}).get("sweeper") or {}).get(
            "params"
        ) or {}
        arm = parse([f"+arm={params['+arm']}"]) if "+arm" in params else []
    arms = [
        str(a)
        for a in (
            list(arm[-1].sweep_iterator()) if arm and arm[-1].is_sweep_override() else [arm[-1].value()] if arm else []
        )
    ]
    # Hydra's own settings (hydra.*, hydra/launcher=) shape how jobs run, not what a job composes
    fixed = [
        (o.input_line.split(o.key_or_group)[0] + f"{o.key_or_group}={next(iter(o.sweep_iterator()))}")
        if o.is_sweep_override()
        else o.input_line
        for o in parsed
        if o.key_or_group != "arm" and not o.key_or_group.startswith("hydra")
    ]
    return [[f"experiment={experiment}", *fixed, f"+arm={a}"] for a in arms] or [[f"experiment={experiment}", *fixed]]


def check_before_running(
    study, study_file: Path, folder: Path, jobs: list[str], overrides: list[str], stress: bool
) -> None:
    """What a study's runs would meet, checked before any starts (ConfigError, one line): every
    arm its file names (baseline, each finding's arm and against) and its command line gives is an
    arm; each arm's job of the multirun composes and passes a run's checks, and so does its stress
    plan, each arm and each rate; and the run stores already there can be read (a file torn by a
    kill is named, as `--no-run` names it)."""
    from dalle_ablate.report.stress import job_command, load_stress, stress_folder
    from dalle_ablate.validate import compose, format_error, to_run_config

    arms = known_arms()
    check_arm(f"{study_file}: baseline {study.baseline!r}", study.baseline, arms)
    for f in study.findings:
        check_arm(f"{study_file}: finding {f.id!r} has arm {f.arm!r}", f.arm, arms)
        check_arm(f"{study_file}: finding {f.id!r} has against {f.against!r}", f.against, arms)
    job_lists = multirun_jobs(study.experiment, jobs)
    for job in job_lists:
        if job[-1].startswith("+arm="):
            check_arm(job[-1], job[-1].partition("=")[2], arms)
    for job in job_lists:
        to_run_config(compose(job))
    plan = load_stress(study_file) if stress else None
    if plan is not None:  # each arm at one rate, each rate on one arm: nothing else differs between its runs
        probes = {(a, plan.rates[0]) for a in plan.arms} | {(plan.arms[0], lr) for lr in plan.rates}
        for arm, lr in sorted(probes):
            try:
                to_run_config(
                    compose(
                        job_command("python", study.experiment, Path("."), arm, lr, plan.seeds[0], plan, overrides)[
                            3:-1
                        ]
                    )
                )
            except Exception as e:  # noqa: BLE001 - re-raised unless it is a user mistake
                if format_error(e) is None:
                    raise
                raise ConfigError(f"{study_file}: stress run of {arm} at lr {lr:g}: {format_error(e)}") from None
    for where in (folder, stress_folder(folder)):
        _readable_stores(where)


def _readable_stores(folder: Path) -> None:
    """The files under `folder` that the study will read as they are, read now, or a ConfigError
    naming the first that cannot be (torn, corrupt, missing): every file of a run that finished or
    diverged (its run is not started again, and the report reads it), each summary.json and
    meta.json (a resumed run reads them), each members job's members.json. What a resumed run
    repairs itself -- a last metrics line cut off by a kill, its config.yaml -- is left to it."""
    from dalle_ablate.report.load import find_stores, load_run, read_json
    from dalle_ablate.train.records import MEMBERS_FILE

    try:
        stores = find_stores(str(folder))
    except ConfigError:  # none yet
        return
    for store in stores:
        summary = read_json(store / "summary.json") if (store / "summary.json").exists() else {}
        if summary.get("status") in ("finished", "diverged"):
            load_run(store)
        _check_meta(store)
        read_json(store / "meta.json")
    for path in sorted(Path(folder).rglob(MEMBERS_FILE)):
        read_json(path)


def _plan_topup(study, folder: Path, seeds: str, overrides: list[str]) -> tuple[str, dict]:
    """(the seed override that tops every arm up, the top-up's record), printed."""
    from dalle_ablate.report.findings import plan_topup

    seed_override, topup = plan_topup(study, folder, seeds, overrides)
    print(
        f"study {study.name}: topping up from {topup['from']} to {topup['to']} seeds per arm ({seed_override}; the "
        f"rule asks for {topup['rule']})"
    )
    return seed_override, topup


def _log_topup(folder: Path, topup: dict) -> None:
    """Add a finished top-up to the study's log of them (the page prints the rule it followed)."""
    import json
    import time

    from dalle_ablate.fileio import atomic_write
    from dalle_ablate.report.findings import TOPUPS

    log = folder / TOPUPS
    atomic_write(
        log,
        json.dumps(
            [
                *(json.loads(log.read_text()) if log.exists() else []),
                {**topup, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            ],
            indent=1,
        ),
    )


def _study_runs(name: str, folder: Path, code: int) -> list:
    """The study's run stores, each readable and saying which arm it is (its meta.json)."""
    from dalle_ablate.report.load import find_stores, load_runs

    try:
        find_stores(str(folder))
    except ConfigError:
        raise RunFailed(f"study {name}: no runs under {folder} (the multirun exited with {code})", code or 4) from None
    runs = load_runs(str(folder))  # a torn or unreadable file of a run store: named in one line
    for r in runs:
        _check_meta(r.root)
    return runs


def _check_meta(store: Path) -> None:
    """A run store's meta.json is there: its overrides say which arm the run is (report/findings.py arm_of)."""
    if not (store / "meta.json").is_file():
        raise ConfigError(
            f"{store / 'meta.json'}: no such file, so the study cannot tell which arm the run is; delete "
            f"{store.parent} and run the study again to train it anew"
        )
