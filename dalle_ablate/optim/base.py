"""What every optimizer option shares: its config's common fields, the OPTIMIZERS registry, and
the weight-decay mask by parameter path."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import jax
from omegaconf import MISSING

from dalle_ablate.optim.powersgd import PowerSGDConfig
from dalle_ablate.registry import ConfigError, OptionConfig, Registry

# name -> builder(optim cfg, learning-rate schedule, stack_sharding) -> optax.GradientTransformation
OPTIMIZERS: Registry = Registry("optimizer", "optim")


@dataclass
class OptimConfig(OptionConfig):
    RANGES = {"weight_decay": "[0, inf)", "clip_grad_norm": "(0, inf) or null", "lr": "(0, inf)"}

    name: str = MISSING  # the optimizer, chosen with optim=NAME (its preset sets it)
    lr: float = 1e-3  # the peak rate; an optimizer's config sets its own where it differs (adam, adafactor)
    weight_decay: float = 0.0  # decoupled weight decay (AdamW's), times the learning rate; 0 = off
    # Parameters whose path matches one of these regexes get no weight decay.
    wd_exclude: list[str] = field(default_factory=lambda: ["norm", "bias", "embed"])
    clip_grad_norm: Optional[float] = 1.0  # global gradient clipping; null = off
    # Data-parallel gradients compressed by PowerSGD (powersgd.py); any optimizer runs on the result.
    powersgd: PowerSGDConfig = field(default_factory=PowerSGDConfig)

    def validate(self, run) -> None:
        decay_mask(self.wd_exclude)
        self.powersgd.check_all(run, "optim.powersgd")


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def decay_mask(exclude: list[str], field: str = "optim.wd_exclude"):
    """A mask function for optax: True where no exclude regex matches the parameter's path."""
    try:
        patterns = [re.compile(p) for p in exclude]
    except re.error as e:
        raise ConfigError(f"{field} has an invalid regex: {e}") from e

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: not any(r.search(path_str(p)) for r in patterns), params)

    return mask
