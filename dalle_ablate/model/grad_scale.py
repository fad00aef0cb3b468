"""Per-resblock gradient scaling, the model's side (DALL·E, arXiv 2102.12092, sec. 2.4 and
figure 4): in float16, gradients deep in a large transformer underflow; one loss scale cannot
suit every block when their gradients span many orders of magnitude. So each residual branch
gets its own scale: the gradient entering the branch (from the residual stream, kept in float32
with its activations) is multiplied by the branch's scale and cast to 16 bits; the gradient
leaving it is cast back, divided by the scale, and "filtered" -- Inf and NaN set to 0 -- before
it joins the residual stream, so an overflow inside one block never reaches the blocks below.

A block's scale travels as `BlockScale(scale, probe_in, probe_out)`: the probes are zeros whose
gradients report what the backward pass saw at the block's edges (the count of non-finite
entries filtered at its input; the count of entries that underflowed to 0 when cast to 16 bits
at its output). The trainer (train/grad_scaling.py) differentiates with respect to them and
adjusts each scale from the counts.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockScale(NamedTuple):
    """One residual branch's gradient scale and its two probes (float32 scalars; or, for a
    stack of layers, arrays [layers, branches] whose rows are handed to each layer)."""

    scale: jax.Array
    probe_in: jax.Array
    probe_out: jax.Array

    def row(self, i) -> "BlockScale":
        return BlockScale(*(x[i] for x in self))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def branch_input(x: jax.Array, scale: jax.Array, probe: jax.Array, dtype) -> jax.Array:
    """Forward: x (the float32 residual stream) cast to the branch's compute dtype. Backward:
    the branch's input gradient back in float32, divided by `scale`, non-finite entries set to 0;
    `probe` gets the number of entries so filtered."""
    return x.astype(dtype)


def _input_fwd(x, scale, probe, dtype):
    return x.astype(dtype), (scale, jnp.zeros((), x.dtype))


def _input_bwd(dtype, res, g):
    scale, like = res
    g = g.astype(jnp.float32) / scale
    bad = ~jnp.isfinite(g)
    return jnp.where(bad, 0.0, g).astype(like.dtype), jnp.zeros_like(scale), jnp.sum(bad).astype(jnp.float32)


branch_input.defvjp(_input_fwd, _input_bwd)


@jax.custom_vjp
def branch_output(y: jax.Array, scale: jax.Array, probe: jax.Array) -> jax.Array:
    """Forward: the branch's output y (compute dtype) cast to float32 for the residual stream.
    Backward: the stream's float32 gradient times `scale`, cast to y's dtype; `probe` gets the
    number of non-zero entries that became 0 in that cast (underflow)."""
    return y.astype(jnp.float32)


def _output_fwd(y, scale, probe):
    return y.astype(jnp.float32), (scale, jnp.zeros((), y.dtype))


def _output_bwd(res, g):
    scale, like = res
    scaled = g.astype(jnp.float32) * scale
    low = scaled.astype(like.dtype)
    underflow = jnp.sum((low == 0) & (scaled != 0)).astype(jnp.float32)
    return low, jnp.zeros_like(scale), underflow


branch_output.defvjp(_output_fwd, _output_bwd)
