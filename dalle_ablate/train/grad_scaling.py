"""trainer.grad_scaling: dynamic gradient scaling for float16 training.

- `global`: one loss scale (mixed-precision training, Micikevicius et al. 2018, arXiv 1710.03740):
  the loss is multiplied by S before differentiation and the gradients divided by it.
- `per_block`: DALL·E's per-resblock scales (arXiv 2102.12092, sec. 2.4, figure 4): each residual
  branch has its own scale, applied at the branch's edges (model/grad_scale.py); the residual
  stream stays float32. The gradients of a block's parameters come out multiplied by its scale
  and are divided by it here. Everything else is never multiplied and never divided: the norms
  on the stream (post-LN's and DeepNet's, Swin v2's, the final norms) run in float32 on it, and
  the embeddings and heads are computed in float32 (the paper's appendix D), so no 16-bit cast
  can flush their gradients whatever the loss's magnitude.

Either way a step whose gradients hold an Inf or NaN anywhere is skipped (parameters and
optimizer state kept) and counted; a scale halves on overflow -- per block, only the blocks that
overflowed -- and doubles after `trainer.grad_scale_growth_every` steps without one. The state
is the train state's `scaler` (state.py), placed, checkpointed and resumed with the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from dalle_ablate.model import BlockScale
from dalle_ablate.model.layouts import Sublayer
from dalle_ablate.optim import path_str

MIN_SCALE, MAX_SCALE = 2.0**-24, 2.0**24


class ScalerState(NamedTuple):
    scale: Any  # global: a scalar; per_block: {stack: [layers, branches]}
    good: Any  # steps since the last overflow or growth, shaped like scale
    skipped: jax.Array  # steps skipped so far


def block_names(model) -> dict[str, tuple[int, tuple[str, ...]]]:
    """{stack: (layers, branch names)} of a model's residual blocks (its family's STACKS)."""
    return {name: (len(getattr(model, name)), tuple(cls.BRANCHES)) for name, cls in model.STACKS.items()}


def param_block(path, model) -> Optional[tuple[str, int, int]]:
    """(stack, layer, branch) of the block a parameter belongs to, or None: outside every block
    (embeddings, heads, final norms, Swin v2's stream norms) or on the residual stream inside a
    layer (the post-residual norms of post-LN and DeepNet, `Sublayer.STREAM`), where the gradient
    is float32 and never multiplied by a block's scale."""
    parts = path_str(path).split("/")
    if len(parts) < 3 or parts[0] not in model.STACKS or any(p in Sublayer.STREAM for p in parts[3:4]):
        return None
    for b, modules in enumerate(model.STACKS[parts[0]].BRANCHES.values()):
        if parts[2] in modules:
            return parts[0], int(parts[1]), b
    return None


def scaler_init(mode: str, blocks: dict[str, tuple[int, tuple[str, ...]]], init_scale: float) -> ScalerState:
    if mode == "global":
        scale = jnp.float32(init_scale)
    else:
        scale = {k: jnp.full((n, len(branches)), init_scale, jnp.float32) for k, (n, branches) in blocks.items()}
    return ScalerState(scale, jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.int32), scale), jnp.zeros((), jnp.int32))


def probes(state: ScalerState):
    """Zeros to differentiate against: their gradients count, per block, the entries filtered at
    its input and those that underflowed at its output (model/grad_scale.py)."""
    return jax.tree.map(lambda s: (jnp.zeros_like(s), jnp.zeros_like(s)), state.scale)


def block_scales(state: ScalerState, probe_values) -> dict[str, BlockScale]:
    return {k: BlockScale(s, *probe_values[k]) for k, s in state.scale.items()}


def unscale(mode: str, grads, state: ScalerState, model):
    """The gradients with each one's scale divided out."""
    if mode == "global":
        return jax.tree.map(lambda g: g / state.scale, grads)

    def one(path, g):
        where = param_block(path, model)
        return g if where is None else g / state.scale[where[0]][where[1], where[2]]

    return jax.tree_util.tree_map_with_path(one, grads)


def advance(
    mode: str, state: ScalerState, grads, counts, model, growth_every: int
) -> tuple[ScalerState, jax.Array, dict]:
    """(the next state, whether this step is skipped, metrics) from the unscaled gradients and
    the probes' counts (per_block)."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    if mode == "global":
        bad = ~finite
    else:
        bad = {k: c[0] > 0 for k, c in counts.items()}  # Inf/NaN filtered at the block's input
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            where = param_block(path, model)
            if where is not None:
                k, layer, b = where
                bad[k] = bad[k].at[layer, b].set(bad[k][layer, b] | ~jnp.all(jnp.isfinite(g)))
    skip = ~finite | jnp.any(jnp.stack([jnp.any(b) for b in jax.tree.leaves(bad)]))

    def rule(scale, good, overflow):
        grow = ~overflow & (good + 1 >= growth_every)
        scale = jnp.where(
            overflow, jnp.maximum(scale / 2, MIN_SCALE), jnp.where(grow, jnp.minimum(scale * 2, MAX_SCALE), scale)
        )
        return scale, jnp.where(overflow | grow, 0, good + 1)

    if mode == "global":
        scale, good = rule(state.scale, state.good, bad)
        metrics = {"train/grad_scale": scale}
    else:
        new = {k: rule(state.scale[k], state.good[k], bad[k]) for k in state.scale}
        scale, good = {k: v[0] for k, v in new.items()}, {k: v[1] for k, v in new.items()}
        names = block_names(model)
        metrics = {
            f"train/grad_scale/{k}/{layer}/{branch}": scale[k][layer, b]
            for k, (n, branches) in names.items()
            for layer in range(n)
            for b, branch in enumerate(branches)
        }
        metrics["train/grad_scale"] = jnp.min(jnp.stack([jnp.min(s) for s in scale.values()]))
        metrics["train/grad_filtered"] = sum(jnp.sum(c[0]) for c in counts.values())
        metrics["train/grad_underflow"] = sum(jnp.sum(c[1]) for c in counts.values())
    skipped = state.skipped + skip.astype(jnp.int32)
    metrics.update({"train/skipped": skip.astype(jnp.float32), "train/skipped_steps": skipped})
    return ScalerState(scale, good, skipped), skip, metrics
