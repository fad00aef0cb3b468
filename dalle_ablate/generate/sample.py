"""Autoregressive sampling with a KV cache and super conditioning, batched, jitted and seeded.

The encoder runs once; each image position runs the decoder on one token against per-layer caches
of keys and values (`Seq2Seq.decode_step`). Super conditioning (DALL·E mini, after Ho & Salimans'
classifier-free guidance, arXiv 2207.12598): the same captions are decoded a second time from the
empty caption, with a second cache, and the logits become u + s (c - u) before temperature,
top-k and top-p. Every position draws its noise from fold_in(key, position): the same key gives
the same noise at every scale and every checkpoint.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image, ImageDraw

from dalle_ablate.registry import ConfigError


def guide_logits(cond: jax.Array, uncond: jax.Array, scale: jax.Array) -> jax.Array:
    """u + s (c - u); exactly c at s = 1 (so scale 1 is unguided sampling bit for bit)."""
    return jnp.where(scale == 1, cond, uncond + scale * (cond - uncond))


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
    """True for the smallest set of most likely ids whose probability reaches p (nucleus
    sampling, Holtzman et al. 2019, arXiv 1904.09751); the most likely id is always kept."""
    order = jnp.argsort(-logits, axis=-1)
    probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the ids ranked above each one
    keep_sorted = before < p
    return jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)


def filter_logits(
    logits: jax.Array, valid: jax.Array, temperature: float, top_k: Optional[int], top_p: Optional[float]
):
    """Temperature, then top-k, then top-p; ids outside `valid` (BOS, padding rows) get -inf."""
    logits = jnp.where(valid, logits / temperature, -jnp.inf)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        logits = jnp.where(top_p_mask(logits, top_p), logits, -jnp.inf)
    return logits


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float], field: str = "samples") -> None:
    if not temperature > 0:
        raise ConfigError(f"{field}.temperature={temperature:g} must be positive")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"{field}.top_k={top_k} must be >= 1 or null")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"{field}.top_p={top_p:g} must be in (0, 1] or null")


def make_sampler(
    graphdef,
    image_len: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    guided: bool = False,
    out_sharding=None,
) -> Callable:
    """Unguided: sample(params, text, text_mask, key). Guided: sample(params, text, text_mask,
    key, blank, blank_mask, scale), `blank` the empty caption [1, T] and `scale` a scalar (traced:
    one compilation serves every scale). Returns codes [B, image_len] int32 (replicated with a
    mesh's replicated `out_sharding`, so that every host can read them)."""
    check_sampling(temperature, top_k, top_p)

    def run(params, text, text_mask, key, blank=None, blank_mask=None, scale=None):
        model = nnx.merge(graphdef, params)
        b = text.shape[0]
        if guided:  # one batch of 2B: the captions, then the empty caption for each of them
            text = jnp.concatenate([text, jnp.broadcast_to(blank, (b, blank.shape[1]))])
            text_mask = jnp.concatenate([text_mask, jnp.broadcast_to(blank_mask, (b, blank_mask.shape[1]))])
        cache = model.start_decoding(model.encode(text, text_mask))
        valid = jnp.arange(model.logit_rows) < model.image_vocab

        def body(i, carry):
            codes, token, cache = carry
            logits, cache = model.decode_step(token, i, cache, text_mask)
            if guided:
                logits = guide_logits(logits[:b], logits[b:], scale)
            logits = filter_logits(logits, valid, temperature, top_k, top_p)
            tok = jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)
            return codes.at[:, i].set(tok), jnp.concatenate([tok, tok]) if guided else tok, cache

        start = jnp.full((text.shape[0],), model.bos_id, jnp.int32)
        codes = jnp.zeros((b, image_len), jnp.int32)
        return jax.lax.fori_loop(0, image_len, body, (codes, start, cache))[0]

    if guided:
        return jax.jit(run, out_shardings=out_sharding)
    return jax.jit(lambda params, text, text_mask, key: run(params, text, text_mask, key), out_shardings=out_sharding)


def image_grid(images: np.ndarray, captions: list[str], per_row: int, scale: int = 3) -> np.ndarray:
    """Rows of `per_row` images, one row per caption, the caption written in a band of its own
    above its row (never over an image); images upscaled nearest-neighbour by `scale`, each in a
    grey frame so that white backgrounds do not run into each other."""
    n, h, w, _ = images.shape
    rows = n // per_row
    label, pad = 16, 2  # PIL's default font is 11 px high; a 2 px frame around every image
    iw, ih = w * scale + 2 * pad, h * scale + 2 * pad
    cell_h = ih + label
    canvas = Image.new("RGB", (per_row * iw, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        # about 6 px per character: cut to the row's width
        draw.text((2, r * cell_h + 2), captions[r][: per_row * iw // 6], fill=(0, 0, 0))
        for c in range(per_row):
            x, y = c * iw, r * cell_h + label
            draw.rectangle([x, y, x + iw - 1, y + ih - 1], fill=(170, 170, 170))
            img = Image.fromarray(images[r * per_row + c]).resize((w * scale, h * scale), Image.Resampling.NEAREST)
            canvas.paste(img, (x + pad, y + pad))
    return np.asarray(canvas)
