"""The Hydra task function (`run.py`): from the composed config to a training run, and, when the
Optuna sweeper launched the job, the bridge to its trial -- the trainer itself knows nothing of
Optuna: it calls `RunHooks` and reports "pruned", which this module turns into the
`optuna.TrialPruned` the sweeper records."""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below (seconds): a Ctrl-C while they load is taken once they have
    from dalle_ablate import interrupts

    interrupts.install()

import contextlib
import copy
import dataclasses
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dalle_ablate import interrupts
from dalle_ablate.cli import run_hydra
from dalle_ablate.config import member_only, member_record
from dalle_ablate.fileio import (
    check_bucket,
    check_url,
    fetch,
    looks_like_url,
    pull,
    push,
    push_tree,
    shown,
    staged,
    url_of,
)
from dalle_ablate.registry import ConfigError, Interrupted, RunFailed
from dalle_ablate.track.naming import key_of, run_naming

# Importing validate registers every option's schema, which Hydra composes from. The trainer
# (JAX's programs, orbax, the evaluators) is imported when a job runs: `python run.py --help` and a
# mistyped override are answered without it.
from dalle_ablate.validate import to_run_config

if TYPE_CHECKING:
    from dalle_ablate.train.loop import JobInfo


def varying_keys(sweep_dir: Path) -> set[str]:
    """The keys a multirun or sweep varies, from the `multirun.yaml` its sweeper saved: the sweep
    overrides of its command line (`a,b`, `choice`, `range`, `interval`) and its sweeper's params."""
    path = sweep_dir / "multirun.yaml"
    url = url_of(sweep_dir)
    if (
        url is not None
    ):  # a sweep folder in a bucket: uploaded by a job on the sweep's host, read there by one elsewhere
        push(path) if path.exists() else fetch(f"{url}/multirun.yaml", path)
    if not path.exists():
        return set()
    from hydra.core.override_parser.overrides_parser import OverridesParser

    saved = OmegaConf.load(path).hydra
    params = saved.sweeper.get("params") or {}
    texts = [*saved.overrides.task, *(f"{k}={v}" for k, v in params.items())]
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(texts) if o.is_sweep_override()}


def job_info(cfg: DictConfig) -> JobInfo:
    """This job's `train.loop.JobInfo`: its folder and W&B naming, from Hydra."""
    from dalle_ablate.train.loop import JobInfo

    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    name, job_type = run_naming(overrides, varying_keys(Path(hc.sweep.dir)) if multirun else set(), cfg.model.layout)
    return JobInfo(
        job_dir=Path(hc.runtime.output_dir),
        # W&B: group = the multirun (or sweep) folder, name = what this job varies.
        group=hc.sweep.dir if multirun else None,
        name=name,
        job_type=job_type,
        overrides=overrides,
        config=OmegaConf.to_container(cfg, resolve=True),
    )


def member_jobs(cfg: DictConfig, job: JobInfo, seeds: list[int]) -> list[JobInfo]:
    """One JobInfo per member seed k of `seeds=[...]`: what the job `python run.py <the same
    overrides> seed=k` would get -- its folder, overrides, W&B name and job type, group and
    resolved config -- so that a member's run store, meta.json and W&B run cannot be told from
    that separate run's (train/loop.py trains them). `job` is this job's own `job_info(cfg)`;
    called inside the Hydra task (HydraConfig)."""
    import jax

    from dalle_ablate.train.loop import JobInfo
    from dalle_ablate.train.records import believe_the_stores, recorded_member_dirs

    hc = HydraConfig.get()
    seeds = list(seeds)
    typed = OmegaConf.to_object(cfg)  # the RunConfig as composed, for what config.member_config changes
    multirun = hc.mode == RunMode.MULTIRUN
    recorded = recorded_member_dirs(Path(job.job_dir), seeds)
    dirs = recorded or template_member_dirs(cfg, job, seeds)
    # A separate run of the same multirun is named by what it varies, its seed among them; a single
    # run (`python run.py seed=k`) by all its overrides.
    varying = (varying_keys(Path(hc.sweep.dir)) - {"seeds"}) | {"seed"} if multirun else set()
    jobs = []
    for seed, job_dir in zip(seeds, dirs):
        if url_of(job_dir) and not Path(job_dir).is_relative_to(job.job_dir) and cfg.resume == "auto":
            pull(url_of(job_dir))  # a member's folder of its own in the bucket (a template's), as the job's below
        overrides = member_overrides(list(hc.overrides.task), seed)
        config = member_record(job.config, typed, seed)
        name, job_type = run_naming(overrides, varying, config["model"]["layout"])
        jobs.append(
            JobInfo(
                job_dir=job_dir,
                name=name,
                group=job.group,
                job_type=job_type,
                overrides=overrides,
                config=config,
                hooks=job.hooks,
            )
        )
    if cfg.resume == "auto" and recorded and jax.process_index() == 0:  # members.json's own folders, said once
        believe_the_stores(Path(job.job_dir), seeds, dirs)
    return jobs


