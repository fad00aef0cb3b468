"""Layouts: where the norms sit around each sublayer (docs/variants.md, "Layouts").

A layout is one `Layout` entry in the LAYOUTS registry; `Sublayer` applies it to any sublayer
(self-attention, cross-attention, FFN) and `stack_gains` gives its init gains and residual scale.
Adding a layout means registering one entry here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dalle_ablate.model.grad_scale import BlockScale, branch_input, branch_output
from dalle_ablate.model.layers import Norm, dropout
from dalle_ablate.registry import ConfigError, Registry


@dataclass(frozen=True)
class Layout:
    pre: bool  # LN on the sublayer input: x + f(LN(x))
    attn_post: bool  # LN on the attention output before the residual add
    ffn_post: bool  # LN on the FFN output before the residual add
    ffn_mid: bool  # LN inside the FFN after the activation (NormFormer, Sub-LN)
    post_residual: bool  # LN(alpha x + f(x)) (Post-LN, DeepNet)
    attn_sub: bool = False  # LN inside attention before W_o (Sub-LN)
    deepnet: bool = False  # alpha residual scaling and beta init (arXiv 2203.00555)
    magneto: bool = False  # Magneto init gains (arXiv 2210.06423)
    swin: bool = False  # Swin v2: res-post-norm and a residual-stream norm every swin_ln_every layers
    doc: str = ""

    @property
    def final_norm(self) -> bool:
        """A final norm is meaningless after blocks that already end in a norm."""
        return not self.post_residual


LAYOUTS: Registry[Layout] = Registry("layout", "model")
LAYOUTS.register(
    "preln",
    Layout(pre=True, attn_post=False, ffn_post=False, ffn_mid=False, post_residual=False, doc="Pre-LN: x + f(LN(x))"),
)
LAYOUTS.register(
    "postln",
    Layout(
        pre=False,
        attn_post=False,
        ffn_post=False,
        ffn_mid=False,
        post_residual=True,
        doc="Post-LN (Vaswani et al. 2017): LN(x + f(x))",
    ),
)
LAYOUTS.register(
    "deepnet",
    Layout(
        pre=False,
        attn_post=False,
        ffn_post=False,
        ffn_mid=False,
        post_residual=True,
        deepnet=True,
        doc="DeepNet, arXiv 2203.00555: LN(alpha x + f(x)), beta-scaled init",
    ),
)
LAYOUTS.register(
    "normformer",
    Layout(
        pre=True,
        attn_post=True,
        ffn_post=False,
        ffn_mid=True,
        post_residual=False,
        doc="NormFormer, arXiv 2110.09456: x + LN(attn(LN(x))), x + W2 LN(act(W1 LN(x)))",
    ),
)
LAYOUTS.register(
    "sandwich",
    Layout(
        pre=True,
        attn_post=True,
        ffn_post=True,
        ffn_mid=False,
        post_residual=False,
        doc="Sandwich-LN (CogView, arXiv 2105.13290): x + LN(f(LN(x)))",
    ),
)
LAYOUTS.register(
    "swinv2",
    Layout(
        pre=False,
        attn_post=True,
        ffn_post=True,
        ffn_mid=False,
        post_residual=False,
        swin=True,
        doc="Swin v2 res-post-norm, arXiv 2111.09883: x + LN(f(x))",
    ),
)
LAYOUTS.register(
    "subln",
    Layout(
        pre=True,
        attn_post=False,
        ffn_post=False,
        ffn_mid=True,
        post_residual=False,
        attn_sub=True,
        magneto=True,
        doc="Sub-LN / Magneto, arXiv 2210.06423: x + W_o LN(attn(LN(x))), x + W2 LN(act(W1 LN(x)))",
    ),
)


class Gains(NamedTuple):
    alpha: float = 1.0  # residual scale
    attn: float = 1.0  # init gain of self-attention v and o
    cross: float = 1.0  # init gain of cross-attention v and o
    ffn: float = 1.0  # init gain of every FFN kernel


def deepnet_constants(n_enc: int, n_dec: int) -> dict[str, tuple[float, float]]:
    """(alpha, beta) per stack of an encoder-decoder with N encoder and M decoder layers
    (Wang et al. 2022, arXiv 2203.00555, Table 1, encoder-decoder rows)."""
    n, m = n_enc, n_dec
    return {
        "encoder": (0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)),
        "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25),
    }


def magneto_gains(n_enc: int, n_dec: int) -> dict[str, float]:
    """Magneto's init gain gamma per stack of an encoder-decoder (Wang et al. 2022,
    arXiv 2210.06423, Sec. 3): encoder sqrt(ln(3M) ln(2N) / 3), decoder sqrt(ln(3M))."""
    n, m = n_enc, n_dec
    return {"encoder": math.sqrt(math.log(3 * m) * math.log(2 * n) / 3), "decoder": math.sqrt(math.log(3 * m))}


def decoder_only_gains(n: int) -> tuple[float, float, float]:
    """(alpha, beta, gamma) of a decoder-only stack of N layers: DeepNet's (2N)^(1/4) and
    (8N)^(-1/4) (arXiv 2203.00555, Table 1) and Magneto's sqrt(ln 2N) (arXiv 2210.06423, Sec. 3)."""
    return (2 * n) ** 0.25, (8 * n) ** -0.25, math.sqrt(math.log(2 * n))


