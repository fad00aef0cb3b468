"""Multi-head attention: scaled dot-product (or NormSoftmax's) or Swin v2's cosine attention, optional per-head
scale (NormFormer), Sub-LN norm before the output projection (Magneto), and Swin v2's log-spaced
continuous position bias over the image grid.

Logits, bias, mask and softmax are float32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dalle_ablate.model.layers import Norm, dense, dropout

MASKED = -1e9  # finite: a fully masked row stays NaN-free


def attention_logits(q: jax.Array, k: jax.Array, tau: Optional[jax.Array] = None) -> jax.Array:
    """[B, Tq, H, D] x [B, Tk, H, D] -> [B, H, Tq, Tk] float32 logits.

    tau None: q.k / sqrt(D). Otherwise Swin v2 cosine attention (Liu et al. 2022, arXiv 2111.09883,
    eq. 2): cos(q, k) / tau with tau [H], and no 1/sqrt(D) on top (dalle-mini applied both: a bug).
    """
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if tau is None:
        return jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    unit = lambda y: y * jax.lax.rsqrt(jnp.maximum(jnp.sum(y * y, -1, keepdims=True), 1e-12))  # noqa: E731
    return jnp.einsum("bqhd,bkhd->bhqk", unit(q), unit(k)) / tau[None, :, None, None]


def norm_softmax(logits: jax.Array, mask: Optional[jax.Array]) -> jax.Array:
    """NormSoftmax (Hoffmann et al. 2024, "Eureka-moments in transformers", arXiv 2310.12956; the
    authors' `norm_softmax_std`): the raw q.k divided by min(sqrt(D), their standard deviation over
    the keys a query sees) instead of by sqrt(D). On `logits` = q.k / sqrt(D) that is logits /
    min(1, their std). Where the logits of a row are nearly equal -- attention spread evenly over
    its keys, whose gradients to W_q and W_k vanish and hold the loss on a plateau -- it sharpens
    them; where they already spread, it is the usual scaling. The std is the unbiased one (n - 1)
    over the unmasked keys only, so a causal row counts the keys before it, and a KV cache's row the
    ones filled; a row of one key has std 0, and its softmax is 1 whatever the divisor."""
    valid = jnp.ones(logits.shape, bool) if mask is None else jnp.broadcast_to(mask, logits.shape)
    n = valid.sum(-1, keepdims=True)
    mean = jnp.where(valid, logits, 0.0).sum(-1, keepdims=True) / jnp.maximum(n, 1)
    var = jnp.where(valid, (logits - mean) ** 2, 0.0).sum(-1, keepdims=True) / jnp.maximum(n - 1, 1)
    # sqrt(var + eps^2), not sqrt(var): finite gradients at var = 0 (the one-key row)
    return logits / jnp.minimum(1.0, jnp.sqrt(var + 1e-12))


def grid_offsets(length: int) -> np.ndarray:
    """For `length` image tokens in raster order on a square grid: [L, L, 2] (drow, dcol) of query
    minus key."""
    g = int(round(math.sqrt(length)))
    if g * g != length:
        raise ValueError(f"image length {length} is not a square grid")
    pos = np.stack(np.divmod(np.arange(length), g), axis=-1)
    return pos[:, None, :] - pos[None, :, :]


class PositionBias(nnx.Module):
    """Swin v2's log-spaced continuous position bias: each relative offset (drow, dcol) is mapped to
    sign(d) * log(1 + |d|), then through a 2-layer MLP to one bias per head. It is a function of the
    offset alone, so a KV cache can use it (dalle-mini's full q x k table could not)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(
            2,
            cfg.cpb_hidden,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)),
            rngs=rngs,
        )
        self.fc2 = nnx.Linear(
            cfg.cpb_hidden,
            cfg.heads,
            use_bias=False,
            kernel_init=nnx.with_partitioning(nnx.initializers.normal(cfg.init_std), ("mlp", "heads")),
            rngs=rngs,
        )

    def table(self, offsets: jax.Array) -> jax.Array:
        """[..., 2] integer offsets -> [..., heads] float32 biases."""
        d = offsets.astype(jnp.float32)
        return self.fc2(jax.nn.relu(self.fc1(jnp.sign(d) * jnp.log1p(jnp.abs(d))))).astype(jnp.float32)

    def __call__(self, length: int) -> jax.Array:
        """[H, L, L] bias for `length` image tokens. The MLP runs once per distinct offset."""
        g = int(round(math.sqrt(length)))
        span = np.arange(-(g - 1), g)
        distinct = np.stack(np.meshgrid(span, span, indexing="ij"), -1).reshape(-1, 2)  # [(2g-1)^2, 2]
        values = self.table(jnp.asarray(distinct))  # [(2g-1)^2, H]
        off = grid_offsets(length)
        index = (off[..., 0] + g - 1) * (2 * g - 1) + (off[..., 1] + g - 1)
        return jnp.transpose(values[jnp.asarray(index)], (2, 0, 1))


