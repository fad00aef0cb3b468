"""The seq2seq family (DALL·E mini / Mega): a bidirectional text encoder and a causal image-code
decoder with cross-attention; untied text and image embeddings; learned positions.

Image side (docs/variants.md): decoder input is `[BOS] + codes[:-1]`, labels are the codes; BOS id is
`image_vocab`; embedding and logits rows are padded up to a multiple of `vocab_pad_multiple`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dalle_ablate.model.attention import Attention, KVCache, at_position
from dalle_ablate.model.config import FAMILIES, ModelConfig
from dalle_ablate.model.family import family
from dalle_ablate.model.grad_scale import BlockScale, branch_input
from dalle_ablate.model.layers import FeedForward, Norm, dense, dropout, in_float32
from dalle_ablate.model.layouts import LAYOUTS, Sublayer, mid_norm, stack_gains, stream_norms

NEG_INF = -1e9  # masked logits; finite so that bf16 and softmax stay NaN-free


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def outside(layer, x, float32: bool) -> jax.Array:
    """layer(x), or computed in float32 (`in_float32`): per-resblock gradient scaling runs the
    embeddings and heads, outside every block, that way."""
    return in_float32(layer, x) if float32 else layer(x)


def embed(num: int, dim: int, axes: tuple[str, str], cfg, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(
        num,
        dim,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        embedding_init=nnx.with_partitioning(nnx.initializers.normal(cfg.init_std), axes),
        rngs=rngs,
    )


def attention(layer, name: str, h: jax.Array, kv, mask, rngs, cache: Optional[dict], updated: dict) -> jax.Array:
    """The layer's attention `name` on h: the full forward without a cache; with one (the layer's
    {attention name: KVCache}), decoding against cache[name], its update put in `updated`."""
    attn = getattr(layer, name)
    if cache is None:
        return attn(h, kv, mask, rngs)
    y, updated[name] = attn(h, kv, mask, cache=cache[name])
    return y


class EncoderLayer(nnx.Module):
    """Self-attention and FFN under a layout: the encoder's layer, and (stack `decoder_only`, with
    its gains) every layer of the single-stream family."""

    def __init__(self, cfg, rngs: nnx.Rngs, stack: str = "encoder"):
        layout = LAYOUTS.get(cfg.layout)
        g = stack_gains(cfg, stack)
        self.attn_block = Sublayer(layout, "attn", cfg, g.alpha, rngs)
        self.attn = Attention(cfg, rngs, gain=g.attn, sub_norm=layout.attn_sub)
        self.ffn_block = Sublayer(layout, "ffn", cfg, g.alpha, rngs)
        self.ffn = FeedForward(cfg, rngs, mid_norm(layout, cfg, rngs), gain=g.ffn)
        self.dtype = jnp.dtype(cfg.dtype)

    # The residual branches in order (row i of this layer's BlockScale is branch i's) and the
    # submodules whose parameters each one holds.
    BRANCHES = {"attn": ("attn", "attn_block"), "ffn": ("ffn", "ffn_block")}

    def empty_cache(self, batch: int, length: int, prefill: bool = False) -> dict[str, KVCache]:
        """The layer's decoding cache over `length` positions (see Attention.empty_cache)."""
        return {"attn": self.attn.empty_cache(batch, length, self.dtype, prefill)}

    def __call__(
        self,
        x: jax.Array,
        mask: Optional[jax.Array],
        rngs: Optional[nnx.Rngs] = None,
        scales: Optional[BlockScale] = None,
        cache: Optional[dict[str, KVCache]] = None,
    ):
        """The layer on x [B, T, d] (dropout with `rngs`, per-resblock gradient `scales`). With a
        `cache` (decoding: a prefix prefilled or one new token; no dropout) -> (x, updated cache)."""
        s = (lambda i: None) if scales is None else scales.row
        new = {}
        x = self.attn_block(x, lambda h: attention(self, "attn", h, None, mask, rngs, cache, new), rngs, s(0))
        x = self.ffn_block(x, lambda h: self.ffn(h, rngs), rngs, s(1))
        return x if cache is None else (x, new)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        layout = LAYOUTS.get(cfg.layout)
        g = stack_gains(cfg, "decoder")
        self.self_block = Sublayer(layout, "attn", cfg, g.alpha, rngs)
        self.self_attn = Attention(cfg, rngs, gain=g.attn, sub_norm=layout.attn_sub, position_bias=cfg.position_bias)
        self.cross_block = Sublayer(layout, "attn", cfg, g.alpha, rngs)
        self.cross_attn = Attention(cfg, rngs, gain=g.cross, sub_norm=layout.attn_sub)
        self.ffn_block = Sublayer(layout, "ffn", cfg, g.alpha, rngs)
        self.ffn = FeedForward(cfg, rngs, mid_norm(layout, cfg, rngs), gain=g.ffn)
        self.dtype = jnp.dtype(cfg.dtype)

    BRANCHES = {
        "self_attn": ("self_attn", "self_block"),
        "cross_attn": ("cross_attn", "cross_block"),
        "ffn": ("ffn", "ffn_block"),
    }

    def empty_cache(self, enc: jax.Array, length: int) -> dict[str, KVCache]:
        """The layer's decoding cache: self-attention over `length` image positions, none filled,
        and cross-attention to the encoder output `enc` [B, T, d]."""
        return {
            "self_attn": self.self_attn.empty_cache(enc.shape[0], length, self.dtype),
            "cross_attn": self.cross_attn.fixed_cache(enc),
        }

    def __call__(
        self,
        x,
        enc,
        self_mask,
        cross_mask,
        rngs: Optional[nnx.Rngs] = None,
        scales: Optional[BlockScale] = None,
        cache: Optional[dict[str, KVCache]] = None,
    ):
        """The layer on x [B, I, d] after the encoder output `enc`. With a `cache` (decoding; `enc`
        and `self_mask` unused: the cache holds the encoder's keys and values, and the self-attention
        is causal) -> (x, updated cache)."""
        s = (lambda i: None) if scales is None else scales.row
        new = {}
        x = self.self_block(x, lambda h: attention(self, "self_attn", h, None, self_mask, rngs, cache, new), rngs, s(0))
        if scales is not None:  # the encoder's output enters this branch too: its gradient leaves it unscaled
            enc = branch_input(enc, scales.scale[1], scales.probe_in[1], self.dtype)
        x = self.cross_block(
            x, lambda h: attention(self, "cross_attn", h, enc, cross_mask, rngs, cache, new), rngs, s(1)
        )
        x = self.ffn_block(x, lambda h: self.ffn(h, rngs), rngs, s(2))
        return x if cache is None else (x, new)


