"""Building blocks: dense layers with logical axes, float32 norms, activations, attention, FFN.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `mlp`, `pos`) in Flax's
sharding metadata; `dalle_ablate.parallel` maps them to mesh axes. Nothing here knows a mesh.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dalle_ablate.registry import Registry


def smelu(x: jax.Array, beta: float = 1.0) -> jax.Array:
    """SmeLU (Shamir et al. 2020, arXiv 2010.09458) of half-width beta: 0 for x <= -beta,
    (x + beta)^2 / (4 beta) for |x| < beta, x for x >= beta. Its derivative, which autodiff takes
    branch by branch, is 0, (x + beta) / (2 beta), 1; value and slope are continuous at the joins.
    (dalle-mini returned 0.25 below -beta and a slope of 1 everywhere: not copied.)"""
    quad = jnp.square(x + beta) / (4.0 * beta)
    return jnp.where(x <= -beta, jnp.zeros_like(x), jnp.where(x >= beta, x, quad))


# name -> factory(model cfg) -> activation function
ACTIVATIONS: Registry[Callable[..., Callable[[jax.Array], jax.Array]]] = Registry("activation", "model.activation")
ACTIVATIONS.register("gelu", lambda cfg: lambda x: jax.nn.gelu(x, approximate=cfg.gelu_approximate))
ACTIVATIONS.register("swish", lambda cfg: jax.nn.silu)  # swish with beta = 1 is SiLU (arXiv 1710.05941)
ACTIVATIONS.register("relu", lambda cfg: jax.nn.relu)
ACTIVATIONS.register("smelu", lambda cfg: lambda x: smelu(x, cfg.smelu_beta))

NORMS: Registry[str] = Registry("norm", "model.norm")
NORMS.register("layernorm", "layernorm")
NORMS.register("rmsnorm", "rmsnorm")


def dense(
    din: int, dout: int, axes: tuple[str, str], cfg, rngs: nnx.Rngs, gain: float = 1.0, bias: Optional[bool] = None
) -> nnx.Linear:
    """A Linear layer initialised N(0, (init_std * gain)^2); gain carries DeepNet's beta."""
    use_bias = cfg.bias if bias is None else bias
    return nnx.Linear(
        din,
        dout,
        use_bias=use_bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        kernel_init=nnx.with_partitioning(nnx.initializers.normal(cfg.init_std * gain), axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


def in_float32(layer: nnx.Embed | nnx.Linear, x: jax.Array) -> jax.Array:
    """`layer(x)` computed in float32 whatever the model's compute dtype: an embedding lookup of
    ids x, or a Linear layer on x. Per-resblock gradient scaling runs the parameters outside every
    block this way, following DALL·E's guidelines for 16-bit training (arXiv 2102.12092,
    appendix D: embeddings and unembeddings with 32-bit gradients, logits computed in 32-bit):
    their gradients meet no 16-bit cast, so they need no scale of their own."""
    if isinstance(layer, nnx.Embed):
        return jnp.take(layer.embedding[...], x, axis=0)
    y = jnp.dot(x.astype(jnp.float32), layer.kernel[...], precision=layer.precision)
    return y if layer.bias is None else y + layer.bias[...]


class Norm(nnx.Module):
    """LayerNorm (eps 1e-5, keeps its bias) or RMSNorm (no bias), computed in float32 whatever the
    compute dtype, output cast back to the input dtype."""

    def __init__(self, dim: int, cfg, use_scale: bool, rngs: nnx.Rngs, axis: str = "embed"):
        kind = NORMS.get(cfg.norm)
        common = dict(
            epsilon=cfg.ln_eps,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            use_scale=use_scale,
            scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (axis,)),
            rngs=rngs,
        )
        if kind == "layernorm":
            self.norm = nnx.LayerNorm(
                dim, use_bias=True, bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axis,)), **common
            )
        else:
            self.norm = nnx.RMSNorm(dim, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(x.astype(jnp.float32)).astype(x.dtype)


def dropout(rate: float, rngs: Optional[nnx.Rngs]):
    """A dropout function: identity without rngs (eval, sampling) or at rate 0."""
    layer = nnx.Dropout(rate)
    return lambda x: layer(x, deterministic=rngs is None, rngs=rngs) if rate > 0 else x


class FeedForward(nnx.Module):
    """Dense FFN `W_o act(W_i x)` or GLU `W_o (act(W_g x) * W_v x)` (Shazeer 2020, arXiv 2002.05202);
    `mid_norm` sits after the activation or GLU product (NormFormer, Sub-LN). `gain` scales every
    kernel's init (DeepNet's beta, Magneto's gamma)."""

    def __init__(self, cfg, rngs: nnx.Rngs, mid_norm: Optional[Norm], gain: float = 1.0):
        d, f = cfg.d_model, cfg.ffn_dim
        self.act = ACTIVATIONS.get(cfg.activation)(cfg)
        self.activation_dropout = cfg.activation_dropout
        self.wi = dense(d, f, ("embed", "mlp"), cfg, rngs, gain)
        self.wv = dense(d, f, ("embed", "mlp"), cfg, rngs, gain) if cfg.glu else None
        self.mid_norm = mid_norm
        self.wo = dense(f, d, ("mlp", "embed"), cfg, rngs, gain)

    def __call__(self, x: jax.Array, rngs: Optional[nnx.Rngs] = None) -> jax.Array:
        h = self.act(self.wi(x))
        if self.wv is not None:
            h = h * self.wv(x)
        h = dropout(self.activation_dropout, rngs)(h)
        if self.mid_norm is not None:
            h = self.mid_norm(h)
        return self.wo(h)
