"""Optimizers (optax GradientTransformations) and learning-rate schedules, by name. Each
optimizer is one module (`adam.py`, `adafactor.py`, `shampoo.py`) holding its config dataclass
and its builder, registered together by `OPTIMIZERS.option`; importing this package registers
them all."""

from __future__ import annotations

import optax

from dalle_ablate.optim import adafactor, adam, shampoo  # noqa: F401 - registers the options
from dalle_ablate.optim.base import OPTIMIZERS, OptimConfig, decay_mask, path_str
from dalle_ablate.optim.powersgd import PowerSGDConfig, PowerSGDState, powersgd_init, powersgd_mean, traffic
from dalle_ablate.optim.scale_by_shampoo import scale_by_shampoo, shampoo_stats
from dalle_ablate.optim.schedules import SCHEDULES, ScheduleConfig, build_schedule


def build_optimizer(
    optim_cfg, schedule_cfg, total_steps: int, stack_sharding=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, schedule): optional global-norm clipping, then the named optimizer.
    `stack_sharding`: where Shampoo's stacked state lives on the mesh (`parallel.stack_sharding`),
    so that each device refreshes its own blocks' roots; None on one device and for abstract
    shapes. This package builds no shardings itself. PowerSGD (`optim.powersgd`) is a stage of
    the gradient path, not of the optimizer: its state is the train state's `compression`."""
    schedule = build_schedule(schedule_cfg, optim_cfg.lr, total_steps)
    opt = OPTIMIZERS.get(optim_cfg.name)(optim_cfg, schedule, stack_sharding)
    if optim_cfg.clip_grad_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(optim_cfg.clip_grad_norm), opt)
    return opt, schedule


__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "OptimConfig",
    "PowerSGDConfig",
    "PowerSGDState",
    "ScheduleConfig",
    "build_optimizer",
    "build_schedule",
    "decay_mask",
    "path_str",
    "powersgd_init",
    "powersgd_mean",
    "scale_by_shampoo",
    "shampoo_stats",
    "traffic",
]
