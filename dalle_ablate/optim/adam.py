"""optim=adam: AdamW (Loshchilov & Hutter, arXiv 1711.05101) with decoupled, masked weight decay."""

from __future__ import annotations

from dataclasses import dataclass

import optax

from dalle_ablate.optim.base import OPTIMIZERS, OptimConfig, decay_mask


@dataclass
class AdamConfig(OptimConfig):
    # b2 = 1 would never forget, and the bias correction would divide by 0.
    RANGES = {"b1": "[0, 1)", "b2": "[0, 1)", "eps": "[0, inf)", "eps_root": "[0, inf)"}

    name: str = "adam"
    # the quickstart: 1e-3 learned the captions later, 2e-3 and 3e-3 not at all (docs/results/default-job.md)
    lr: float = 5e-4
    b1: float = 0.9  # decay of the first moment (momentum)
    b2: float = 0.999  # decay of the second moment
    eps: float = 1e-8  # added to the second moment's square root in the denominator
    eps_root: float = 0.0  # added to the second moment inside the square root
    nesterov: bool = False  # Nesterov momentum (NAdamW)


@OPTIMIZERS.option("adam", AdamConfig)
def adam(cfg: AdamConfig, lr, stack_sharding) -> optax.GradientTransformation:
    return optax.adamw(
        lr,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        eps_root=cfg.eps_root,
        weight_decay=cfg.weight_decay,
        mask=decay_mask(cfg.wd_exclude),
        nesterov=cfg.nesterov,
    )
