"""`hydra/launcher=slurm`, `slurm_tpu` and `slurm_local`: each job of a batch as one submitit job
(an sbatch array task on SLURM; processes on this machine for `slurm_local`, the same code path
without a scheduler). The parameters are hydra-submitit-launcher's (partition, timeout_min,
gpus_per_node, tasks_per_node, nodes, ...), from its own config classes; the launch is this
project's because that plugin collects a batch with `job.results()` in turn, which raises for a
job whose process was killed or timed out and so ends the whole sweep. Here such a job returns
`WorkerLost` and the sweep goes on. A job of several tasks (`tasks_per_node` × `nodes`) is one
multi-process JAX run: each task reads its rank from submitit's JobEnvironment."""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, setup_globals
from hydra.plugins.launcher import Launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf
from omegaconf import DictConfig, OmegaConf

from dalle_ablate.launch.jobs import failed, lost, process_env, run_one, sweep_configs
from dalle_ablate.registry import ConfigError, RunFailed

log = logging.getLogger(__name__)
TARGET = "hydra_plugins.dalle_ablate_launcher.SubmititLauncher"


@dataclass
class SlurmConf(SlurmQueueConf):
    _target_: str = TARGET
    executor: str = "slurm"


@dataclass
class SlurmTpuConf(SlurmConf):
    """A trial across TPU hosts (or GPU nodes): one task per host, `nodes` of them, all one JAX run."""

    nodes: int = 2
    tasks_per_node: int = 1


@dataclass
class LocalConf(LocalQueueConf):
    _target_: str = TARGET
    executor: str = "local"


def run_task(hydra_context, task_function, sweep_config: DictConfig, singleton_state: dict, cwd: str) -> JobReturn:
    """One task of a job, where submitit started it: with several tasks, process 0's host is the JAX
    coordinator, on a port all tasks derive from the job id (they cannot talk before it exists)."""
    import submitit

    env = submitit.JobEnvironment()
    port = 20000 + zlib.crc32(env.job_id.encode()) % 20000
    return run_one(
        hydra_context,
        task_function,
        sweep_config,
        singleton_state,
        cwd,
        process_env(f"{env.hostnames[0]}:{port}", env.num_tasks, env.global_rank),
    )


class SubmititLauncher(Launcher):
    def __init__(self, executor: str, **params: Any):
        self.name = executor
        self.params = {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in params.items()
        }
        timeout = self.params.get("timeout_min")
        if timeout is not None and not timeout > 0:  # a job stopped as it starts: every trial lost
            raise ConfigError(
                f"hydra.launcher.timeout_min={timeout} must be > 0 (the minutes a job may run before "
                f"{'SLURM stops' if executor == 'slurm' else 'it is stopped'})"
            )

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def executor(self):
        """submitit's executor with the plugin's parameters, named as that plugin names them."""
        import submitit

        if self.name == "slurm" and shutil.which("srun") is None:  # submitit would raise a RuntimeError of its own
            raise RunFailed(
                "hydra/launcher=slurm needs SLURM, and this machine has no srun on its PATH: start the sweep on "
                "a SLURM login node, or run its jobs here with hydra/launcher=slurm_local",
                RunFailed.FAILED,
            )
        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self.name}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self.name, **init)
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in generic else f"{self.name}_{k}": v for k, v in params.items()})
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from submitit.core.utils import FailedJobError, UncompletedJobError

        setup_globals()
        configs = sweep_configs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        n = len(configs)
        jobs = self.executor().map_array(
            run_task,
            [self.hydra_context] * n,
            [self.task_function] * n,
            configs,
            [Singleton.get_state()] * n,
            [os.getcwd()] * n,
        )
        returns = []
        try:
            for idx, (job, cfg, overrides) in enumerate(zip(jobs, configs, job_overrides), start=initial_job_idx):
                try:
                    returns.append(job.results()[0])  # process 0's return is the job's
                except UncompletedJobError as e:  # killed, out of memory, timed out, node lost
                    why = f"submitit job {job.job_id} of job #{idx} was lost: {str(e).strip().splitlines()[0]}"
                    log.warning(why)
                    returns.append(lost(cfg, overrides, why))
                except FailedJobError as e:  # the launcher's own code on the worker failed
                    returns.append(failed(overrides, e))
        finally:
            for job in jobs[len(returns) :]:  # Ctrl-C: no job keeps running after the sweep
                job.cancel(check=False)
        return returns