class DecodeCache(NamedTuple):
    """What autoregressive decoding keeps between positions: per decoder layer its caches
    ({"self_attn", "cross_attn"}: KVCache), the self-attention's filled up to the current
    position and holding Swin v2's position-bias table, the cross-attention's the encoder
    output's keys and values, computed once."""

    layers: tuple


# Rematerialisation per layer (gradient checkpointing, Chen et al. 2016, arXiv 1604.06174; DALL·E
# Mega checkpointed every layer): `full` keeps only each layer's input and recomputes the rest in
# the backward pass, `dots_saveable` keeps the matmul outputs and recomputes norms, softmax and
# activations.
REMAT_POLICIES = {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}


def _call_layer(layer, x, rngs, scales, *args):
    return layer(x, *args, rngs=rngs, scales=scales)


def _layer_rngs(key, i):
    # Each layer draws its dropout masks from its own key, fold_in(stack key, layer index): the
    # same masks whether the stack is unrolled or scanned.
    return None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, i))


def run_stack(
    layers,
    norms,
    x,
    rngs,
    *args,
    remat: str = "none",
    scan: bool = False,
    per_layer=None,
    scales: Optional[BlockScale] = None,
    caches: Optional[tuple] = None,
):
    """The layers in order on x, each called as layer(x, *args[, its per_layer array]), then its
    stream norm if it has one; `per_layer` has one leading row per layer (the single-stream
    family's mask of each layer), and so do `scales` ([layers, branches]: per-resblock gradient
    scaling, model/grad_scale.py). With `caches` (one per layer: decoding, unrolled, no dropout)
    -> (x, the updated caches)."""
    own = (lambda i: ()) if per_layer is None else (lambda i: (per_layer[i],))
    if caches is not None:
        updated = []
        for i, (layer, norm) in enumerate(zip(layers, norms)):
            x, cache = layer(x, *args, *own(i), cache=caches[i])
            updated.append(cache)
            if norm is not None:
                x = norm(x)
        return x, tuple(updated)
    call = _call_layer if remat == "none" else nnx.remat(_call_layer, policy=REMAT_POLICIES[remat])
    key = rngs.dropout() if rngs is not None else None
    scale_of = (lambda i: None) if scales is None else scales.row
    if scan and len(layers) > 1:
        # One compiled layer scanned over the stack: the per-layer parameters are stacked on the
        # fly, so the parameter tree (checkpoints, sharding rules) is the same as unrolled.
        graphdef = nnx.split(layers[0])[0]
        states = [nnx.split(layer)[1] for layer in layers]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        rows = jnp.arange(len(layers)) if per_layer is None else jnp.asarray(per_layer)

        def body(h, inputs):
            i, state, row, scale = inputs
            return call(
                nnx.merge(graphdef, state), h, _layer_rngs(key, i), scale, *args, *(() if per_layer is None else (row,))
            ), None

        return jax.lax.scan(body, x, (jnp.arange(len(layers)), stacked, rows, scales))[0]
    for i, (layer, norm) in enumerate(zip(layers, norms)):
        x = call(layer, x, _layer_rngs(key, i), scale_of(i), *args, *own(i))
        if norm is not None:  # Swin v2's periodic norm on the residual stream
            x = norm(x)
    return x