def template_member_dirs(cfg: DictConfig, job: JobInfo, seeds: list[int]) -> list[Path]:
    """Each member's folder: where Hydra would put the run `seed=k` -- the job's own folder
    template (`hydra.sweep.subdir` in a multirun, `hydra.run.dir` in a single run) resolved again
    with seed=k, as run_job resolves it (study_mega's `<arm>-seed<seed>` gives each member the
    separate run's folder). A template the seed does not change (`${hydra.job.num}`, the default
    timestamp) would give every member the job's own folder: they go under it, `<job dir>/seed<k>`."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    key = "hydra.sweep.subdir" if multirun else "hydra.run.dir"

    def folder(seed: int) -> Path:
        # The task's config with Hydra's node put back (its interpolations, e.g. runtime.choices,
        # point into it) and the seed changed; the copy keeps the resolver cache (`now` as it was).
        probe = copy.deepcopy(cfg)
        with read_write(probe), open_dict(probe):
            probe.hydra = hc
            probe.seed = seed
        path = str(OmegaConf.select(probe, key))
        return Path(os.path.abspath(os.path.join(str(hc.sweep.dir), path) if multirun else path))

    if folder(seeds[0]) == folder(seeds[0] + 1):
        return [Path(job.job_dir) / f"seed{k}" for k in seeds]
    if cfg.seed not in seeds:
        raise ConfigError(
            f"seeds={seeds} leaves out seed={cfg.seed}, and {key} names this job's folder "
            f"{job.job_dir} by its seed: it would hold a run that is not a member; "
            f"pass seed={seeds[0]} (the first of seeds)"
        )
    return [folder(k) for k in seeds]


def member_overrides(overrides: list[str], seed: int) -> list[str]:
    """The override list Hydra records for the separate run: the job's own less `seeds=`,
    `members.*`, `mesh.member=` (a run of its own leaves them unset) and `seed=`, with
    `seed=<seed>` in the place of the job's `seed=` if it has one (where Hydra's sweeper keeps a
    command-line value of a param it sweeps, e.g. study_mega's `seed`), else of its `seeds=` (the
    command with `seeds=[...]` written as `seed=k`), else last."""
    keys = [key_of(o) for o in overrides]
    at = keys.index("seed") if "seed" in keys else keys.index("seeds") if "seeds" in keys else len(keys)
    out = []
    for i, (o, key) in enumerate(zip(overrides, keys)):
        if i == at:
            out.append(f"seed={seed}")
        if key != "seed" and not member_only(key):
            out.append(o)
    return out if at < len(keys) else [*out, f"seed={seed}"]


def tokenizer_first(run_cfg, job: JobInfo) -> None:
    """Stage 1: the built-in data's image tokenizer (e.g. data.tokenizer=dvae) fitted before the
    run, on process 0, in a run store and tracker run of its own (`<job>/tokenizer`) -- unless it
    is cached, or the run ended before (resume=auto leaves it as it is)."""
    import jax

    from dalle_ablate.parallel import compile_cache, distributed
    from dalle_ablate.train.resume import settled_before
    from dalle_ablate.train.tokenizer import closing_lines as tokenizer_lines, tokenizer_cached, train_tokenizer

    distributed.initialize(run_cfg.distributed)  # process 0 alone fits it
    compile_cache.configure(run_cfg.compilation_cache)  # the run's cache, from its first program on
    if (
        run_cfg.data.name != "shapes"
        or jax.process_index() != 0
        or tokenizer_cached(run_cfg.data)
        or settled_before(run_cfg, Path(job.job_dir) / "run") is not None
    ):
        return
    res = train_tokenizer(
        run_cfg,
        Path(job.job_dir) / "tokenizer",
        name=f"{job.name} tokenizer" if job.name else None,
        group=job.group,
        overrides=job.overrides,
    )
    # the cached file as the user named its folder: a bucket's URL, not this host's staging copy
    print(tokenizer_lines(run_cfg, dataclasses.replace(res, path=shown(res.path))), flush=True)


BUCKET_DIRS = ("hydra.run.dir", "hydra.sweep.dir")  # Hydra's folders a command line may give as gs:// URLs
BUCKET_FIELDS = ("data.cache_dir",)  # the job's own folders that may be gs:// URLs, checked before Hydra makes any


def bucket_dirs(argv: list[str]) -> list[str]:
    """The command line with a gs:// URL given as `hydra.run.dir` or `hydra.sweep.dir` replaced by
    its local staging folder (fileio.staged): Hydra makes, and writes its own files into, a local
    folder, and everything this package writes under it goes to the bucket (fileio). A malformed
    URL there or in `BUCKET_FIELDS` is refused before Hydra makes any folder."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        value = value.strip("'\"")
        if eq and key in BUCKET_DIRS and looks_like_url(value):  # `gs:/b/x` too: refused, not made a local folder
            arg = f"{key}={staged(check_url(value, key))}"
        elif eq and key in BUCKET_FIELDS and looks_like_url(value):  # refused before the job's folder is made
            check_url(value, key)
        out.append(arg)
    return out


