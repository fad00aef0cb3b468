"""The small convolutional stack the two shapes networks trained here share (the reranker's
contrastive scorer, evaluate/contrastive.py, and the Fréchet features' cell network,
evaluate/shapes_features.py): stride-2 3x3 convolutions over a 64 x 64 scene, flattened."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def strided_convs(channels: tuple[int, ...], rngs: nnx.Rngs) -> nnx.List:
    """3x3 stride-2 convolutions from channels[0] (RGB) through each next width."""
    return nnx.List([nnx.Conv(a, b, (3, 3), strides=2, rngs=rngs) for a, b in zip(channels, channels[1:])])


def conv_features(convs: nnx.List, images: jax.Array) -> jax.Array:
    """uint8 scenes [B, H, W, 3] -> their flattened ReLU features [B, H W C / 4^len(convs)]."""
    x = images.astype(jnp.float32) / 127.5 - 1
    for conv in convs:
        x = jax.nn.relu(conv(x))
    return x.reshape(x.shape[0], -1)