class KVCache(NamedTuple):
    """One attention's decoding state. `k`, `v` [B, L, H, D]: keys and values of the positions
    cached so far. `pos`: where the next call's tokens go, or None for a fixed cache (cross-
    attention: the encoder's keys and values, computed once, never written); an int when known
    while tracing (a prefill: the queries attend to the filled positions only). `bias`: Swin v2's
    [H, L, L] position-bias table, computed once, or None."""

    k: jax.Array
    v: jax.Array
    pos: Union[int, jax.Array, None] = None
    bias: Optional[jax.Array] = None


def at_position(caches: dict[str, KVCache], pos) -> dict[str, KVCache]:
    """A layer's caches ({attention name: KVCache}) with the next tokens placed at `pos` (the
    fixed caches unchanged)."""
    return {name: c if c.pos is None else c._replace(pos=pos) for name, c in caches.items()}


class Attention(nnx.Module):
    """`gain` scales the init of the value and output projections (DeepNet's beta, Magneto's
    gamma); q and k keep the plain init."""

    def __init__(self, cfg, rngs: nnx.Rngs, gain: float = 1.0, sub_norm: bool = False, position_bias: bool = False):
        d, h = cfg.d_model, cfg.heads
        self.heads = h
        self.q = dense(d, d, ("embed", "heads"), cfg, rngs)
        self.k = dense(d, d, ("embed", "heads"), cfg, rngs)
        self.v = dense(d, d, ("embed", "heads"), cfg, rngs, gain)
        self.o = dense(d, d, ("heads", "embed"), cfg, rngs, gain)
        ones = nnx.with_partitioning(nnx.initializers.constant(1.0), ("heads",))
        self.head_scale = nnx.Param(ones(rngs.params(), (h,))) if cfg.head_scale else None
        self.cosine = cfg.cosine_attention
        self.norm_softmax = cfg.norm_softmax
        self.tau_min = cfg.tau_min
        self.fixed_tau = cfg.tau_init
        tau = nnx.with_partitioning(nnx.initializers.constant(cfg.tau_init), ("heads",))
        self.tau = nnx.Param(tau(rngs.params(), (h,))) if cfg.cosine_attention and cfg.learn_tau else None
        # Sub-LN feeds W_o: no learned scale unless force_ln_scale (the norm scale rule).
        self.sub_norm = Norm(d, cfg, cfg.force_ln_scale, rngs, axis="heads") if sub_norm else None
        self.position_bias = PositionBias(cfg, rngs) if position_bias else None
        self.attention_dropout = cfg.attention_dropout

    def temperature(self) -> Optional[jax.Array]:
        if not self.cosine:
            return None
        if self.tau is None:
            return jnp.full((self.heads,), self.fixed_tau, jnp.float32)
        return jnp.maximum(self.tau[...].astype(jnp.float32), self.tau_min)  # learned, clamped

    def split(self, y: jax.Array) -> jax.Array:
        return y.reshape(y.shape[0], y.shape[1], self.heads, y.shape[2] // self.heads)

    def empty_cache(self, batch: int, length: int, dtype, prefill: bool = False) -> KVCache:
        """A self-attention cache of `length` positions, none filled yet, with this attention's
        position-bias table. Its pos is 0: an int if the first call prefills a prefix, else an
        int32 array (what each decoding step gives back)."""
        empty = jnp.zeros((batch, length, self.heads, self.k.out_features // self.heads), dtype)
        bias = self.position_bias(length) if self.position_bias is not None else None
        return KVCache(empty, empty, 0 if prefill else jnp.zeros((), jnp.int32), bias)

    def fixed_cache(self, kv: jax.Array) -> KVCache:
        """A cross-attention cache: the keys and values of `kv` (the encoder output), computed once."""
        return KVCache(self.split(self.k(kv)), self.split(self.v(kv)))

    def __call__(
        self,
        x: jax.Array,
        kv: Optional[jax.Array] = None,
        mask: Optional[jax.Array] = None,
        rngs: Optional[nnx.Rngs] = None,
        cache: Optional[KVCache] = None,
    ):
        """Queries of x [B, Tq, d] against the keys and values of `kv` (None: x itself) -> [B, Tq, d]:
        training and teacher-forced evaluation (dropout with `rngs`).

        With a `cache` (decoding, no dropout; `kv` unused) -> (output, updated cache). A fixed cache (pos None)
        is attended as it is. Otherwise x's keys and values are written at positions pos .. pos +
        Tq - 1 first; with pos an int (a prefill) the queries see the positions filled so far,
        with a traced pos every cached position under `mask` (None: causal). The position bias,
        if any, is the cache's table at the queries' rows."""
        q = self.split(self.q(x))
        if cache is None:
            kv = x if kv is None else kv
            bias = self.position_bias(x.shape[1]) if self.position_bias is not None else None
            return self._attend(q, self.split(self.k(kv)), self.split(self.v(kv)), mask, bias, rngs)
        if cache.pos is None:
            return self._attend(q, cache.k, cache.v, mask, None, None), cache
        pos, t = cache.pos, x.shape[1]
        k, v = self.split(self.k(x)), self.split(self.v(x))
        keys = jax.lax.dynamic_update_slice_in_dim(cache.k, k.astype(cache.k.dtype), pos, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(cache.v, v.astype(cache.v.dtype), pos, axis=1)
        end = pos + t if isinstance(pos, int) else keys.shape[1]
        if mask is None:
            mask = (jnp.arange(end)[None, :] <= pos + jnp.arange(t)[:, None])[None, None]
        row = None if cache.bias is None else jax.lax.dynamic_slice_in_dim(cache.bias, pos, t, axis=1)[..., :end]
        out = self._attend(q, keys[:, :end], values[:, :end], mask, row, None)
        return out, cache._replace(k=keys, v=values, pos=jnp.asarray(pos + t, jnp.int32))

    def _attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        mask: Optional[jax.Array],
        bias: Optional[jax.Array],
        rngs: Optional[nnx.Rngs],
    ) -> jax.Array:
        """Heads [B, Tq, H, D] against keys and values [B, Tk, H, D] -> [B, Tq, d]. `bias`
        [H, Tq, Tk] or None."""
        b, t = q.shape[:2]
        logits = attention_logits(q, k, self.temperature())
        if self.norm_softmax:
            logits = norm_softmax(logits, mask)
        if bias is not None:
            logits = logits + bias[None]
        if mask is not None:
            logits = jnp.where(mask, logits, MASKED)
        weights = dropout(self.attention_dropout, rngs)(jax.nn.softmax(logits, axis=-1))
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
        if self.head_scale is not None:
            out = out * self.head_scale[...].astype(out.dtype)[:, None]
        out = out.reshape(b, t, -1)
        if self.sub_norm is not None:
            out = self.sub_norm(out)
        return self.o(out)
