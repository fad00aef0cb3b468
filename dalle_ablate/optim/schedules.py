"""Learning-rate schedules: linear warmup from 0, then constant, linear, cosine, exponential or
warmup-stable-decay (optax schedules joined at the end of warmup). Each option is its config dataclass and its
builder, side by side; they are a few lines each, so they share this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import optax
from omegaconf import MISSING

from dalle_ablate.registry import OptionConfig, Registry, check

# name -> builder(schedule cfg, peak lr, steps left after warmup) -> optax.Schedule
SCHEDULES: Registry = Registry("schedule", "schedule")


@dataclass
class ScheduleConfig(OptionConfig):
    """Linear warmup from 0 to optim.lr over warmup_steps, then the named decay."""

    RANGES = {"warmup_steps": "[0, inf)", "lr_offset": "[0, inf)"}

    name: str = MISSING  # the decay after the warm-up, chosen with schedule=NAME (its preset sets it)
    warmup_steps: int = 50  # steps over which the rate rises linearly from 0 to optim.lr
    lr_offset: int = 0  # hold the rate at 0 for the first N steps (resuming with a fresh optimizer)
    allow_long_warmup: bool = False  # let warmup (with lr_offset) last as long as the run or longer

    def validate(self, run) -> None:
        steps = run.trainer.steps
        check(
            self.allow_long_warmup or self.lr_offset + self.warmup_steps < steps,
            f"schedule.warmup_steps={self.warmup_steps} (after schedule.lr_offset={self.lr_offset}) is not shorter than "
            f"trainer.steps={steps}: the learning rate would never reach optim.lr; shorten it, or set "
            f"schedule.allow_long_warmup=true",
        )


@dataclass
class ConstantScheduleConfig(ScheduleConfig):
    name: str = "constant"


@SCHEDULES.option("constant", ConstantScheduleConfig)
def constant(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    return optax.constant_schedule(lr)


@dataclass
class LinearScheduleConfig(ScheduleConfig):
    RANGES = {"end_factor": "[0, 1]", "decay_steps": "[1, inf) or null"}

    name: str = "linear"
    end_factor: float = 0.0  # final lr as a fraction of optim.lr
    decay_steps: Optional[int] = None  # null = until trainer.steps


@SCHEDULES.option("linear", LinearScheduleConfig)
def linear(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    # null: decay over what is left after warmup (at least one step, also for runs shorter than warmup)
    steps = cfg.decay_steps if cfg.decay_steps is not None else max(decay_steps, 1)
    return optax.linear_schedule(lr, lr * cfg.end_factor, steps)


@dataclass
class CosineScheduleConfig(LinearScheduleConfig):
    name: str = "cosine"


@SCHEDULES.option("cosine", CosineScheduleConfig)
def cosine(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    steps = cfg.decay_steps if cfg.decay_steps is not None else max(decay_steps, 1)
    return optax.cosine_decay_schedule(lr, steps, alpha=cfg.end_factor)


@dataclass
class ExponentialScheduleConfig(ScheduleConfig):
    RANGES = {"transition_steps": "[1, inf)", "decay_rate": "(0, inf)"}

    name: str = "exponential"
    transition_steps: int = 1000  # steps over which the rate is multiplied by decay_rate once
    decay_rate: float = 0.5  # the rate's factor per transition_steps
    staircase: bool = False  # decay in steps every transition_steps instead of smoothly


@SCHEDULES.option("exponential", ExponentialScheduleConfig)
def exponential(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    return optax.exponential_decay(lr, cfg.transition_steps, cfg.decay_rate, staircase=cfg.staircase)


@dataclass
class WSDScheduleConfig(ScheduleConfig):
    """Warmup-stable-decay: the peak rate held after the warm-up, then a linear cooldown over the
    last `cooldown_frac` of the steps after it. Hägele et al. 2024 ("Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations") find a 20 % cooldown matches cosine;
    the nanoGPT speedrun trains with a 60 % one (its `cooldown_frac`)."""

    RANGES = {"cooldown_frac": "(0, 1]", "end_factor": "[0, 1]"}

    name: str = "wsd"
    cooldown_frac: float = 0.2  # share of the steps after the warm-up over which the rate falls linearly to the end
    end_factor: float = 0.0  # final lr as a fraction of optim.lr


@SCHEDULES.option("wsd", WSDScheduleConfig)
def wsd(cfg, lr: float, decay_steps: int) -> optax.Schedule:
    steps = max(decay_steps, 1)
    cooldown = max(1, round(cfg.cooldown_frac * steps))
    decay = optax.linear_schedule(lr, lr * cfg.end_factor, cooldown)
    return optax.join_schedules([optax.constant_schedule(lr), decay], [steps - cooldown])


def build_schedule(cfg, lr: float, total_steps: int) -> optax.Schedule:
    decay = SCHEDULES.get(cfg.name)(cfg, lr, total_steps - cfg.lr_offset - cfg.warmup_steps)
    schedule = decay
    if cfg.warmup_steps > 0:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps), decay], [cfg.warmup_steps])
    if cfg.lr_offset > 0:  # the whole schedule starts lr_offset steps late, at rate 0 until then
        schedule = optax.join_schedules([optax.constant_schedule(0.0), schedule], [cfg.lr_offset])
    return schedule
