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

ACTIVATIONS: Registry[Callable[[jax.Array], jax.Array]] = Registry("activation", "model.activation")
ACTIVATIONS.register("gelu", lambda x: jax.nn.gelu(x, approximate=False))
ACTIVATIONS.register("swish", jax.nn.silu)  # swish with beta = 1 is SiLU (arXiv 1710.05941)
ACTIVATIONS.register("relu", jax.nn.relu)

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


class Attention(nnx.Module):
    """Multi-head attention. `gain` scales the init of the value and output projections (DeepNet's
    beta); q and k keep the plain init. `head_scale` is NormFormer's learned per-head scale."""

    def __init__(self, cfg, rngs: nnx.Rngs, gain: float = 1.0):
        d, h = cfg.d_model, cfg.heads
        self.heads = h
        self.q = dense(d, d, ("embed", "heads"), cfg, rngs)
        self.k = dense(d, d, ("embed", "heads"), cfg, rngs)
        self.v = dense(d, d, ("embed", "heads"), cfg, rngs, gain)
        self.o = dense(d, d, ("heads", "embed"), cfg, rngs, gain)
        self.head_scale = (
            nnx.Param(nnx.with_partitioning(nnx.initializers.ones_init(), ("heads",))(rngs.params(), (h,)))
            if cfg.head_scale
            else None
        )

    def __call__(self, x: jax.Array, kv: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
        b, t, d = x.shape
        split = lambda y: y.reshape(y.shape[0], y.shape[1], self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(kv)), split(self.v(kv))
        # Logits and softmax are computed in float32 by jax.nn.dot_product_attention (XLA path).
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)
        if self.head_scale is not None:
            out = out * self.head_scale[...].astype(out.dtype)[:, None]
        return self.o(out.reshape(b, t, d))


class FeedForward(nnx.Module):
    """Dense FFN `W_o act(W_i x)` or GLU `W_o (act(W_g x) * W_v x)` (Shazeer 2020, arXiv 2002.05202);
    `mid_norm` sits after the activation (NormFormer). `gain` scales every kernel's init (DeepNet)."""

    def __init__(self, cfg, rngs: nnx.Rngs, mid_norm: Optional[Norm], gain: float = 1.0):
        d, f = cfg.d_model, cfg.ffn_dim
        self.act = ACTIVATIONS.get(cfg.activation)
        self.wi = dense(d, f, ("embed", "mlp"), cfg, rngs, gain)
        self.wv = dense(d, f, ("embed", "mlp"), cfg, rngs, gain) if cfg.glu else None
        self.mid_norm = mid_norm
        self.wo = dense(f, d, ("mlp", "embed"), cfg, rngs, gain)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.act(self.wi(x))
        if self.wv is not None:
            h = h * self.wv(x)
        if self.mid_norm is not None:
            h = self.mid_norm(h)
        return self.wo(h)
