"""The single-stream family (OpenAI's DALL·E, Ramesh et al. 2021, arXiv 2102.12092): one causal
transformer over the text tokens followed by the image tokens, with sparse attention over the
image grid (model/masks.py).

- The stream: `text_len` text positions, then the image codes in raster order. The input is the
  stream without its last code; position j predicts token j + 1, so the last text position
  predicts the first code and the text head predicts text positions 1 .. text_len - 1.
- Padding as DALL·E does it (section 2.2): each text position i has its own learned padding token
  `pad_i` (row text_vocab + i of the text embedding), so an empty slot says where it is. Padding
  is part of the stream: image tokens attend to it and the text loss predicts it.
- Separate text and image embeddings; text positions are learned, image positions are a learned
  row embedding plus a learned column embedding of the grid.
- Loss: the text and image cross-entropies, each a mean over its own positions, weighted
  `text_loss_weight` and 1 - `text_loss_weight` (the paper's 1/8 and 7/8).
- Layers are the seq2seq family's self-attention layer (`EncoderLayer`) with decoder-only gains,
  so every layout flag (norms, activation, GLU, init, dropout, remat, scan) means the same here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dalle_ablate.model.attention import at_position
from dalle_ablate.model.config import FAMILIES, ModelConfig
from dalle_ablate.model.family import family
from dalle_ablate.model.layers import Norm, dense, dropout
from dalle_ablate.model.layouts import stream_norms
from dalle_ablate.model.masks import grid_side, image_pairs, layer_patterns, stream_mask
from dalle_ablate.model.grad_scale import BlockScale
from dalle_ablate.model.seq2seq import NEG_INF, EncoderLayer, embed, outside, padded, run_stack
from dalle_ablate.registry import ConfigError


@dataclass
class SingleStreamConfig(ModelConfig):
    """`model=dalle`. The size presets' encoder_layers + decoder_layers give the depth unless
    `layers` is set (so `size=small` means the same depth budget in both families)."""

    RANGES = {"text_loss_weight": "[0, 1]", "conv_kernel": "[1, inf)", "layers": "[1, inf) or null"}
    blank_is_padding = True

    family: str = "single_stream"  # OpenAI's DALL·E: one decoder over the text and image tokens
    layers: Optional[int] = None  # decoder layers; null = encoder_layers + decoder_layers (the size preset's budget)
    attention_pattern: str = "dalle"  # dalle | dense | row | column | conv | comma-separated cycle
    conv_kernel: int = 11  # side of the convolutional pattern's causal neighbourhood (paper: 11)
    text_loss_weight: float = 0.125  # the paper's 1/8 (image 7/8)

    @property
    def depth(self) -> int:
        return self.layers if self.layers is not None else self.encoder_layers + self.decoder_layers

    def loss_weights(self) -> dict[str, float]:
        return {"text": self.text_loss_weight, "image": 1.0 - self.text_loss_weight}

    def validate(self, run=None) -> None:
        super().validate(run)
        layer_patterns(self.attention_pattern, self.depth)
        if self.conv_kernel % 2 == 0:
            raise ConfigError(
                f"model.conv_kernel={self.conv_kernel} must be odd (a neighbourhood centred on its column)"
            )
        if self.position_bias:
            raise ConfigError(
                "model.position_bias=true is the seq2seq decoder's Swin v2 bias; model.family=single_stream "
                "has row and column position embeddings (set model.position_bias=false)"
            )
        if self.image_len is not None:
            g = grid_side(self.image_len)
            if self.conv_kernel // 2 >= g:
                raise ConfigError(
                    f"model.conv_kernel={self.conv_kernel} is wider than the {g}x{g} image grid "
                    f"allows; at most {2 * g - 1}"
                )


class StreamCache(NamedTuple):
    """Decoding state: per layer its cache ({"attn": KVCache}: the keys and values [B, L, H, D]
    of the stream so far), and the embedded last text position [B, 1, d], the input that
    predicts the first code."""

    layers: tuple
    first: jax.Array


# -- cost accounting -----------------------------------------------------------------------------
# Every formula the cost accounting reads of this family, from its config alone (see Seq2SeqCosts):
# one stack of self-attention layers over L = T + I - 1 positions, the attention counted over the
# full square as computed.


class SingleStreamCosts:
    @staticmethod
    def forward_flops(cfg) -> int:
        d, f, n = cfg.d_model, cfg.ffn_dim, cfg.text_len + cfg.image_len - 1
        layer = 4 * n * d * d + 2 * n * n * d + (3 if cfg.glu else 2) * n * d * f
        return 2 * (cfg.depth * layer + SingleStreamCosts.logit_elements(cfg) * d)

    @staticmethod
    def logit_elements(cfg) -> int:
        m = cfg.vocab_pad_multiple
        return cfg.image_len * padded(cfg.image_vocab, m) + (cfg.text_len - 1) * padded(
            cfg.text_vocab + cfg.text_len, m
        )

    @staticmethod
    def activation_elements(cfg, t: int) -> dict[str, float]:
        d, h, f, n = cfg.d_model, cfg.heads, cfg.ffn_dim, cfg.text_len + cfg.image_len - 1
        layer = n * (6 * d + (4 * d + 2 * h * n + (4 if cfg.glu else 2) * f) / t)
        dots = n * (3 * d + (4 * d + h * n + (2 if cfg.glu else 1) * f) / t)
        return {"none": cfg.depth * layer, "dots_saveable": cfg.depth * dots, "full": cfg.depth * n * d + layer}

    @staticmethod
    def model_axis_reductions(cfg) -> int:
        n = cfg.text_len + cfg.image_len - 1
        return 2 * (cfg.depth * 2 * n * cfg.d_model + n * cfg.d_model)

    @staticmethod
    def attention_pairs(cfg) -> dict[str, int]:
        """(query, key) pairs one example's attention covers, summed over layers: the full square
        (what a dense kernel computes), the causal triangle, and the pattern's masks."""
        n, g = cfg.text_len + cfg.image_len - 1, grid_side(cfg.image_len)
        pattern = sum(
            int(stream_mask(p, cfg.text_len, g, cfg.conv_kernel)[:n, :n].sum())
            for p in layer_patterns(cfg.attention_pattern, cfg.depth)
        )
        return {"square": cfg.depth * n * n, "causal": cfg.depth * n * (n + 1) // 2, "pattern": pattern}


# -- the family ----------------------------------------------------------------------------------


@FAMILIES.option("single_stream", SingleStreamConfig)
@family
class SingleStream(nnx.Module):
    bos_id: int  # what the sampler reads (model/family.py: Family)
    image_vocab: int
    logit_rows: int

    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        d, m = cfg.d_model, cfg.vocab_pad_multiple
        self.grid = grid_side(cfg.image_len)
        self.image_vocab = cfg.image_vocab
        self.bos_id = 0  # the sampler's first input; unused: the last text position predicts code 0
        self.text_rows = cfg.text_vocab + cfg.text_len  # the vocabulary, then pad_0 .. pad_{T-1}
        self.logit_rows = padded(cfg.image_vocab, m)
        self.text_embed = embed(padded(self.text_rows, m), d, ("vocab", "embed"), cfg, rngs)
        self.text_pos = embed(cfg.text_len, d, ("pos", "embed"), cfg, rngs)
        self.image_embed = embed(self.logit_rows, d, ("vocab", "embed"), cfg, rngs)
        self.image_row = embed(self.grid, d, ("pos", "embed"), cfg, rngs)
        self.image_col = embed(self.grid, d, ("pos", "embed"), cfg, rngs)
        self.decoder = nnx.List([EncoderLayer(cfg, rngs, stack="decoder_only") for _ in range(cfg.depth)])
        self.decoder_stream_norms = nnx.List(stream_norms(cfg, cfg.depth, rngs))
        self.decoder_norm = Norm(d, cfg, cfg.force_ln_scale, rngs) if cfg.final_ln_decoder else None
        self.text_head = dense(d, padded(self.text_rows, m), ("embed", "vocab"), cfg, rngs, bias=False)
        self.lm_head = dense(d, self.logit_rows, ("embed", "vocab"), cfg, rngs, bias=False)
        self.patterns = layer_patterns(cfg.attention_pattern, cfg.depth)
        self.embed_scale = math.sqrt(d) if cfg.scale_embedding else 1.0

    def masks(self) -> list[np.ndarray]:
        """Each layer's [L, L] mask over the whole stream (shared arrays, one per pattern)."""
        return [stream_mask(p, self.cfg.text_len, self.grid, self.cfg.conv_kernel) for p in self.patterns]

    def text_ids(self, text: jax.Array, text_mask: jax.Array) -> jax.Array:
        """The text stream: real tokens where the mask says so, `pad_i` in every empty slot i."""
        return jnp.where(text_mask, text, self.cfg.text_vocab + jnp.arange(text.shape[1]))

    def encode(self, text: jax.Array, text_mask: jax.Array, f32: bool = False) -> jax.Array:
        """The embedded text stream [B, T, d] (computed in float32 if `f32`)."""
        x = outside(self.text_embed, self.text_ids(text, text_mask), f32) * self.embed_scale
        return x + outside(self.text_pos, jnp.arange(text.shape[1]), f32)[None]

    def embed_codes(self, codes: jax.Array, first: jax.Array, f32: bool = False) -> jax.Array:
        """Codes [B, n] at image positions first .. first + n - 1, embedded with their row and column."""
        pos = first + jnp.arange(codes.shape[1])
        where = outside(self.image_row, pos // self.grid, f32) + outside(self.image_col, pos % self.grid, f32)
        return outside(self.image_embed, codes, f32) * self.embed_scale + where[None]

    def hidden(
        self, text, text_mask, codes, rngs: Optional[nnx.Rngs], scales: Optional[BlockScale] = None
    ) -> jax.Array:
        """Final states [B, T + I - 1, d] of the teacher-forced stream."""
        # per-resblock scaling: embeddings in float32 (appendix D), the residual stream float32
        f32 = scales is not None
        x = jnp.concatenate([self.encode(text, text_mask, f32), self.embed_codes(codes[:, :-1], 0, f32)], axis=1)
        x = dropout(self.cfg.dropout, rngs)(x)
        n = x.shape[1]
        masks = np.stack([m[:n, :n] for m in self.masks()])[:, None, None]  # [layers, 1, 1, L, L]
        x = run_stack(
            self.decoder,
            self.decoder_stream_norms,
            x,
            rngs,
            remat=self.cfg.remat,
            scan=self.cfg.scan_layers,
            per_layer=masks,
            scales=scales,
        )
        return self.decoder_norm(x) if self.decoder_norm is not None else x

    def image_logits(self, h: jax.Array, f32: bool = False) -> jax.Array:
        logits = outside(self.lm_head, h, f32).astype(jnp.float32)
        return jnp.where(jnp.arange(self.logit_rows) < self.image_vocab, logits, NEG_INF)

    STACKS = {"decoder": EncoderLayer}  # stacks of residual blocks (per-resblock gradient scaling)
    COSTS = SingleStreamCosts

    def __call__(self, text, text_mask, codes, dropout_key: Optional[jax.Array] = None) -> jax.Array:
        """Teacher-forced image logits [B, I, logit_rows] (what caption scores and the eval loss read)."""
        rngs = nnx.Rngs(dropout=dropout_key) if dropout_key is not None else None
        return self.image_logits(self.hidden(text, text_mask, codes, rngs)[:, text.shape[1] - 1 :])

    def nll(
        self,
        text,
        text_mask,
        codes,
        dropout_key: Optional[jax.Array] = None,
        grad_scales: Optional[dict[str, BlockScale]] = None,
    ) -> dict[str, jax.Array]:
        """Per-token NLL of both streams: text [B, T - 1] (padding included) and image [B, I];
        `grad_scales` ({"decoder": BlockScale [layers, branches]}) scales each block's gradients."""
        rngs = nnx.Rngs(dropout=dropout_key) if dropout_key is not None else None
        t = text.shape[1]
        scales = (grad_scales or {}).get("decoder")
        f32 = scales is not None  # per-resblock scaling: the heads in float32 (appendix D)
        h = self.hidden(text, text_mask, codes, rngs, scales)
        text_logits = outside(self.text_head, h[:, : t - 1], f32).astype(jnp.float32)
        text_logits = jnp.where(jnp.arange(text_logits.shape[-1]) < self.text_rows, text_logits, NEG_INF)
        ce = optax.softmax_cross_entropy_with_integer_labels
        return {
            "text": ce(text_logits, self.text_ids(text, text_mask)[:, 1:]),
            "image": ce(self.image_logits(h[:, t - 1 :], f32), codes),
        }

    def start_decoding(self, x_text: jax.Array) -> StreamCache:
        """Run the text prefix (all but its last position) once and keep its keys and values."""
        b, t = x_text.shape[:2]
        empty = tuple(layer.empty_cache(b, t + self.cfg.image_len - 1, prefill=True) for layer in self.decoder)
        x = x_text[:, : t - 1].astype(jnp.dtype(self.cfg.dtype))
        masks = [jnp.asarray(m[: t - 1, : t - 1])[None, None] for m in self.masks()]
        _, layers = run_stack(self.decoder, self.decoder_stream_norms, x, None, per_layer=masks, caches=empty)
        return StreamCache(layers, x_text[:, t - 1 :])

    def decode_step(self, token: jax.Array, pos: jax.Array, cache: StreamCache, text_mask: jax.Array):
        """Logits [B, logit_rows] of code `pos` given code pos - 1 in `token` (ignored at pos 0,
        where the last text position predicts), and the cache with that input added. Token by
        token this equals the teacher-forced logits (tests/model/test_single_stream.py)."""
        t = text_mask.shape[1]
        p = t - 1 + pos  # stream position of this step's input
        code = self.embed_codes(token[:, None], jnp.maximum(pos - 1, 0))
        x = jnp.where(pos == 0, cache.first.astype(code.dtype), code)
        # each layer's mask row at p: the positions this input sees
        visible = [
            jax.lax.dynamic_index_in_dim(jnp.asarray(m[:-1, :-1]), p, keepdims=False)[None, None, None]
            for m in self.masks()
        ]
        x, layers = run_stack(
            self.decoder,
            self.decoder_stream_norms,
            x,
            None,
            per_layer=visible,
            caches=tuple(at_position(c, p) for c in cache.layers),
        )
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.image_logits(x[:, 0]), cache._replace(layers=layers)


__all__ = ["SingleStream", "SingleStreamConfig", "SingleStreamCosts", "StreamCache", "image_pairs"]
