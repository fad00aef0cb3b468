"""Learning-rate schedules: linear warmup from 0, then constant, linear or exponential decay
(optax schedules joined at the end of warmup)."""

from __future__ import annotations

import optax

from dalle_ablate.registry import ConfigError, Registry

SCHEDULES: Registry = Registry("schedule", "schedule")


@SCHEDULES.register("constant")
def _constant(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    return optax.constant_schedule(lr)


@SCHEDULES.register("linear")
def _linear(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    if cfg.decay_steps is not None and cfg.decay_steps <= 0:
        raise ConfigError(f"schedule.decay_steps={cfg.decay_steps} must be positive or null")
    # null: decay over what is left after warmup (at least one step, also for runs shorter than warmup)
    steps = cfg.decay_steps if cfg.decay_steps is not None else max(decay_steps, 1)
    return optax.linear_schedule(lr, lr * cfg.end_factor, steps)


@SCHEDULES.register("cosine")
def _cosine(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    if cfg.decay_steps is not None and cfg.decay_steps <= 0:
        raise ConfigError(f"schedule.decay_steps={cfg.decay_steps} must be positive or null")
    steps = cfg.decay_steps if cfg.decay_steps is not None else max(decay_steps, 1)
    return optax.cosine_decay_schedule(lr, steps, alpha=cfg.end_factor)


@SCHEDULES.register("exponential")
def _exponential(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    if cfg.transition_steps <= 0 or not 0 < cfg.decay_rate:
        raise ConfigError(
            f"schedule.transition_steps={cfg.transition_steps} and schedule.decay_rate={cfg.decay_rate} must be positive"
        )
    return optax.exponential_decay(lr, cfg.transition_steps, cfg.decay_rate, staircase=cfg.staircase)


def build_schedule(cfg, lr: float, total_steps: int) -> optax.Schedule:
    if cfg.lr_offset < 0:
        raise ConfigError(f"schedule.lr_offset={cfg.lr_offset} must be >= 0")
    decay = SCHEDULES.get(cfg.name)(cfg, lr, total_steps - cfg.lr_offset - cfg.warmup_steps)
    schedule = decay
    if cfg.warmup_steps > 0:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps), decay], [cfg.warmup_steps])
    if cfg.lr_offset > 0:  # the whole schedule starts lr_offset steps late, at rate 0 until then
        schedule = optax.join_schedules([optax.constant_schedule(0.0), schedule], [cfg.lr_offset])
    return schedule
