"""`dalle-ablate study`: a study's runs (the multirun of its arms and seeds, then its stress runs,
each a child process: study/children.py), then its report and its results page, with the
provenance of the runs."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Optional

from dalle_ablate import interrupts
from dalle_ablate.fileio import check_url, is_url, pull, shown
from dalle_ablate.registry import ConfigError, Interrupted, RunFailed
from dalle_ablate.report import build_report
from dalle_ablate.report.study_file import Study, load_study, study_path
from dalle_ablate.report.load import Run, find_stores, load_runs, machine_time
from dalle_ablate.report.page import write_page
from dalle_ablate.report.tables import fmt3
from dalle_ablate.study import topup
from dalle_ablate.study.checks import check_before_running, check_meta
from dalle_ablate.study.children import PastDeadline, call_child, dies_with_this_process
from dalle_ablate.study.clock import Clock, words
from dalle_ablate.study.jobs import Job, Plan, plan_study, stage1_commands, stage1_jobs
from dalle_ablate.study.kept import Kept
from dalle_ablate.study.identity import last_change
from dalle_ablate.study.record import RUNS, STRESS
from dalle_ablate.study.stage2 import check_seeds, run_stage2
from dalle_ablate.study.stress_runs import StressOutcome, run_stress
from dalle_ablate.train.meta import git_commit


# The code a study's page is written by: its commit is the page's (a page read from a record is the
# same from every clone of a later commit that did not change it).
PAGE_CODE = ("dalle_ablate/report", "dalle_ablate/study", "dalle_ablate/metrics.py", "dalle_ablate/evaluate")


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
    record: Optional[str] = None,
    time_limit: Optional[float] = None,
) -> None:
    """Run a study's arms and seeds (its multirun preset; runs that finished are left as they are,
    a stopped one continues from its checkpoint) and its stress runs, then write its report and
    its results page. `study_arg` is a study's name or its file; `seeds` tops it up (N or 'auto');
    `members`: each arm's seeds trained as members of one job (False: one job per seed); `again`:
    the command, for the line a Ctrl-C ends the study with (which continues all of it); `record`:
    the study's record (study/kept.py), which it continues from and its page is read from;
    `time_limit`: seconds, after which no job starts and a running one is stopped (study/clock.py)."""
    study_file = Path(study_arg) if study_arg.endswith((".yaml", ".yml")) else study_path(study_arg)
    study = load_study(study_file)
    folder = study_folder(out, study.name)
    _check_arguments(study, study_file, seeds, no_run, overrides, record)
    kept = Kept(record, study, study_file, overrides, no_run) if record is not None else None
    seed_override, added = topup.announced(study, folder, seeds, overrides) if seeds is not None else (None, None)
    plan = plan_study(study, folder, overrides, seed_override, members)
    stages = ["while checking it, before anything ran"]
    clock = Clock(time_limit)
    with _one_line_on_ctrl_c(study.name, again, stages):
        if not no_run:  # what its runs would meet, before any of them starts: one line and exit 2
            check_before_running(study, study_file, plan, stress=not no_stress)
        if kept is not None and kept.take(folder):  # the runs of a study already under way
            print(f"record {kept.record}: the finished runs under {shown(folder)} written to it", flush=True)
        clock.costs = kept.costs() if kept is not None else {}
        jobs = stage1_jobs(plan.sweep, study.timed, kept.done(RUNS) if kept is not None else None)
        ran = _train(study, study_file, plan, jobs, added, stages, no_run, no_stress, kept, clock)
        stages.append("while writing its report and page")
        source = kept.inputs() if kept is not None else None
        runs = source.runs if source is not None else _study_runs(study.name, folder, ran.code)
        page = report = None
        if runs:  # a record holds none before its first job ends
            lines = (
                _provenance(study_arg, seeds, plan, jobs[0], runs, ran, no_run)
                if kept is None
                else _record_provenance(study, kept, runs, members)
            )
            lines += _how_they_trained(study, runs)
            report = _report(folder, report_out, study, kept)
            interrupts.check()
            page = write_page(study, source or str(folder), Path(page_out), lines, study_file=study_file)
    if page is not None:
        print(f"wrote {f'{report}/index.html and ' if report else ''}{page}")
    _ending(study, ran, kept, clock, again)
    if page is None and no_run:  # nothing asked to train: the record given is not one of a study under way
        raise ConfigError(f"--record {kept.record}: holds no runs yet, so there is no page to write; drop --no-run")
    if page is None:
        raise RunFailed(f"study {study.name}: its record {kept.record} holds no runs yet; no page", ran.code or 4)


def _provenance(study_arg, seeds, plan: Plan, first: Job, runs, ran, no_run) -> list[str]:
    """A page's provenance from its study folder: this invocation's command and time, and its first job."""
    stress_line = ran.stress.line if ran.stress is not None else None
    command = first.command(plan.experiment, plan.folder)
    return provenance(study_arg, seeds, list(plan.overrides), command, runs, ran.elapsed, not no_run, stress_line)


def _record_provenance(study: Study, kept: Kept, runs: list[Run], members: bool) -> list[str]:
    """A page's provenance from its record: the same lines from every invocation and clone -- the
    declared study's command (its overrides and stage 1's seeds, the default folder), not this one's."""
    p = kept.declared["protocol"]
    declared = [*p["overrides"], f"seed={','.join(map(str, p['seeds']))}"]
    swept = [*declared, f"+arm={','.join(p['arms'])}"]
    first = stage1_commands(study, Path("studies") / study.name, swept, members)[0]
    record = str(kept.record)
    if not is_url(record) and (Path(record) / "README.md").is_file():  # a record's own account, kept beside it
        record += " (its README.md says how its runs were trained and checked)"
    return provenance(study.name, None, declared, first, runs, 0.0, False, None, record)