@contextlib.contextmanager
def from_bucket(run_cfg, job_dir: Path):
    """Around a job whose folder is staged from a bucket: the job folder's writer's lock is taken
    first (track/runstore.py StoreLock, on process 0: a flock in the staging folder and a leased
    object in the bucket), before anything is pulled or pushed -- a second writer of the same job
    is refused having changed nothing, here or in the bucket. Then, with `resume=auto`, its folder
    is made the bucket's copy (a resume on another host, or after a kill: the bucket is what is
    kept), and Hydra's own record of the job (`.hydra/`) goes to the bucket. The lock is held
    until the job ends (each run store it writes has its own lock too, train/loop.py)."""
    url = url_of(job_dir)
    if url is None:
        yield
        return
    import jax

    from dalle_ablate.parallel import distributed
    from dalle_ablate.track.runstore import StoreLock

    check_bucket(url)  # one line now for a bucket that is not there, before anything is built
    distributed.initialize(run_cfg.distributed)  # which process this is: process 0 alone writes
    with StoreLock(job_dir, what="job folder") if jax.process_index() == 0 else contextlib.nullcontext():
        if run_cfg.resume == "auto":
            pull(url, keep=tuple(p.name for p in job_dir.iterdir() if p.name == ".hydra" or p.suffix == ".log"))
        push_tree(job_dir / ".hydra")
        yield


def resume_command(job: JobInfo, trial: bool) -> str:
    """The command that continues this job: the job itself (`resume=auto` in its folder) -- or,
    in a multirun, all of it, the jobs not started yet included: the same command line in the
    same sweep folder, where `resume=auto` leaves each finished job as it is and continues a
    stopped one. An Optuna sweep resumes from its study (in the same folder) as it is."""
    hc = HydraConfig.get() if HydraConfig.initialized() else None
    if hc is None or hc.mode != RunMode.MULTIRUN:
        kept = [o for o in job.overrides if not o.startswith(("resume=", "optuna."))]  # resumed as a run of its own
        return "python run.py " + shlex.join([*kept, "resume=auto", f"hydra.run.dir={shown(job.job_dir)}"])
    given = [a for a in sys.argv[1:] if key_of(a) not in ("resume", "hydra.sweep.dir")]
    return "python run.py " + shlex.join(
        [*given, *([] if trial else ["resume=auto"]), f"hydra.sweep.dir={shown(os.path.abspath(hc.sweep.dir))}"]
    )


