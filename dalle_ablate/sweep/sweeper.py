"""The project's Optuna sweeper for Hydra (`hydra/sweeper=optuna`), on optuna 5 through its
ask-and-tell interface: the search space comes from the overrides (space.py), trials run as
Hydra jobs through whatever launcher is configured (basic, joblib, or a cluster's: launch/), and
their returns are told back. Unlike the official plugin (optuna < 3): trials are counted across
resumes and across processes sharing the study, a job that raises or returns NaN is a FAILED
trial and the sweep goes on, jobs can be pruned (trial.py), a trial whose process died (found by
its pid at once on its own host, by its heartbeat elsewhere, or lost by a cluster launcher) is
replaced (or retried from its checkpoint), and a seeded sampler draws new points in every process
that joins the study."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from dalle_ablate.fileio import is_url, push
from dalle_ablate.launch.jobs import WorkerLost
from dalle_ablate.registry import ConfigError
from dalle_ablate.sweep import recheck as rechecks
from dalle_ablate.sweep import space as spaces
from dalle_ablate.sweep.results import short_params, values_text, write_results
from dalle_ablate.sweep.recovery import LOCAL_LAUNCHERS, OWNER_ATTR, STALE_ATTR, STOPPED_ATTR, Recovery, this_process
from dalle_ablate.sweep.optuna_study import (
    NEEDS_SPREAD,
    PRUNER_ATTR,
    STARTS_ATTR,
    STATISTICS,
    default_storage,
    heartbeats,
    make_pruner,
    make_sampler,
    sampler_seed,
    storage,
    trial_lock,
)

log = logging.getLogger(__name__)
# optuna's own INFO lines ("A new study created in RDB", "Trial 3 finished with value ...") on
# stderr beside the sweeper's: the sweeper says what a trial did, once, in its own words
optuna.logging.set_verbosity(optuna.logging.WARNING)


def quiet_optuna() -> None:
    """Heartbeats (RDBStorage's heartbeat_interval, fail_stale_trials, the retry callback) have
    carried optuna's "experimental" label since v2.9, and a heartbeat outside `Study.optimize`
    (ask-and-tell, as here) draws a UserWarning: each would print at every sweep start. Set when
    the sweeper is made, not at import: Hydra imports its plugins inside `warnings.catch_warnings`,
    which drops a filter set then."""
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


@dataclass
class SamplerConf:
    name: str = "tpe"  # tpe, random, cmaes, grid, nsgaii
    seed: Optional[int] = None
    kwargs: dict = field(default_factory=dict)  # passed to the optuna sampler, e.g. {n_startup_trials: 5}


@dataclass
class PrunerConf:
    name: str = "none"  # none, median, percentile, hyperband, successive_halving, threshold
    kwargs: dict = field(default_factory=dict)  # e.g. {n_startup_trials: 3, n_warmup_steps: 100}


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.dalle_ablate_sweeper.optuna_sweeper.OptunaSweeper"
    study_name: str = "dalle-ablate"
    storage: Optional[str] = None  # SQLAlchemy URL; null = sqlite:///<sweep dir>/optuna.db
    direction: Any = "minimize"  # or a list, one per value the job returns (multi-objective)
    n_trials: int = 20  # the study's total, counted across resumes and processes
    n_jobs: int = 1  # trials asked for and launched at once (parallel with hydra/launcher=joblib)
    sampler: SamplerConf = field(default_factory=SamplerConf)
    pruner: PrunerConf = field(default_factory=PrunerConf)
    params: dict = field(default_factory=dict)  # name -> search space, as on the command line
    # A running trial's heartbeat; one older than the grace period (null = 2 intervals) means its
    # process died: the next sweep start marks it FAILED and runs another trial in its place.
    heartbeat_interval: int = 60
    grace_period: Optional[int] = None
    retry_failed: int = 0  # run such a trial again (same parameters, from its last checkpoint), up to N times
    # Seeds per trial (`seeds=[0,1,2]` on the command line: each trial trains them as members of one job):
    statistic: str = "mean"  # a trial's value over its members: mean, median, upper or lower (one-sided 90 % t bound)
    # every trial on the same seeds (paired); false: trial i on seeds shifted by i * len(seeds)
    common_seeds: bool = True
    recheck: rechecks.RecheckConf = field(default_factory=rechecks.RecheckConf)  # the best trials again on fresh seeds


def outcome(ret: JobReturn, n_objectives: int) -> tuple[optuna.trial.TrialState, Optional[list[float]], str]:
    """(state, values, why) of a finished job."""
    if ret.status == JobStatus.FAILED:
        exc = ret._return_value
        if isinstance(exc, optuna.TrialPruned):
            return optuna.trial.TrialState.PRUNED, None, str(exc)
        return optuna.trial.TrialState.FAIL, None, f"raised {type(exc).__name__}: {exc}"
    value = ret.return_value
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        return optuna.trial.TrialState.FAIL, None, f"returned {value!r}, not numbers"
    if len(values) != n_objectives:
        return optuna.trial.TrialState.FAIL, None, f"returned {len(values)} values for {n_objectives} directions"
    if not all(math.isfinite(v) for v in values):
        return optuna.trial.TrialState.FAIL, None, f"returned {values} (not finite)"
    return optuna.trial.TrialState.COMPLETE, values, ""


def directions(direction: Any) -> list[str]:
    """hydra.sweeper.direction as a list of one direction per objective, each checked."""
    out = (
        [str(d) for d in direction]
        if isinstance(direction, (list, tuple)) or OmegaConf.is_list(direction)
        else [str(direction)]
    )
    bad = [d for d in out if d not in ("minimize", "maximize")]
    if bad:
        raise ConfigError(f"hydra.sweeper.direction has {bad}; valid: minimize, maximize (or a list of them)")
    return out


def check_counts(n_trials: int, n_jobs: int, heartbeat_interval: int, grace_period, retry_failed: int) -> None:
    if n_trials < 1 or n_jobs < 1:
        raise ConfigError(f"hydra.sweeper.n_trials={n_trials} and hydra.sweeper.n_jobs={n_jobs} must be >= 1")
    if heartbeat_interval < 1 or (grace_period is not None and grace_period <= heartbeat_interval) or retry_failed < 0:
        raise ConfigError(
            f"hydra.sweeper.heartbeat_interval={heartbeat_interval} must be >= 1, hydra.sweeper.grace_period="
            f"{grace_period} longer than it (or null), hydra.sweeper.retry_failed={retry_failed} >= 0"
        )


def recheck_conf(recheck, directions: list[str]) -> rechecks.RecheckConf:
    """hydra.sweeper.recheck as its dataclass, checked against the sweep's objectives."""
    conf = rechecks.RecheckConf(
        **(OmegaConf.to_container(recheck, resolve=True) if OmegaConf.is_config(recheck) else dict(recheck or {}))
    )
    if conf.top == 1 or conf.top < 0:
        raise ConfigError(
            f"hydra.sweeper.recheck.top={conf.top}: 0 (no re-check) or the best N >= 2 trials "
            "(the best is judged against the others)"
        )
    if conf.top and len(directions) > 1:
        raise ConfigError(
            "hydra.sweeper.recheck.top needs one objective: a Pareto front has no single best to re-check"
        )
    if conf.stages is not None:  # the declared design checked before the sweep's first trial
        if not conf.top:
            raise ConfigError("hydra.sweeper.recheck.stages needs hydra.sweeper.recheck.top: the trials it re-checks")
        from dalle_ablate.report.study_file import stages_from

        stages_from(conf.stages, "hydra.sweeper.recheck")
    return conf


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        study_name: str,
        storage: Optional[str],
        direction: Any,
        n_trials: int,
        n_jobs: int,
        sampler: DictConfig,
        pruner: DictConfig,
        params: DictConfig,
        heartbeat_interval: int = 60,
        grace_period: Optional[int] = None,
        retry_failed: int = 0,
        statistic: str = "mean",
        common_seeds: bool = True,
        recheck: Optional[DictConfig] = None,
    ):
        self.study_name, self.storage_url = study_name, storage
        self.directions = directions(direction)
        check_counts(n_trials, n_jobs, heartbeat_interval, grace_period, retry_failed)
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.sampler_conf = (
            OmegaConf.to_container(sampler, resolve=True) if OmegaConf.is_config(sampler) else dict(sampler)
        )
        self.pruner_conf = OmegaConf.to_container(pruner, resolve=True) if OmegaConf.is_config(pruner) else dict(pruner)
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period or 2 * heartbeat_interval
        self.recovery = Recovery(
            self.grace_period,
            optuna.storages.RetryFailedTrialCallback(max_retry=retry_failed) if retry_failed else None,
        )
        STATISTICS.get(statistic)  # a name it does not know: one line naming hydra.sweeper.statistic
        self.statistic, self.common_seeds = statistic, common_seeds
        self.recheck = recheck_conf(recheck, self.directions)
        self.process = this_process()
        quiet_optuna()

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.process["local"] = type(self.launcher).__name__ in LOCAL_LAUNCHERS
        self.objectives = [str(o) for o in config.get("objectives", [])]  # what the jobs return (RunConfig.objectives)
        seeds = config.get("seeds")
        self.seeds = [int(k) for k in seeds] if seeds is not None else None  # each trial's members, as given
        if self.recheck.top and is_url(str(config.hydra.sweep.dir)):
            raise ConfigError(
                "hydra.sweeper.recheck.top with a sweep folder in a bucket is not supported: the "
                "re-check reads its jobs' members from local folders; re-check from a local sweep folder"
            )
        if self.statistic in NEEDS_SPREAD and (self.seeds is None or len(self.seeds) < 2):
            raise ConfigError(
                f"hydra.sweeper.statistic={self.statistic} is a bound on the members' mean: give each trial "
                f"at least 2 seeds (seeds=[0,1,2]), or hydra.sweeper.statistic=mean"
            )

    def study(self, space) -> tuple[optuna.Study, str]:
        url = self.storage_url or default_storage(self.sweep_dir)
        pruner_spec = {"name": self.pruner_conf.get("name", "none"), **(self.pruner_conf.get("kwargs") or {})}
        with trial_lock(url, self.study_name):  # processes starting together: one creates the tables and the study
            store = storage(url, self.heartbeat_interval, self.grace_period, self.recovery.stale)
            study = optuna.create_study(
                storage=store,
                study_name=self.study_name,
                directions=self.directions,
                pruner=make_pruner(pruner_spec),
                load_if_exists=True,
            )
            start = study.user_attrs.get(STARTS_ATTR, 0)
            study.set_user_attr(STARTS_ATTR, start + 1)
        seed = sampler_seed(self.sampler_conf.get("seed"), start)
        study.sampler = make_sampler(
            self.sampler_conf.get("name", "tpe"), seed, space, self.sampler_conf.get("kwargs") or {}
        )
        have = [d.name.lower() for d in study.directions]
        if have != self.directions:
            raise ConfigError(
                f"hydra.sweeper.direction={self.directions} but study {self.study_name!r} in {url} was "
                f"created with {have}; use another hydra.sweeper.study_name"
            )
        study.set_user_attr(PRUNER_ATTR, pruner_spec)
        if len(self.objectives) == len(self.directions):
            study.set_metric_names(self.objectives)  # optuna-dashboard's axes name the metric
        return study, url

    def sweep(self, arguments: list[str]) -> list[optuna.trial.FrozenTrial]:
        space = spaces.parse(arguments, self.params)
        if not space.distributions:
            raise ConfigError(
                "hydra/sweeper=optuna has nothing to search: give interval(...), choice(...) or range(...) "
                "overrides, or hydra.sweeper.params"
            )
        n_trials = self.n_trials
        if self.sampler_conf.get("name") == "grid":
            size = math.prod(len(v) for v in space.grid().values())
            n_trials = min(n_trials, size)  # every point once; more would repeat points
        study, url = self.study(space)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")  # as Hydra's sweepers do: jobs read what varies
        push(self.sweep_dir / "multirun.yaml")  # a sweep folder in a bucket: there for trials on other hosts
        log.info(
            f"Optuna study {self.study_name!r} in {url}: {n_trials} trials in all, sampler "
            f"{self.sampler_conf.get('name')}, pruner {self.pruner_conf.get('name')}"
        )
        warned = False
        while True:
            with trial_lock(url, self.study_name) as locked:
                if not locked and not warned:
                    warned = True
                    log.warning(
                        f"no trial lock for {url.split(':')[0]} storage: processes sharing this study may run more "
                        f"than n_trials={n_trials} trials"
                    )
                self.recovery.fail_gone(study)  # trials whose sweep process on this host is gone: at once
                optuna.storages.fail_stale_trials(study)  # trials of processes that died (recovery.stale)
                died = study.user_attrs.get(STALE_ATTR, {})  # read from the storage: other processes add to it
                stopped = study.user_attrs.get(STOPPED_ATTR, {})
                asked = study.get_trials(
                    deepcopy=False, states=[s for s in optuna.trial.TrialState if s.name != "WAITING"]
                )
                done = len(asked) - len(died) - len(stopped)  # a WAITING trial (a retry) is yet to be asked
                trials = [study.ask(space.distributions) for _ in range(min(self.n_jobs, n_trials - done))]
                for trial in trials:
                    trial.set_user_attr(OWNER_ATTR, self.process)
            if not trials:
                break
            batch = [
                space.overrides(t.params)
                + self.recovery.resume(study, t)
                + self._seeds(t.number)
                + [f"optuna.storage='{url}'", f"optuna.study='{self.study_name}'", f"optuna.trial={t.number}"]
                for t in trials
            ]
            try:
                self.validate_batch_is_legal(batch)
                with heartbeats(study._storage, [t._trial_id for t in trials], self.heartbeat_interval):
                    returns = self.launcher.launch(batch, initial_job_idx=trials[0].number)
            except BaseException as e:  # a bad override, Ctrl-C, SIGTERM: never leave the asked trials RUNNING
                why = f"sweep stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                for trial in trials:
                    trial.set_user_attr("why", why)
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    if isinstance(e, KeyboardInterrupt):  # its job saved its last step: continued on resume
                        self.recovery.requeue(study, study._storage.get_trial(trial._trial_id), why)
                raise
            self._tell(study, trials, returns)
        recheck = None
        try:
            recheck = self._recheck(study, space)
        finally:  # the sweep's own results, also when its re-check fails or is interrupted
            write_results(study, self.sweep_dir, self.directions, self.objectives, self.statistic, recheck)
        return study.get_trials()

    def _tell(self, study: optuna.Study, trials: list, returns: list) -> None:
        """Each launched trial's end told to the study: a lost worker's trial FAILED as one found
        dead, else the job's values or why it has none."""
        for trial, ret in zip(trials, returns):
            if ret.status == JobStatus.FAILED and isinstance(ret._return_value, WorkerLost):
                trial.set_user_attr("why", str(ret._return_value))
                study.tell(trial, state=optuna.trial.TrialState.FAIL)  # as a trial found dead by its heartbeat
                self.recovery.died(
                    study,
                    study._storage.get_trial(trial._trial_id),
                    str(ret._return_value),
                    ret._return_value.job_dir,
                )
                continue
            state, values, why = outcome(ret, len(self.directions))
            if why:
                trial.set_user_attr("why", why)
                log.warning(f"trial {trial.number} {state.name}: {why}")
            else:
                log.info(
                    f"trial {trial.number} {state.name}: {values_text(self.objectives, values)} at {short_params(trial.params)}"
                )
            study.tell(trial, values, state=state)

    def _seeds(self, number: int) -> list[str]:
        """A trial's seeds, when it trains several: the statistic its job takes over them, and with
        hydra.sweeper.common_seeds=false seeds of its own (trial i: each shifted by i * `_span`)."""
        if self.seeds is None:
            return []
        out = [f"optuna.statistic={self.statistic}"]
        if not self.common_seeds:
            mine = [k + number * self._span() for k in self.seeds]
            out += [f"seeds=[{','.join(map(str, mine))}]", f"seed={mine[0]}"]
        return out

    def used_seeds(self, study: optuna.Study) -> list[int]:
        """Every seed a trial of this sweep trained."""
        if self.seeds is None:
            return [int(self.config.get("seed", 0))]
        if self.common_seeds:
            return list(self.seeds)
        return [k + t.number * self._span() for t in study.get_trials(deepcopy=False) for k in self.seeds]

    def _span(self) -> int:
        """How far apart two trials' own seeds lie (common_seeds=false): the seeds' range, so that
        no two trials share one whatever the seeds (seeds=[0,3,6]: trial 1 gets [7,10,13])."""
        return max(self.seeds) - min(self.seeds) + 1

    def _recheck(self, study: optuna.Study, space) -> Optional[dict]:
        """hydra.sweeper.recheck.top: the best complete trials trained again on fresh seeds, one
        members job each (recheck/trial<N>; resume=auto: a finished one is not trained again), and
        the best judged against the others (sweep/recheck.py)."""
        if not self.recheck.top:
            return None
        live = [
            t.number
            for t in study.get_trials(
                deepcopy=False, states=[optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING]
            )
        ]
        if live:  # another process shares the study: the last one to finish (or a rerun) re-checks
            log.info(f"re-check left to the last process on the study: trials {live} are still running or waiting")
            return None
        complete = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
        minimize = self.directions[0] == "minimize"
        best = sorted(complete, key=lambda t: t.value if minimize else -t.value)[: self.recheck.top]
        if len(best) < 2:
            log.warning(f"re-check skipped: {len(best)} complete trial(s), it needs 2")
            return None
        seeds = rechecks.fresh_seeds(self.recheck, self.used_seeds(study), len(self.seeds or [0]))
        stages = (
            None if self.recheck.stages is None else rechecks.stages_of(self.recheck, self.used_seeds(study), seeds)
        )
        batch = [rechecks.job_overrides(space.overrides(t.params), seeds, t.number) + ["resume=auto"] for t in best]
        log.info(f"re-check: trials {[t.number for t in best]} on fresh seeds {seeds}")

        launched = [len(study.trials)]  # the next job's index: stage 2's jobs after stage 1's

        def run(batch: list[list[str]]) -> list[str]:  # each job's failure, or ""
            self.validate_batch_is_legal(batch)
            returns = self.launcher.launch(batch, initial_job_idx=launched[0])
            launched[0] += len(batch)
            return [outcome(r, 1)[2] for r in returns]

        objective = self.objectives[0] if self.objectives else "eval/valid/loss"
        folder, margin = self.sweep_dir / rechecks.FOLDER, self.recheck.margin
        record = rechecks.collect(best, run(batch), folder, seeds, objective, minimize, margin)
        if stages is None or "against" not in record:  # one look, or no best to judge
            return record
        params = lambda t: space.overrides(t.params)  # noqa: E731
        return rechecks.staged(best, record, folder, stages, params, run, minimize, margin)