def _report(folder: Path, report_out: str, study: Study, kept: Optional[Kept]) -> Optional[str]:
    """The study's HTML report, from its run stores. A study kept in a record reads its page from
    the record, and this machine may hold a part of its stores (one arm, or none): the report is
    left out then, with a line that says why."""
    if kept is not None:
        try:
            here = {s.parent.name for s in find_stores(str(folder))}
        except ConfigError:
            here = set()
        if not kept.done(RUNS) <= here:
            print(
                f"no HTML report: {len(kept.done(RUNS) - here)} of the record's runs have no run store on this "
                "machine (the report reads run stores); the page is read from the record"
            )
            return None
    try:
        return build_report(str(folder), report_out, study.name, study.baseline, transition=study.transition)
    except ConfigError as e:
        if kept is None:
            raise
        print(f"no HTML report ({e}); the page is read from the record")  # e.g. the record holds one arm so far
        return None


def _ending(study: Study, ran: "_Trained", kept, clock: Clock, again: str) -> None:
    """The study's exit: a failed job's code, a failed stress run, or the time limit's line."""
    if ran.code:
        raise RunFailed(
            f"study {study.name}: the multirun exited with {ran.code}; the page shows the runs that finished", ran.code
        )
    if ran.stress is not None and ran.stress.failed:
        raise RunFailed(f"study {study.name}: stress runs failed (not diverged): {', '.join(ran.stress.failed)}")
    if clock.left_out or ran.past_deadline:
        left = ([ran.past_deadline] if ran.past_deadline else []) + clock.left_out
        kept_where = (
            f"its record {kept.record} holds every run that finished" if kept else "the runs that finished are kept"
        )
        raise RunFailed(
            f"study {study.name} stopped at its time limit ({words(clock.limit)}, {words(clock.used())} used); "
            f"{kept_where}; left: {'; '.join(left)}; continue with: {again or 'the same command'}",
            RunFailed.TIME_LIMIT,
        )