def overdue(job: JobInfo, trial: bool) -> str:
    """The line of a job the SIGTERM watchdog ends (interrupts.watchdog): its stop's writes stuck."""
    return (
        f"{interrupts.word()}: what its stop writes to {shown(job.job_dir)} did not end within the "
        f"{interrupts.grace_s():.0f} s grace period (a bucket that does not answer); the checkpoints finished "
        f"before it are intact; resume with: {resume_command(job, trial)}"
    )


def interrupted(job: JobInfo, trial: bool, what: str, kept: str) -> Interrupted:
    """The one line a Ctrl-C (or SIGTERM: "terminated (SIGTERM)", interrupts.word) ends the job
    with: what it stopped, what was kept, how to continue."""
    return Interrupted(f"{interrupts.word()} {what}; {kept}; resume with: {resume_command(job, trial)}")


def run(cfg: DictConfig) -> float | list[float]:
    # Hydra logs at INFO; JAX's note that no TPU/GPU backend was found would bury the progress
    # bar. orbax logs through absl: its per-save chatter, and a failed save once per thread with a
    # traceback, which the Checkpointer reports in one line instead (train/checkpoint.py).
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    logging.getLogger("fsspec").setLevel(
        logging.WARNING
    )  # its read-ahead cache's INFO line per file read from a bucket
    # A log file that can no longer be written (the job folder made read-only mid-run) is for the
    # run store's one line to report, not a traceback for each record logged.
    logging.raiseExceptions = False
    for handler in logging.getLogger().handlers:  # the console, not the job's log file (a FileHandler)
        if type(handler) is logging.StreamHandler and not any(isinstance(f, OwnRecords) for f in handler.filters):
            handler.addFilter(OwnRecords())
    try:
        interrupts.grace_s()  # a malformed grace period is found now, not when a SIGTERM comes
    except ValueError as e:
        raise ConfigError(str(e)) from None
    job = job_info(cfg)
    trial = OmegaConf.select(cfg, "optuna.trial") is not None
    num = HydraConfig.get().job.get("num") or 0
    try:
        with interrupts.watchdog(lambda: overdue(job, trial)):
            # a Ctrl-C between the jobs of a multirun, or while Hydra composed this one's config
            interrupts.check(
                f"before job {num} of the multirun started" if job.group is not None and num else "while starting"
            )
            from dalle_ablate.train.loop import train, train_members

            run_cfg = to_run_config(cfg)
            with from_bucket(run_cfg, Path(job.job_dir)):
                if trial:
                    from dalle_ablate.sweep.trial import TrialHooks

                    job.hooks = TrialHooks(run_cfg.optuna, run_cfg.seeds)
                tokenizer_first(run_cfg, job)
                if run_cfg.seeds:
                    results = train_members(run_cfg, job, member_jobs(cfg, job, run_cfg.seeds))
                else:
                    results = [train(run_cfg, job)]
    except Interrupted:
        raise
    except KeyboardInterrupt as e:  # before the first step: nothing trained to save
        raise interrupted(job, trial, interrupts.stage_of(e, "while starting"), "no step trained") from None
    except RunFailed as e:
        if interrupts.word() != interrupts.TERMINATED or e.exit_code != RunFailed.FAILED:
            raise
        # A SIGTERM's stop whose writes failed (a bucket gone, given up at the grace period's end):
        # still the signal's stop and exit code, its line naming both (the store says the same)
        from dalle_ablate.train.checkpoint import abandon_saves

        abandon_saves()
        raise Interrupted(f"{interrupts.word()}: {e}; resume with: {resume_command(job, trial)}") from None
    return outcome(run_cfg, job, results, trial)


