"""Several processes in one run (one per host): `jax.distributed.initialize` before any device
is touched. Each process then sees the global device list, feeds its own rows of every batch,
and only process 0 writes the run store and W&B (orbax writes each process's shards of a
checkpoint)."""

from __future__ import annotations

import jax

from dalle_ablate.registry import ConfigError


def initialize(dist_cfg) -> None:
    """jax.distributed.initialize from `distributed.*`; nothing for a single process."""
    if jax.distributed.is_initialized():
        return
    if dist_cfg.coordinator_address:
        missing = [k for k in ("num_processes", "process_id") if getattr(dist_cfg, k) is None]
        if missing:
            raise ConfigError(
                f"distributed.coordinator_address={dist_cfg.coordinator_address} needs "
                + " and ".join(f"distributed.{k}" for k in missing)
                + " (or JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
            )
        if not 0 <= dist_cfg.process_id < dist_cfg.num_processes:
            raise ConfigError(f"distributed.process_id={dist_cfg.process_id} must be in [0, {dist_cfg.num_processes})")
        jax.distributed.initialize(dist_cfg.coordinator_address, dist_cfg.num_processes, dist_cfg.process_id)
    elif dist_cfg.auto:
        try:
            jax.distributed.initialize()
        except ValueError as e:  # no cluster environment JAX knows: it finds no coordinator
            raise ConfigError(
                f"distributed.auto=true, but JAX detects no cluster here (Cloud TPU, Slurm, Open MPI; it says: "
                f"{e}); on other machines set distributed.coordinator_address, distributed.num_processes and "
                "distributed.process_id instead"
            ) from None


def preempted(step: int) -> bool:
    """Whether every process of a run of several is to stop after `step`, because one of them got
    SIGTERM (a preemption notice): JAX's preemption service, which `jax.distributed.initialize`
    starts, takes SIGTERM in each process (its handler, in place of interrupts.py's) and agrees
    with the others on the step to stop at -- every process calls this at every step boundary,
    and all of them get True at the same `step` (jax.experimental.multihost_utils
    `reached_preemption_sync_point`, as orbax and MaxText use it). False in a run of one process,
    where SIGTERM is interrupts.py's."""
    if jax.process_count() == 1:
        return False
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)
