"""What a study's runs would meet, checked before any of them starts: one line and exit 2 instead
of a multirun that stops at its fifth arm, or a run store torn by a kill found after an hour."""

from __future__ import annotations

import difflib
from importlib.resources import files
from pathlib import Path

from dalle_ablate.registry import ConfigError
from dalle_ablate.report.study_file import Study, load_stress, stress_folder
from dalle_ablate.report.load import find_stores, load_run, read_json
from dalle_ablate.study.jobs import Job, Plan
from dalle_ablate.study.stress_runs import job_command
from dalle_ablate.track.runstore import settled


def known_arms() -> list[str]:
    """The arms a study can run: the options of the `arm` config group (dalle_ablate/conf/arm/)."""
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


def multirun_jobs(experiment: str, sweep: Job) -> list[list[str]]:
    """One override list per arm of the study's multirun `sweep` (each other swept key at its first
    value): what composing its jobs needs to meet every arm and every override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(sweep.tail())
    arms = sweep.arms
    # Hydra's own settings (hydra.*, hydra/launcher=) shape how jobs run, not what a job composes
    fixed = [
        (o.input_line.split(o.key_or_group)[0] + f"{o.key_or_group}={next(iter(o.sweep_iterator()))}")
        if o.is_sweep_override()
        else o.input_line
        for o in parsed
        if o.key_or_group != "arm" and not o.key_or_group.startswith("hydra")
    ]
    return [[f"experiment={experiment}", *fixed, f"+arm={a}"] for a in arms] or [[f"experiment={experiment}", *fixed]]


def check_before_running(study: Study, study_file: Path, plan: Plan, stress: bool) -> None:
    """What a study's runs would meet, checked before any starts (ConfigError, one line): every
    arm its file names (baseline, each finding's arm and against) and its command line gives is an
    arm; each arm's job of the multirun composes and passes a run's checks, and so does its stress
    plan, each arm and each rate; and the run stores already there can be read (a file torn by a
    kill is named, as `--no-run` names it). `plan`: the study's (study/jobs.py)."""
    from dalle_ablate.validate import compose, format_error, to_run_config  # here: it loads every option

    arms = known_arms()
    check_arm(f"{study_file}: baseline {study.baseline!r}", study.baseline, arms)
    for f in study.findings:
        check_arm(f"{study_file}: finding {f.id!r} has arm {f.arm!r}", f.arm, arms)
        check_arm(f"{study_file}: finding {f.id!r} has against {f.against!r}", f.against, arms)
    job_lists = multirun_jobs(study.experiment, plan.sweep)
    for job in job_lists:
        if job[-1].startswith("+arm="):
            check_arm(job[-1], job[-1].partition("=")[2], arms)
    for job in job_lists:
        to_run_config(compose(job))
    stressed = load_stress(study_file) if stress else None
    if stressed is not None:  # each arm at one rate, each rate on one arm: nothing else differs between its runs
        probes = {(a, stressed.rates[0]) for a in stressed.arms} | {(stressed.arms[0], lr) for lr in stressed.rates}
        for arm, lr in sorted(probes):
            command = job_command(
                "python", study.experiment, Path("."), arm, lr, stressed.seeds[0], stressed, plan.overrides
            )
            try:
                to_run_config(compose(command[3:-1]))
            except Exception as e:  # noqa: BLE001 - re-raised unless it is a user mistake
                if format_error(e) is None:
                    raise
                raise ConfigError(f"{study_file}: stress run of {arm} at lr {lr:g}: {format_error(e)}") from None
    for where in (plan.folder, stress_folder(plan.folder)):
        _readable_stores(where)


def _readable_stores(folder: Path) -> None:
    """The files under `folder` that the study will read as they are, read now, or a ConfigError
    naming the first that cannot be (torn, corrupt, missing): every file of a run that finished or
    diverged (its run is not started again, and the report reads it), each summary.json and
    meta.json (a resumed run reads them), each members job's members.json. What a resumed run
    repairs itself -- a last metrics line cut off by a kill, its config.yaml -- is left to it."""
    from dalle_ablate.train.records import MEMBERS_FILE

    try:
        stores = find_stores(str(folder))
    except ConfigError:  # none yet
        return
    for store in stores:
        summary = read_json(store / "summary.json") if (store / "summary.json").exists() else {}
        if settled(summary, None):
            load_run(store)
        check_meta(store)
        read_json(store / "meta.json")
    for path in sorted(Path(folder).rglob(MEMBERS_FILE)):
        read_json(path)


def check_meta(store: Path) -> None:
    """A run store's meta.json is there: its overrides say which arm the run is (report/load.py Run.arm)."""
    if not (store / "meta.json").is_file():
        raise ConfigError(
            f"{store / 'meta.json'}: no such file, so the study cannot tell which arm the run is; delete "
            f"{store.parent} and run the study again to train it anew"
        )