def outcome(run_cfg, job: JobInfo, results: list, trial: bool = False) -> float | list[float]:
    """What a job ends with, from its runs' Results (a plain run's one, or each member's of
    `seeds=[...]`): Ctrl-C's line with the command that resumes it, a pruned trial, one line
    naming each run that diverged (exit 3; its run store says where), or the objectives -- a
    members job's the mean over its members (each member's own value is in its run store), a
    sweep trial's the sweeper's statistic of them (sweep/trial.py)."""
    members = run_cfg.seeds is not None
    named = list(zip(run_cfg.seeds if members else [run_cfg.seed], results))
    stopped = [(s, r) for s, r in named if r.status == "interrupted"]
    if stopped:
        what = stopped[0][1].reason.removeprefix(f"{interrupts.word()} ")
        if members:
            what += f" (members {', '.join(f'seed={s}' for s, _ in stopped)})"
        raise interrupted(job, trial, what, kept(stopped[0][1], plural=members))
    pruned = [r for r in results if r.status == "pruned"]
    if pruned:
        import optuna

        raise optuna.TrialPruned(pruned[0].reason)
    failed = [(s, r) for s, r in named if r.status != "finished"]
    if failed:
        # Not a value: the process exits non-zero (cli.run_hydra), a sweep records a FAILED trial.
        ok = [str(s) for s, r in named if r.status == "finished"]
        raise RunFailed(
            "; ".join(
                f"{f'member seed={s}' if members else f'{job.name}:'} {r.reason} (run store {shown(r.run_dir)})"
                for s, r in failed
            )
            + (f"; seeds {', '.join(ok)} finished" if ok else ""),
            RunFailed.DIVERGED,
        )
    import numpy as np

    table = np.array([[float(r.summary[k]) for k in run_cfg.objectives] for r in results])  # [member, objective]
    if trial and members:
        from dalle_ablate.sweep.trial import trial_value

        values = trial_value(run_cfg.optuna, list(run_cfg.seeds), table, list(run_cfg.objectives))
    else:
        values = table.mean(axis=0)
    return float(values[0]) if len(values) == 1 else [float(v) for v in values]


def kept(result, plural: bool = False) -> str:
    """What an interrupted run kept: a checkpoint of its last step (each member's: `plural`), or
    the one it started from."""
    return (
        f"checkpoint{'s' * plural} saved"
        if result.saved
        else f"its checkpoint of step {result.steps} kept"
        if result.steps
        else "no step trained"
    )


class OwnRecords(logging.Filter):
    """The job's console (`run`: the root logger's stream handlers, whichever `hydra/job_logging`
    made them; its file handler keeps every record): the project's and Hydra's records only. A library's -- gcsfs's traceback for each request to a bucket that is gone, aiohttp's,
    optuna's -- goes to the job's log file alone; what went wrong reaches the terminal as the
    project's one line, naming the library's error as its reason."""

    OWN = ("dalle_ablate", "hydra", "__main__", "root")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".", 1)[0] in self.OWN


class ReportHint(Callback):
    """At the end of a multirun or sweep (conf/config.yaml `hydra.callbacks`): its folder, and the
    command that compares its runs."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        folder = shown(config.hydra.sweep.dir)
        print(f"multirun finished: {folder}; compare its runs with: dalle-ablate report {shlex.quote(str(folder))}")


# The configs are the package's own (dalle_ablate/conf), found beside this module from a checkout
# and from an installed wheel alike.
_hydra_main = hydra.main(version_base="1.3", config_path="conf", config_name="config")(run)


def main() -> object:
    """`python run.py [overrides]`: Hydra's main, its folders in a bucket staged (bucket_dirs)."""
    sys.argv[1:] = bucket_dirs(sys.argv[1:])
    return _hydra_main()


if __name__ == "__main__":
    run_hydra(main)
