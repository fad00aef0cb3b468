"""The bridge from Hydra to the trainer: job dir, W&B group and name, overrides, config."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dalle_ablate.config import to_run_config
from dalle_ablate.registry import RunFailed
from dalle_ablate.train.loop import JobInfo, train


def job_info(cfg: DictConfig) -> JobInfo:
    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    return JobInfo(
        job_dir=Path(hc.runtime.output_dir),
        # W&B: group = the multirun (or sweep) folder, name = the overrides that made this job.
        group=hc.sweep.dir if multirun else None,
        name=hc.job.override_dirname or hc.job.name,
        overrides=overrides,
        config=OmegaConf.to_container(cfg, resolve=True),
    )


def run(cfg: DictConfig) -> float | list[float]:
    # Hydra logs at INFO; JAX's note that no TPU/GPU backend was found would bury the progress
    # bar. orbax logs through absl: its per-save chatter, and a failed save once per thread with a
    # traceback, which the Checkpointer reports in one line instead (train/checkpoint.py).
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    run_cfg = to_run_config(cfg)
    job = job_info(cfg)
    result = train(run_cfg, job)
    if result.status == "diverged":
        # Not a value: the process exits non-zero (cli.run_hydra), a sweep records a FAILED trial.
        raise RunFailed(f"{job.name}: {result.reason} (run store {result.run_dir})", RunFailed.DIVERGED)
    values = [float(result.summary[k]) for k in run_cfg.objectives]
    return values[0] if len(values) == 1 else values
