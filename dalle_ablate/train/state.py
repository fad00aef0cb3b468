"""The train state: one record with a named field for each part, so that each is placed,
checkpointed and restored by its name (orbax stores `scaler.scale`, not `opt_state.0.scale`), and
a part a run does not use is None (no arrays, nothing on disk)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax.numpy as jnp
import optax
from flax import struct

from dalle_ablate.optim.powersgd import PowerSGDConfig, powersgd_init
from dalle_ablate.train.grad_scaling import ScalerState


@struct.dataclass
class TrainState:
    step: Any  # int32 scalar: optimizer steps taken
    params: Any  # pure dict of float32 master weights
    opt_state: Any  # the optimizer's own state (optax), and only that
    scaler: Any = None  # ScalerState under trainer.grad_scaling global or per_block (grad_scaling.py)
    compression: Any = None  # PowerSGDState under optim.powersgd.rank (optim/powersgd.py)


def state_maker(
    optimizer: optax.GradientTransformation,
    scaler: Optional[ScalerState] = None,
    powersgd: Optional[PowerSGDConfig] = None,
    workers: int = 1,
) -> Callable[[Any], TrainState]:
    """params -> the state at step 0 of a run with this optimizer, the gradient scaler's initial
    state (None: no scaling) and PowerSGD (None: gradients all-reduced whole; `workers`: the
    data-parallel workers, each keeping its own residual)."""

    def new_state(params) -> TrainState:
        compression = None if powersgd is None else powersgd_init(params, powersgd.rank, powersgd.exclude, workers)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
            scaler=scaler,
            compression=compression,
        )

    return new_state