def _check_arguments(
    study: Study, study_file: Path, seeds: Optional[str], no_run: bool, overrides: list[str], record: Optional[str]
) -> None:
    """The study command's flags against each other and the study file, before anything runs."""
    if seeds is not None and no_run:
        raise ConfigError("--seeds runs the added seeds; it cannot go with --no-run")
    if seeds is not None and study.stages is not None:
        raise ConfigError(
            f"study {study.name} declares its stages (stages: in {study_file}): stage 2's seeds come from its "
            "rule, not from --seeds; rerun without --seeds"
        )
    if seeds is not None and record is not None:
        raise ConfigError(
            "--seeds tops a study up past its declaration; a study kept in a --record runs the seeds it declared "
            "(declare stages: for more, before stage 1)"
        )
    check_seeds(study, overrides)


@dataclasses.dataclass
class _Trained:
    code: int  # the exit code of the first job that failed, else 0
    stress: Optional[StressOutcome]  # None where the stress runs did not run (or the study has none)
    elapsed: float  # seconds, from the first job's start to the last one's end
    past_deadline: str = ""  # the job the time limit stopped, in words


def _train(
    study: Study,
    study_file: Path,
    plan: Plan,
    jobs: list[Job],
    added: Optional[dict],
    stages: list[str],
    no_run: bool,
    no_stress: bool,
    kept=None,
    clock: Optional[Clock] = None,
) -> _Trained:
    """The study's jobs in their declared order, each a child process: stage 1 (`jobs`, up to the
    first that fails; a top-up's log entry, `added`, written once they are all in), its stress runs
    (skipped only after a stage-1 job refused its config, exit 2), then its stage 2 (a staged study's,
    planned from both, only where everything before it succeeded); `stages` gets the name of each
    part as it starts (for the line a Ctrl-C ends with). A study `kept` in a record writes each
    job's finished runs to it as the job ends; `clock`: its time limit (none started past it)."""
    t = time.perf_counter()
    clock = clock or Clock(None)
    folder = plan.folder
    preexec = dies_with_this_process()
    after = (lambda: kept.take(folder)) if kept is not None else (lambda: None)
    stages.append("during its runs (the multirun of its arms)")
    code = 0
    try:
        code = _stage1(plan, jobs if not no_run else [], preexec, kept, clock, after)
        if added is not None and code == 0:  # logged once its runs are in: a failed top-up is no top-up
            topup.log_topup(folder, added)
        stages.append("during its stress runs")  # not after a multirun that refused its config (exit 2)
        done = frozenset(kept.done(STRESS)) if kept is not None else frozenset()
        stress = (
            None
            if no_run or no_stress or code == 2
            else run_stress(
                study_file,
                plan.experiment,
                folder,
                list(plan.overrides),
                plan.env,
                preexec,
                plan.members,
                done,
                clock,
                after,
            )
        )
        if study.stages is not None and not no_run and code == 0 and not (stress is not None and stress.failed):
            stages.append("during its stage 2")
            waiting = [] if kept is None or kept.stages() is not None else kept.waiting()
            if clock.left_out:  # stage 2 plans from every stage-1 and stress run
                clock.left_out.append("stage 2 (planned once stage 1 and the stress runs are in)")
            elif waiting:
                print(f"stage 2 of study {study.name} waits for its record's {' and '.join(waiting)}", flush=True)
            else:
                state = None if kept is None else kept.stage2_state()
                code = run_stage2(study, study_file, plan, preexec, state, clock, after)
    except PastDeadline:
        stopped = (
            f"{clock.current}, stopped at the limit (its runs continue from their last checkpoints), and every "
            "job after it"
        )
        return _Trained(code, None, time.perf_counter() - t, stopped)
    return _Trained(code, stress, time.perf_counter() - t)


def _stage1(plan: Plan, jobs: list[Job], preexec, kept, clock: Clock, after) -> int:
    """Stage 1's jobs in turn, up to the first that fails (its exit code, else 0)."""
    for job in jobs:
        arms, seeds = list(job.arms), job.seeds or ("its seed",)
        if not clock.fits(
            "runs", arms, len(seeds), f"stage 1's job of {', '.join(arms)} on seeds {', '.join(map(str, seeds))}"
        ):
            continue
        if kept is not None:
            kept.freeze()  # stage 1 starts: the declaration is frozen before its first job
        try:
            code = call_child(job.command(plan.experiment, plan.folder), plan.env, preexec, deadline=clock.deadline)
        finally:
            after()
        if code:
            return code
    return 0


