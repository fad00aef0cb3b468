"""optim=adafactor: Adafactor (Shazeer & Stern, arXiv 1804.04235) as optax has it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import optax

from dalle_ablate.optim.base import OPTIMIZERS, OptimConfig, decay_mask


@dataclass
class AdafactorConfig(OptimConfig):
    RANGES = {"decay_rate": "(0, 1]", "decay_offset": "[0, inf)", "clipping_threshold": "(0, inf) or null",
              "momentum": "[0, 1) or null", "min_dim_size_to_factor": "[1, inf)", "eps": "[0, inf)"}

    name: str = "adafactor"
    lr: float = 1e-2
    decay_rate: float = 0.8
    decay_offset: int = 0
    clipping_threshold: Optional[float] = 1.0
    momentum: Optional[float] = None
    factored: bool = True
    min_dim_size_to_factor: int = 128
    multiply_by_parameter_scale: bool = False  # DALL·E mini used the plain learning rate
    eps: float = 1e-30


@OPTIMIZERS.option("adafactor", AdafactorConfig)
def adafactor(cfg: AdafactorConfig, lr, stack_sharding) -> optax.GradientTransformation:
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=cfg.min_dim_size_to_factor,
        decay_rate=cfg.decay_rate,
        decay_offset=cfg.decay_offset,
        multiply_by_parameter_scale=cfg.multiply_by_parameter_scale,
        clipping_threshold=cfg.clipping_threshold,
        momentum=cfg.momentum,
        eps=cfg.eps,
        factored=cfg.factored,
        weight_decay_rate=cfg.weight_decay or None,
        weight_decay_mask=decay_mask(cfg.wd_exclude),
    )