def stack_gains(cfg, stack: str) -> Gains:
    """Gains of one stack: `encoder` or `decoder` of an encoder-decoder, or `decoder_only` (a
    single-stream model of `cfg.depth` layers)."""
    layout = LAYOUTS.get(cfg.layout)
    if stack == "decoder_only":
        alpha, beta, gamma = decoder_only_gains(cfg.depth)
    else:
        alpha, beta = deepnet_constants(cfg.encoder_layers, cfg.decoder_layers)[stack]
        gamma = magneto_gains(cfg.encoder_layers, cfg.decoder_layers)[stack]
    if layout.deepnet:  # beta on v, o and FFN kernels; cross-attention uses the decoder's beta
        return Gains(alpha, beta, beta, beta)
    if layout.magneto:  # gamma on FFN kernels and self-attention v, o only
        return Gains(1.0, gamma, 1.0, gamma)
    return Gains()


class Sublayer(nnx.Module):
    """A residual sublayer under a layout. `kind` is "attn" or "ffn"; the wrapped function is
    called on the (possibly normed) input; residual dropout sits on the branch output."""

    # Submodules on the residual stream, not in the branch: with per-resblock gradient scaling
    # they run on the float32 stream outside the branch's two edges (DALL·E, arXiv 2102.12092,
    # figure 4: the identity path's activations and gradients are 32-bit), so their gradients
    # are never multiplied by the block's scale (train/grad_scaling.py does not divide them).
    STREAM = ("res_norm",)

    def __init__(self, layout: Layout, kind: str, cfg, alpha: float, rngs: nnx.Rngs):
        d = cfg.d_model
        # Norm scale rule (DALL·E Mega): a norm feeding a Dense layer has no learned scale unless
        # force_ln_scale; norms on the branch output or the residual stream keep theirs.
        self.pre = Norm(d, cfg, cfg.force_ln_scale, rngs) if layout.pre else None
        post = layout.attn_post if kind == "attn" else layout.ffn_post
        self.post = Norm(d, cfg, True, rngs) if post else None
        self.res_norm = Norm(d, cfg, True, rngs) if layout.post_residual else None
        self.alpha = alpha
        self.rate = cfg.dropout
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(
        self,
        x: jax.Array,
        f: Callable[[jax.Array], jax.Array],
        rngs: Optional[nnx.Rngs] = None,
        scale: Optional[BlockScale] = None,
    ) -> jax.Array:
        """x + branch(x) under the layout. With a `scale` (per-resblock gradient scaling) x is the
        float32 residual stream and the branch runs in the compute dtype between the scale's
        two edges (model/grad_scale.py)."""
        h = x if scale is None else branch_input(x, scale.scale, scale.probe_in, self.dtype)
        y = f(self.pre(h) if self.pre is not None else h)
        if self.post is not None:
            y = self.post(y)
        y = dropout(self.rate, rngs)(y)
        if scale is not None:
            y = branch_output(y, scale.scale, scale.probe_out)
        if self.res_norm is not None:  # on the stream (STREAM): float32 in, float32 out when scaled
            return self.res_norm(self.alpha * x + y)
        return x + y


def mid_norm(layout: Layout, cfg, rngs: nnx.Rngs) -> Optional[Norm]:
    """The FFN's inner norm (NormFormer, Sub-LN): it feeds W2, so no learned scale unless
    force_ln_scale."""
    return Norm(cfg.ffn_dim, cfg, cfg.force_ln_scale, rngs, axis="mlp") if layout.ffn_mid else None


def stream_norms(cfg, n_layers: int, rngs: nnx.Rngs) -> list[Optional[Norm]]:
    """Swin v2's norm on the residual stream after every swin_ln_every-th layer, not the last."""
    every = cfg.swin_ln_every if LAYOUTS.get(cfg.layout).swin else None
    return [
        Norm(cfg.d_model, cfg, True, rngs) if every and (i + 1) % every == 0 and i + 1 < n_layers else None
        for i in range(n_layers)
    ]


def check_layout(cfg) -> None:
    layout = LAYOUTS.get(cfg.layout)
    if not layout.final_norm:
        for flag in ("final_ln_encoder", "final_ln_decoder"):
            if getattr(cfg, flag):
                raise ConfigError(
                    f"model.{flag}=true conflicts with model.layout={cfg.layout}: its blocks already end in a "
                    f"norm (set model.{flag}=false)"
                )
    if layout.pre and not cfg.final_ln_decoder and cfg.require_final_ln_decoder:
        raise ConfigError(
            f"model.final_ln_decoder=false conflicts with model.layout={cfg.layout}: pre-norm decoders need "
            "their final norm (the DALL·E mini study found training unstable without it; to test that, also set "
            "model.require_final_ln_decoder=false)"
        )
    if cfg.swin_ln_every is not None and not layout.swin:
        raise ConfigError(
            f"model.swin_ln_every={cfg.swin_ln_every} conflicts with model.layout={cfg.layout}: it is Swin v2's "
            "(use model=swinv2, or set model.swin_ln_every=null)"
        )
    if cfg.swin_ln_every is not None and cfg.swin_ln_every < 1:
        raise ConfigError(f"model.swin_ln_every={cfg.swin_ln_every} must be >= 1 or null")