def _how_they_trained(study: Study, runs: list[Run]) -> list[str]:
    """The provenance's lines on how the runs shared the machine: members of one job, timed arms."""
    lines = []
    if any(r.meta.get("members") for r in runs):
        lines.append(
            f"{sum(bool(r.meta.get('members')) for r in runs)} of the runs were trained as members of one job "
            "per arm (seeds=[...], docs/guides/members.md): each in its separate run's folder, with its "
            "overrides and its numbers; their step time is their share of the job's."
        )
    if study.timed:
        lines.append(
            f"The arms its file times ({', '.join(study.timed)}) trained as jobs of their own, interleaved seed by "
            "seed (each seed's runs of them one after another): their step times are one measurement per seed."
        )
    return lines


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


def _study_runs(name: str, folder: Path, code: int) -> list:
    """The study's run stores, each readable and saying which arm it is (its meta.json)."""
    try:
        find_stores(str(folder))
    except ConfigError:
        raise RunFailed(f"study {name}: no runs under {folder} (the multirun exited with {code})", code or 4) from None
    runs = load_runs(str(folder))  # a torn or unreadable file of a run store: named in one line
    for r in runs:
        check_meta(r.root)
    return runs


def provenance(
    study_arg: str,
    seeds: Optional[str],
    overrides: list[str],
    command: list[str],
    runs: list[Run],
    elapsed: float,
    ran: bool,
    stress_line: Optional[str] = None,
    record: Optional[str] = None,
) -> list[str]:
    """The page's provenance lines (`dalle-ablate study`): the command as typed (`study_arg`, the
    `--seeds` given, the `overrides`) and the multirun `command` it ran; the commit of this page
    and those the runs were trained at, each with its run count (a study resumed across commits
    names them all); the runs, how many finished and their wall time added up (load.machine_time); what this
    invocation took (`elapsed` seconds; `ran` False: --no-run, nothing ran); and the stress
    runs' line, if any."""
    import shlex
    from collections import Counter

    summaries = [r.summary for r in runs]
    commit = git_commit()
    trained = Counter(
        f"{m['git'].get('commit') or 'unknown'}{' + uncommitted changes' if m['git'].get('dirty') else ''}"
        for m in (r.meta for r in runs)
        if m.get("git")
    )
    typed = " ".join(
        shlex.quote(a) for a in ["dalle-ablate", "study", study_arg, *(["--seeds", seeds] if seeds else []), *overrides]
    )
    invocation = (
        ""
        if record is not None  # a page read from a record is the same whichever invocation wrote it
        else "; this invocation ran nothing (--no-run)"
        if not ran
        else f"; this invocation took {fmt3(elapsed / 60, 'min')} (runs finished before it are skipped, not repeated)"
    )
    page = (
        f"Read from its record, {record}; the page's code is that of commit {last_change(PAGE_CODE)}"
        if record is not None
        else f"Commit of this page: {commit['commit'] or 'unknown (not run from a git checkout)'}"
        f"{' + uncommitted changes' if commit['dirty'] else ''}"
    )
    lines = [
        f"Command: `{typed}` (runs: `{' '.join(shlex.quote(c) for c in command[1:])}`).",
        f"{page}; runs trained at " + ", ".join(f"{c} ({n} runs)" for c, n in trained.most_common()) + ".",
        f"Runs: {len(summaries)} ({sum(s.get('status') == 'finished' for s in summaries)} finished); their wall "
        f"time adds up to {fmt3(machine_time(runs) / 60, 'min')}"
        f"{' (a job of several members counted once)' if any(r.meta.get('members') for r in runs) else ''}"
        f"{invocation}.",
    ]
    return lines + ([stress_line] if stress_line is not None else [])
