"""Plain autoregressive sampling (temperature, optional top-k), batched, jitted and seeded.

Each position re-runs the decoder over the whole prefix; a KV cache and super conditioning are
the evaluation issue's. Invalid rows (BOS, padding) are masked by the model's logits."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image, ImageDraw


def make_sampler(
    graphdef, image_len: int, temperature: float = 1.0, top_k: Optional[int] = None, out_sharding=None
) -> Callable:
    """sample(params, text, text_mask, key) -> codes [B, image_len] int32 (replicated with a
    mesh's replicated `out_sharding`, so that every host can read them)."""

    def sample(params, text, text_mask, key):
        model = nnx.merge(graphdef, params)
        enc = model.encode(text, text_mask)
        codes = jnp.zeros((text.shape[0], image_len), jnp.int32)

        def body(i, codes):
            logits = model.decode(model.decoder_inputs(codes), enc, text_mask)[:, i] / temperature
            if top_k is not None:
                kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            tok = jax.random.categorical(jax.random.fold_in(key, i), logits)
            return codes.at[:, i].set(tok.astype(jnp.int32))

        return jax.lax.fori_loop(0, image_len, body, codes)

    return jax.jit(sample, out_shardings=out_sharding)


def image_grid(images: np.ndarray, captions: list[str], per_row: int, scale: int = 2) -> np.ndarray:
    """Rows of `per_row` images, one row per caption, the caption written above its row."""
    n, h, w, _ = images.shape
    rows = n // per_row
    label = 12
    cell_h = h * scale + label
    canvas = Image.new("RGB", (per_row * w * scale, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r in range(rows):
        draw.text((2, r * cell_h), captions[r][: 12 * per_row], fill=(0, 0, 0))
        for c in range(per_row):
            img = Image.fromarray(images[r * per_row + c]).resize((w * scale, h * scale), Image.Resampling.NEAREST)
            canvas.paste(img, (c * w * scale, r * cell_h + label))
    return np.asarray(canvas)
