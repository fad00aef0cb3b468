"""What every cluster launcher does the same way: the config of each job of a batch (as Hydra's
basic launcher builds it), running one process of a job on a worker, the environment that makes
the processes of one trial one JAX run, and the return of a job whose worker was lost."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A job's process or node died before it returned (killed, out of memory, node gone, the
    scheduler's timeout): the sweeper records the trial as FAILED, marks its run store failed, and
    runs another trial in its place (or retries it from its checkpoint, hydra.sweeper.retry_failed).
    `job_dir` is the job's folder, for a job lost before it told the study where its run store is."""

    def __init__(self, why: str, job_dir: Optional[str] = None):
        super().__init__(why)
        self.job_dir = job_dir


def job_dir(cfg: DictConfig) -> Optional[str]:
    """The folder run_job gives the job (hydra.sweep.dir / hydra.sweep.subdir)."""
    try:
        return os.path.join(str(cfg.hydra.sweep.dir), str(OmegaConf.select(cfg, "hydra.sweep.subdir")))
    except Exception:  # a subdir whose interpolation needs the job's own process (a custom resolver)
        return None


def failed(overrides: Sequence[str], error: BaseException) -> JobReturn:
    """A job that did not return a JobReturn of its own: the sweeper records a FAILED trial."""
    return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=error)


def lost(cfg: DictConfig, overrides: Sequence[str], why: str) -> JobReturn:
    return failed(overrides, WorkerLost(why, job_dir(cfg)))


def sweep_configs(
    hydra_context, config: DictConfig, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
) -> list[DictConfig]:
    """Each job's composed config, numbered from `initial_job_idx` (hydra.job.num/id), its sweep dir
    absolute so that a worker in another directory (or on another host, over a shared file system)
    writes where the sweep reads."""
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    configs = []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
        cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
            cfg.hydra.sweep.dir = str(sweep_dir)
        configs.append(cfg)
    return configs


def process_env(coordinator: str, processes: int, rank: int) -> dict[str, str]:
    """One process of a trial of several: conf/config.yaml reads `distributed.*` from these, so the
    job's composed config needs no per-process overrides (and its run name does not change)."""
    if processes == 1:
        return {}
    return {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(rank)}


def run_one(
    hydra_context,
    task_function,
    sweep_config: DictConfig,
    singleton_state: dict[Any, Any],
    cwd: str,
    env: dict[str, str],
) -> JobReturn:
    """One process of a job, on a worker: Hydra's globals as the launching process had them, then
    the job as the basic launcher runs it (a task that raises returns a FAILED JobReturn)."""
    os.environ.update(env)
    if Path(cwd).is_dir():  # relative paths of the config (data caches) mean what they meant where the sweep started
        os.chdir(cwd)
    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=sweep_config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
