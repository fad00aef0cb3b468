"""Images to codes and back in fixed-size batches: one compile per model and direction, the last
batch padded by repeating its final item."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

_COMPILED: dict = {}  # (id(model), method) -> (model, jitted fn, state): one compile per model and method


def _jitted(model, method: str):
    key = (id(model), method)
    if key not in _COMPILED:
        graphdef, state = nnx.split(model)
        _COMPILED[key] = (model, jax.jit(lambda s, x: getattr(nnx.merge(graphdef, s), method)(x)), state)
    _, fn, state = _COMPILED[key]
    return fn, state


def _batched(vqgan, method: str, items: np.ndarray, batch: int) -> np.ndarray:
    fn, state = _jitted(vqgan, method)
    out = []
    for start in range(0, len(items), batch):
        chunk = np.asarray(items[start : start + batch])
        pad = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])  # one compiled shape
        out.append(np.asarray(fn(state, pad))[: len(chunk)])
    return np.concatenate(out)


def encode_images(vqgan, images: np.ndarray, batch: int = 16) -> np.ndarray:
    """uint8 [N, R, R, 3] images at the VQGAN's resolution -> int [N, codes]."""
    return _batched(vqgan, "encode", images, batch)


def decode_codes(vqgan, codes: np.ndarray, batch: int = 16) -> np.ndarray:
    """int [N, codes] -> uint8 [N, R, R, 3] images."""
    return _batched(vqgan, "decode", codes, batch)
