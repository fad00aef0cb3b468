"""Optuna studies for sweeps: samplers and pruners by name, storage (a sqlite file in the sweep
folder by default, any SQLAlchemy URL otherwise), and the lock that keeps the number of trials
exact when several sweep processes share one study."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import optuna

from dalle_ablate.registry import ConfigError, Registry

SAMPLERS: Registry = Registry("sampler", "hydra.sweeper.sampler.name")
PRUNERS: Registry = Registry("pruner", "hydra.sweeper.pruner.name")

SAMPLERS.register("tpe", lambda seed, space, kw: optuna.samplers.TPESampler(seed=seed, **kw))
SAMPLERS.register("random", lambda seed, space, kw: optuna.samplers.RandomSampler(seed=seed, **kw))
SAMPLERS.register("cmaes", lambda seed, space, kw: optuna.samplers.CmaEsSampler(seed=seed, **kw))
SAMPLERS.register("nsgaii", lambda seed, space, kw: optuna.samplers.NSGAIISampler(seed=seed, **kw))


class GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler without its end-of-grid `study.stop()`, which works only inside
    `study.optimize` (and, raised from `tell`, would lose the last trial's state): the sweeper
    caps n_trials at the grid's size instead."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


SAMPLERS.register("grid", lambda seed, space, kw: GridSampler(space.grid(), seed=seed, **kw))

PRUNERS.register("none", lambda kw: optuna.pruners.NopPruner())
PRUNERS.register("median", lambda kw: optuna.pruners.MedianPruner(**kw))
PRUNERS.register("percentile", lambda kw: optuna.pruners.PercentilePruner(**kw))
PRUNERS.register("hyperband", lambda kw: optuna.pruners.HyperbandPruner(**kw))
PRUNERS.register("successive_halving", lambda kw: optuna.pruners.SuccessiveHalvingPruner(**kw))
PRUNERS.register("threshold", lambda kw: optuna.pruners.ThresholdPruner(**kw))

# A trial's value from its members' values (`seeds=[...]`: each trial trains its seeds as members of
# one job): hydra.sweeper.statistic. The bounds are one-sided 90 % t bounds on the members' mean
# (n - 1 degrees of freedom): `upper` is the cautious choice for a loss -- a point whose seeds
# disagree ranks behind one as good on average whose seeds agree.
STATISTICS: Registry = Registry("statistic", "hydra.sweeper.statistic")
BOUND_LEVEL = 0.90


def _bound(values: np.ndarray, side: int) -> float:
    from scipy import stats

    n = len(values)
    if n < 2:
        return float("nan")  # no spread from one seed (the sweeper refuses this before a trial runs)
    return float(values.mean() + side * stats.t.ppf(BOUND_LEVEL, n - 1) * values.std(ddof=1) / np.sqrt(n))


STATISTICS.register("mean", lambda v: float(np.mean(v)))
STATISTICS.register("median", lambda v: float(np.median(v)))
STATISTICS.register("upper", lambda v: _bound(np.asarray(v, float), +1))
STATISTICS.register("lower", lambda v: _bound(np.asarray(v, float), -1))
NEEDS_SPREAD = ("upper", "lower")  # statistics that need at least two seeds

PRUNER_ATTR = "dalle_ablate.pruner"  # the study's pruner spec, so that jobs rebuild the same pruner
STARTS_ATTR = "dalle_ablate.sampler_starts"  # sweep processes started on the study so far
RUN_DIR_ATTR = "run_dir"  # a trial's run store, so that a later sweep can mark it or resume from it
WANDB_ATTR = "wandb_id"  # a trial's W&B run, where it has one
# A trial of several seeds: each member's run store and value, the spread, the statistic taken.
MEMBERS_ATTR = "members"


def sampler_seed(seed: Optional[int], start: int) -> Optional[int]:
    """The seed of the start-th sweep process on a study: a seeded sampler in a resumed or a
    second process would otherwise draw the very points the first one drew."""
    if seed is None or start == 0:
        return seed
    return int(np.random.SeedSequence([seed, start]).generate_state(1)[0])


def make_sampler(name: str, seed: Optional[int], space, kwargs: dict) -> optuna.samplers.BaseSampler:
    try:
        return SAMPLERS.get(name)(seed, space, dict(kwargs))
    except TypeError as e:
        raise ConfigError(f"hydra.sweeper.sampler: {e}") from e


def make_pruner(spec: dict) -> optuna.pruners.BasePruner:
    spec = dict(spec)
    name = spec.pop("name", "none")
    try:
        return PRUNERS.get(name)(spec)
    except TypeError as e:
        raise ConfigError(f"hydra.sweeper.pruner: {e}") from e


def default_storage(sweep_dir: str | Path) -> str:
    path = Path(sweep_dir).resolve() / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def storage(
    url: str,
    heartbeat_interval: Optional[int] = None,
    grace_period: Optional[int] = None,
    on_stale: Optional[Callable] = None,
) -> optuna.storages.RDBStorage:
    """The study's storage; with heartbeats, a RUNNING trial whose heartbeat is older than the
    grace period is one whose process died (optuna.storages.fail_stale_trials)."""
    try:
        return optuna.storages.RDBStorage(
            url,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=on_stale,
        )
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors name the driver or the server
        raise ConfigError(f"hydra.sweeper.storage={url!r} cannot be opened: {str(e).splitlines()[0]}") from e


@contextlib.contextmanager
def heartbeats(store: optuna.storages.RDBStorage, trial_ids: list[int], interval: int) -> Iterator[None]:
    """Record the trials' heartbeats every `interval` seconds while their jobs run (what
    study.optimize does for its own trials; ask-and-tell leaves it to the caller)."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            for trial_id in trial_ids:
                store.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="optuna-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def trial_lock(url: str, study_name: str) -> Iterator[bool]:
    """Held while counting a study's trials and creating new ones, so that processes sharing the
    study never create more than n_trials: an advisory lock on PostgreSQL, a file lock beside a
    sqlite database. Yields False (no lock) for other backends."""
    if url.startswith("sqlite:///"):
        with open(f"{url[len('sqlite:///') :]}.lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    elif url.startswith(("postgresql", "postgres")):
        import sqlalchemy

        key = int.from_bytes(hashlib.sha256(study_name.encode()).digest()[:8], "big", signed=True)
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                yield True
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
        engine.dispose()
    else:
        yield False