# -- cost accounting -----------------------------------------------------------------------------
# Every formula the cost accounting (model/flops.py, parallel/plan.py) reads of this family, from its
# config alone: a sublayer added to a layer adds its terms here and nowhere else.


class Seq2SeqCosts:
    @staticmethod
    def forward_flops(cfg) -> int:
        """Matmul FLOPs of one example's forward pass (conventions in model/flops.py)."""
        d, f, t, i = cfg.d_model, cfg.ffn_dim, cfg.text_len, cfg.image_len
        ffn_mats = 3 if cfg.glu else 2
        enc = cfg.encoder_layers * (4 * t * d * d + 2 * t * t * d + ffn_mats * t * d * f)
        dec_self = 4 * i * d * d + 2 * i * i * d
        dec_cross = 2 * i * d * d + 2 * t * d * d + 2 * i * t * d
        dec = cfg.decoder_layers * (dec_self + dec_cross + ffn_mats * i * d * f)
        head = i * d * padded(cfg.image_vocab + 1, cfg.vocab_pad_multiple)
        return 2 * (enc + dec + head)

    @staticmethod
    def activation_elements(cfg, t: int) -> dict[str, float]:
        """Elements of activations kept per example for the backward pass, by remat policy, with
        the model axis of size t splitting the heads and FFN."""
        d, h, f, T, I = cfg.d_model, cfg.heads, cfg.ffn_dim, cfg.text_len, cfg.image_len
        ffn = (4 if cfg.glu else 2) * f
        ffn_dots = (2 if cfg.glu else 1) * f
        enc = T * (6 * d + (4 * d + 2 * h * T + ffn) / t)
        dec = I * (9 * d + (6 * d + 2 * h * I + 2 * h * T + ffn) / t) + 2 * d * T / t
        enc_dots = T * (3 * d + (4 * d + h * T + ffn_dots) / t)
        dec_dots = I * (4 * d + (6 * d + h * I + h * T + ffn_dots) / t) + 2 * d * T / t
        le, ld = cfg.encoder_layers, cfg.decoder_layers
        inputs = le * T * d + ld * I * d + T * d  # every layer's input, and the encoder output for cross-attention
        return {
            "none": le * enc + ld * dec,
            "dots_saveable": le * enc_dots + ld * dec_dots,
            "full": inputs + max(enc, dec),
        }

    @staticmethod
    def logit_elements(cfg) -> int:
        """Logits of one example: a row over the padded image vocabulary per image token."""
        return cfg.image_len * padded(cfg.image_vocab + 1, cfg.vocab_pad_multiple)

    @staticmethod
    def model_axis_reductions(cfg) -> int:
        """Activation elements all-reduced over the model axis per example, forward and backward:
        one per row-parallel projection (attention output, FFN output) and the embeddings."""
        d, T, I = cfg.d_model, cfg.text_len, cfg.image_len
        return 2 * (cfg.encoder_layers * 2 * T * d + cfg.decoder_layers * 3 * I * d + (T + I) * d)


