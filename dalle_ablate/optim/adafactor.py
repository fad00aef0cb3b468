"""optim=adafactor: Adafactor (Shazeer & Stern, arXiv 1804.04235) as optax has it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import optax

from dalle_ablate.optim.base import OPTIMIZERS, OptimConfig, decay_mask


@dataclass
class AdafactorConfig(OptimConfig):
    RANGES = {
        "decay_rate": "(0, 1]",
        "decay_offset": "[0, inf)",
        "clipping_threshold": "(0, inf) or null",
        "momentum": "[0, 1) or null",
        "min_dim_size_to_factor": "[1, inf)",
        "eps": "[0, inf)",
    }

    name: str = "adafactor"
    lr: float = 1e-2
    decay_rate: float = 0.8  # the second moment's decay is 1 - t^-decay_rate at step t (Shazeer & Stern 2018)
    decay_offset: int = 0  # the step that decay counts t from (fine-tuning: the step it starts at)
    clipping_threshold: Optional[float] = 1.0  # an update's RMS is clipped to this (the paper's d); null = off
    momentum: Optional[float] = None  # decay of a first moment; null = none (the paper's memory saving)
    factored: bool = True  # a matrix's second moment as row and column factors
    min_dim_size_to_factor: int = 128  # factor only matrices whose both sides are at least this long
    multiply_by_parameter_scale: bool = False  # DALL·E mini used the plain learning rate
    eps: float = 1e-30  # added to the squared gradient (the paper's epsilon_1)


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
