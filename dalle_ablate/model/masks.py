"""Attention masks of the single-stream family (Ramesh et al. 2021, arXiv 2102.12092, appendix B.1).

One stream: `text_len` text positions, then the image tokens of a g x g grid in raster order.
Text sees earlier text (causal); every image token sees all the text; among image tokens each
layer uses one pattern:

- `dense`: every earlier image token (plain causal attention);
- `row`: the previous g image tokens in raster order and itself, so that the last one seen is the
  token in the same column of the previous row (the paper's figure 11a: "attends to the previous
  5 image tokens" on a 4 x 4 grid);
- `column`: the earlier image tokens of its own column (figure 11b; the paper transposes the
  image states to compute it as a row mask, the same pairs);
- `conv`: a causal k x k neighbourhood, the rows from k // 2 above down to its own and the
  columns within k // 2, taken as raster offsets, so that it wraps around the grid's edges as
  the row mask does (figure 11d; the paper's kernel is 11 x 11).

Masks are computed once per shape (cached) as numpy arrays, True where the query may attend.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dalle_ablate.registry import ConfigError

PATTERNS = ("dense", "row", "column", "conv")


def grid_side(image_len: int) -> int:
    g = math.isqrt(image_len)
    if g * g != image_len:
        raise ConfigError(
            f"model.family=single_stream needs a square image grid; model.image_len={image_len} is not a square"
        )
    return g


def image_pairs(pattern: str, g: int, kernel: int) -> np.ndarray:
    """[I, I] bool over image positions (query, key) for one pattern on a g x g grid."""
    n = g * g
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    back = q - k  # how many raster positions the key lies before the query
    causal = back >= 0
    if pattern == "dense":
        return causal
    if pattern == "row":
        return causal & (back <= g)
    if pattern == "column":
        return causal & (back % g == 0)
    if pattern == "conv":
        h = kernel // 2
        # back = a g + b with a rows up (0..h) and b columns left (-h..h, negative: to the right)
        near = np.zeros_like(causal)
        for a in range(h + 1):
            near |= (back >= a * g - h) & (back <= a * g + h)
        return causal & near
    raise ConfigError(f"model.attention_pattern: {pattern!r} is not a pattern; valid: {', '.join(PATTERNS)}")


@functools.lru_cache(maxsize=32)
def stream_mask(pattern: str, text_len: int, g: int, kernel: int) -> np.ndarray:
    """[L, L] bool over the whole stream (L = text_len + g^2): text causal, image sees all text,
    image-image by `pattern`. Read-only: it is shared between callers."""
    t, n = text_len, g * g
    mask = np.zeros((t + n, t + n), bool)
    mask[:t, :t] = np.tril(np.ones((t, t), bool))
    mask[t:, :t] = True
    mask[t:, t:] = image_pairs(pattern, g, kernel)
    mask.setflags(write=False)
    return mask


def layer_patterns(spec: str, layers: int) -> tuple[str, ...]:
    """The image-image pattern of each layer. `dalle`: the paper's rule for layer i = 1..N, column
    attention where (i - 2) mod 4 = 0, convolutional in the last layer, row attention elsewhere;
    one pattern name: every layer; names separated by commas: repeated over the layers."""
    if spec == "dalle":
        return tuple("conv" if i == layers else "column" if (i - 2) % 4 == 0 else "row" for i in range(1, layers + 1))
    names = [s.strip() for s in spec.split(",")]
    for name in names:
        if name not in PATTERNS:
            raise ConfigError(
                f"model.attention_pattern={spec!r}: {name!r} is not a pattern; valid: dalle, or "
                f"comma-separated names of {', '.join(PATTERNS)}"
            )
    return tuple(names[i % len(names)] for i in range(layers))
