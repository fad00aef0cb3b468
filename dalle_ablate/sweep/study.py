"""Optuna studies for sweeps: samplers and pruners by name, storage (a sqlite file in the sweep
folder by default, any SQLAlchemy URL otherwise), and the lock that keeps the number of trials
exact when several sweep processes share one study."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from pathlib import Path
from typing import Iterator, Optional

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

PRUNER_ATTR = "dalle_ablate.pruner"  # the study's pruner spec, so that jobs rebuild the same pruner


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


def storage(url: str) -> optuna.storages.RDBStorage:
    try:
        return optuna.storages.RDBStorage(url)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors name the driver or the server
        raise ConfigError(f"hydra.sweeper.storage={url!r} cannot be opened: {str(e).splitlines()[0]}") from e


@contextlib.contextmanager
def trial_lock(url: str, study_name: str) -> Iterator[bool]:
    """Held while counting a study's trials and creating new ones, so that processes sharing the
    study never create more than n_trials: an advisory lock on PostgreSQL, a file lock beside a
    sqlite database. Yields False (no lock) for other backends."""
    if url.startswith("sqlite:///"):
        with open(f"{url[len('sqlite:///'):]}.lock", "a+") as f:
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