# -- the family ----------------------------------------------------------------------------------


@FAMILIES.option("seq2seq", ModelConfig)
@family
class Seq2Seq(nnx.Module):
    bos_id: int  # what the sampler reads (model/family.py: Family)
    image_vocab: int
    logit_rows: int

    def __init__(self, cfg, rngs: nnx.Rngs):
        """cfg: ModelConfig with text_vocab, image_vocab and image_len resolved."""
        self.cfg = cfg
        d = cfg.d_model
        self.image_vocab = cfg.image_vocab
        self.bos_id = cfg.image_vocab
        self.logit_rows = padded(cfg.image_vocab + 1, cfg.vocab_pad_multiple)
        self.text_embed = embed(padded(cfg.text_vocab, cfg.vocab_pad_multiple), d, ("vocab", "embed"), cfg, rngs)
        self.text_pos = embed(cfg.text_len, d, ("pos", "embed"), cfg, rngs)
        self.encoder = nnx.List([EncoderLayer(cfg, rngs) for _ in range(cfg.encoder_layers)])
        self.encoder_stream_norms = nnx.List(stream_norms(cfg, cfg.encoder_layers, rngs))
        # Final norms feed Dense layers (cross-attention k/v, the logits head): no learned scale
        # unless force_ln_scale (DALL·E Mega's rule).
        self.encoder_norm = Norm(d, cfg, cfg.force_ln_scale, rngs) if cfg.final_ln_encoder else None
        self.image_embed = embed(self.logit_rows, d, ("vocab", "embed"), cfg, rngs)
        self.image_pos = embed(cfg.image_len, d, ("pos", "embed"), cfg, rngs)
        self.decoder = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.decoder_layers)])
        self.decoder_stream_norms = nnx.List(stream_norms(cfg, cfg.decoder_layers, rngs))
        self.embed_scale = math.sqrt(d) if cfg.scale_embedding else 1.0
        self.rate = cfg.dropout
        self.decoder_norm = Norm(d, cfg, cfg.force_ln_scale, rngs) if cfg.final_ln_decoder else None
        self.lm_head = dense(d, self.logit_rows, ("embed", "vocab"), cfg, rngs, bias=False)

    def encode(
        self,
        text: jax.Array,
        text_mask: jax.Array,
        rngs: Optional[nnx.Rngs] = None,
        scales: Optional[BlockScale] = None,
    ) -> jax.Array:
        # per-resblock scaling: embeddings in float32 (appendix D), the residual stream float32
        f32 = scales is not None
        x = (
            outside(self.text_embed, text, f32) * self.embed_scale
            + outside(self.text_pos, jnp.arange(text.shape[1]), f32)[None]
        )
        x = dropout(self.rate, rngs)(x)
        mask = (text_mask[:, None, :] & text_mask[:, :, None])[:, None]  # [B, 1, T, T]
        # Padding queries would attend to nothing; let them see themselves so rows stay finite.
        mask = mask | jnp.eye(text.shape[1], dtype=bool)[None, None]
        x = run_stack(
            self.encoder,
            self.encoder_stream_norms,
            x,
            rngs,
            mask,
            remat=self.cfg.remat,
            scan=self.cfg.scan_layers,
            scales=scales,
        )
        return self.encoder_norm(x) if self.encoder_norm is not None else x

    def decoder_inputs(self, codes: jax.Array) -> jax.Array:
        bos = jnp.full((codes.shape[0], 1), self.bos_id, codes.dtype)
        return jnp.concatenate([bos, codes[:, :-1]], axis=1)

    def decode(
        self,
        inputs: jax.Array,
        enc: jax.Array,
        text_mask: jax.Array,
        rngs: Optional[nnx.Rngs] = None,
        scales: Optional[BlockScale] = None,
    ) -> jax.Array:
        """Logits [B, I, logit_rows] (float32, invalid rows masked) for decoder input ids."""
        t = inputs.shape[1]
        f32 = scales is not None  # per-resblock scaling: embeddings, stream and head in float32
        x = (
            outside(self.image_embed, inputs, f32) * self.embed_scale
            + outside(self.image_pos, jnp.arange(t), f32)[None]
        )
        x = dropout(self.rate, rngs)(x)
        self_mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
        cross_mask = text_mask[:, None, None, :]
        x = run_stack(
            self.decoder,
            self.decoder_stream_norms,
            x,
            rngs,
            enc,
            self_mask,
            cross_mask,
            remat=self.cfg.remat,
            scan=self.cfg.scan_layers,
            scales=scales,
        )
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        logits = outside(self.lm_head, x, f32).astype(jnp.float32)
        # BOS and padding rows are never a target nor sampled.
        valid = jnp.arange(self.logit_rows) < self.image_vocab
        return jnp.where(valid, logits, NEG_INF)

    def start_decoding(self, enc: jax.Array) -> DecodeCache:
        """An empty cache for decoding image tokens after the text encoded as `enc` [B, T, d]."""
        return DecodeCache(tuple(layer.empty_cache(enc, self.cfg.image_len) for layer in self.decoder))

    def decode_step(
        self, token: jax.Array, pos: jax.Array, cache: DecodeCache, text_mask: jax.Array
    ) -> tuple[jax.Array, DecodeCache]:
        """Logits [B, logit_rows] (float32, invalid rows masked) for the image token after decoder
        input `token` [B] at position `pos`, and the cache with that position added. Token by
        token this equals `decode` on the whole prefix (tests/generate/test_sampling.py)."""
        x = self.image_embed(token[:, None]) * self.embed_scale + self.image_pos(pos[None])[None]
        cross_mask = text_mask[:, None, None, :]
        x, layers = run_stack(
            self.decoder,
            self.decoder_stream_norms,
            x,
            None,
            None,
            None,
            cross_mask,
            caches=tuple(at_position(c, pos) for c in cache.layers),
        )
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        logits = self.lm_head(x[:, 0]).astype(jnp.float32)
        valid = jnp.arange(self.logit_rows) < self.image_vocab
        return jnp.where(valid, logits, NEG_INF), DecodeCache(layers)

    # stacks of residual blocks and their layer class (per-resblock gradient scaling)
    STACKS = {"encoder": EncoderLayer, "decoder": DecoderLayer}
    COSTS = Seq2SeqCosts

    def __call__(self, text, text_mask, codes, dropout_key: Optional[jax.Array] = None) -> jax.Array:
        """Teacher-forced logits. With a dropout_key the dropout layers are active (training)."""
        return self._logits(text, text_mask, codes, dropout_key, {})

    def _logits(self, text, text_mask, codes, dropout_key, scales: dict[str, BlockScale]) -> jax.Array:
        rngs = nnx.Rngs(dropout=dropout_key) if dropout_key is not None else None
        enc = self.encode(text, text_mask, rngs, scales.get("encoder"))
        return self.decode(self.decoder_inputs(codes), enc, text_mask, rngs, scales.get("decoder"))

    def nll(
        self,
        text,
        text_mask,
        codes,
        dropout_key: Optional[jax.Array] = None,
        grad_scales: Optional[dict[str, BlockScale]] = None,
    ) -> dict[str, jax.Array]:
        """Per-token NLL of each stream the family predicts: here only the image codes [B, I];
        `grad_scales` ({stack: BlockScale [layers, branches]}) scales each block's gradients."""
        logits = self._logits(text, text_mask, codes, dropout_key, grad_scales or {})
        return {"image": optax.softmax_cross_entropy_with_integer_labels(logits, codes)}
