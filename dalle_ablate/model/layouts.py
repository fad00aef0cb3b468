"""Layouts: where the norms sit around each sublayer (VARIANTS.md, "Layouts").

A layout is one `Layout` entry in the LAYOUTS registry; `Sublayer` applies it to any sublayer
(self-attention, cross-attention, FFN). Adding a layout means registering one entry here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import jax
from flax import nnx

from dalle_ablate.model.layers import Norm
from dalle_ablate.registry import ConfigError, Registry


@dataclass(frozen=True)
class Layout:
    pre: bool  # LN on the sublayer input: x + f(LN(x))
    attn_post: bool  # LN on the attention output before the residual add
    ffn_post: bool  # LN on the FFN output before the residual add
    ffn_mid: bool  # LN inside the FFN after the activation (NormFormer)
    post_residual: bool  # LN(alpha x + f(x)) (Post-LN, DeepNet)
    deepnet: bool = False  # alpha residual scaling and beta init (arXiv 2203.00555)
    final_norm: bool = True  # whether a final norm is meaningful (not after a post-residual norm)
    doc: str = ""


LAYOUTS: Registry[Layout] = Registry("layout", "model")

LAYOUTS.register("preln", Layout(pre=True, attn_post=False, ffn_post=False, ffn_mid=False, post_residual=False,
                                 doc="x + f(LN(x))"))
LAYOUTS.register("normformer", Layout(pre=True, attn_post=True, ffn_post=False, ffn_mid=True, post_residual=False,
                                      doc="NormFormer, arXiv 2110.09456: x + LN(attn(LN(x))), x + W2 LN(act(W1 LN(x)))"))
LAYOUTS.register("deepnet", Layout(pre=False, attn_post=False, ffn_post=False, ffn_mid=False, post_residual=True,
                                   deepnet=True, final_norm=False,
                                   doc="DeepNet, arXiv 2203.00555: LN(alpha x + f(x)), beta-scaled init"))


def deepnet_constants(n_enc: int, n_dec: int) -> dict[str, tuple[float, float]]:
    """(alpha, beta) per stack for an encoder-decoder of N encoder and M decoder layers
    (Wang et al. 2022, arXiv 2203.00555, Table 1; encoder-decoder rows)."""
    n, m = n_enc, n_dec
    return {
        "encoder": (0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)),
        "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25),
    }


def stack_constants(cfg, stack: str) -> tuple[float, float]:
    """(residual alpha, init gain beta) of one stack under cfg's layout; (1, 1) unless DeepNet."""
    if LAYOUTS.get(cfg.layout).deepnet:
        return deepnet_constants(cfg.encoder_layers, cfg.decoder_layers)[stack]
    return 1.0, 1.0


class Sublayer(nnx.Module):
    """A residual sublayer under a layout. `kind` is "attn" or "ffn"; the wrapped function is
    called on the (possibly normed) input."""

    def __init__(self, layout: Layout, kind: str, cfg, alpha: float, rngs: nnx.Rngs):
        d = cfg.d_model
        # Norm scale rule (DALL·E Mega): a norm feeding a Dense layer has no learned scale unless
        # force_ln_scale; norms on the branch output or the residual stream keep theirs.
        self.pre = Norm(d, cfg, cfg.force_ln_scale, rngs) if layout.pre else None
        post = layout.attn_post if kind == "attn" else layout.ffn_post
        self.post = Norm(d, cfg, True, rngs) if post else None
        self.res_norm = Norm(d, cfg, True, rngs) if layout.post_residual else None
        self.alpha = alpha

    def __call__(self, x: jax.Array, f: Callable[[jax.Array], jax.Array]) -> jax.Array:
        y = f(self.pre(x) if self.pre is not None else x)
        if self.post is not None:
            y = self.post(y)
        if self.res_norm is not None:
            return self.res_norm(self.alpha * x + y)
        return x + y


def mid_norm(layout: Layout, cfg, rngs: nnx.Rngs) -> Optional[Norm]:
    """NormFormer's FFN norm: it feeds W2, so it has no learned scale unless force_ln_scale."""
    return Norm(cfg.ffn_dim, cfg, cfg.force_ln_scale, rngs, axis="mlp") if layout.ffn_mid else None


def check_layout(cfg) -> None:
    layout = LAYOUTS.get(cfg.layout)
    if not layout.final_norm:
        for flag in ("final_ln_encoder", "final_ln_decoder"):
            if getattr(cfg, flag):
                raise ConfigError(
                    f"model.{flag}=true conflicts with model.layout={cfg.layout}: its blocks already end in a "
                    f"norm (set model.{flag}=false)"
                )
    if layout.pre and not cfg.final_ln_decoder:
        raise ConfigError(
            f"model.final_ln_decoder=false conflicts with model.layout={cfg.layout}: pre-norm decoders need "
            "their final norm (the DALL·E mini study found training unstable without it)"
        )
    if math.isclose(cfg.init_std, 0.0) or cfg.init_std < 0:
        raise ConfigError(f"model.init_std={cfg.init_std} must be positive")
