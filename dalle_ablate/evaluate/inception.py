"""The FID Inception network (Heusel et al. 2017, arXiv 1706.08500) in Flax: the TensorFlow
`pt_inception-2015-12-05` graph that every FID number is computed with, as torch-fidelity and
pytorch-fid port it (their FID-specific blocks: average pools that do not count padding, and a
max pool in the last block), up to pool3 (2048-d). Parameter paths follow the PyTorch state
dict's names (`Mixed_5b/branch1x1/conv/kernel` for `Mixed_5b.branch1x1.conv.weight`), so
`dalle-ablate convert-inception` turns `weights-inception-2015-12-05-6726825d.pth` (torch-fidelity)
or `pt_inception-2015-12-05-6726825d.pth` (pytorch-fid) into our `.npz`.

Input: uint8 images [N, H, W, 3] of any size, resized to 299 x 299 by TensorFlow 1.x's bilinear
resize (`align_corners=False`, no half-pixel centres) -- the resize the reference statistics of
published FIDs were computed with, and torch-fidelity's default. RESIZE names it in every result.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from dalle_ablate.registry import ConfigError
from dalle_ablate.weights import (
    apply_batched,
    file_hash,
    from_state_dict,
    open_weights,
    save_weights,
    to_state_dict,
    with_arrays,
)

SIZE = 299
RESIZE = "tf1-bilinear-299"  # how images reach the network's input size, logged with each FID
FEATURES = 2048


class BasicConv2d(nnx.Module):
    """Convolution without bias, batch norm (eps 1e-3, running statistics), ReLU."""

    def __init__(self, i: int, o: int, kernel, stride: int = 1, padding=(0, 0), *, rngs):
        kernel = (kernel, kernel) if isinstance(kernel, int) else kernel
        padding = (padding, padding) if isinstance(padding, int) else padding
        self.conv = nnx.Conv(i, o, kernel, strides=stride, padding=[(p, p) for p in padding], use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(o, epsilon=1e-3, use_running_average=True, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.bn(self.conv(x)))


def _avg3(x):  # TensorFlow's 3x3 average pool does not count the zero padding
    return linen.avg_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)), count_include_pad=False)


def _max3s2(x):
    return linen.max_pool(x, (3, 3), strides=(2, 2), padding="VALID")


class InceptionA(nnx.Module):
    def __init__(self, c: int, pool_features: int, rngs):
        self.branch1x1 = BasicConv2d(c, 64, 1, rngs=rngs)
        self.branch5x5_1 = BasicConv2d(c, 48, 1, rngs=rngs)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2, rngs=rngs)
        self.branch3x3dbl_1 = BasicConv2d(c, 64, 1, rngs=rngs)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1, rngs=rngs)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1, rngs=rngs)
        self.branch_pool = BasicConv2d(c, pool_features, 1, rngs=rngs)

    def __call__(self, x):
        return jnp.concatenate(
            [
                self.branch1x1(x),
                self.branch5x5_2(self.branch5x5_1(x)),
                self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                self.branch_pool(_avg3(x)),
            ],
            -1,
        )


class InceptionB(nnx.Module):
    def __init__(self, c: int, rngs):
        self.branch3x3 = BasicConv2d(c, 384, 3, stride=2, rngs=rngs)
        self.branch3x3dbl_1 = BasicConv2d(c, 64, 1, rngs=rngs)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1, rngs=rngs)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2, rngs=rngs)

    def __call__(self, x):
        return jnp.concatenate(
            [
                self.branch3x3(x),
                self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                _max3s2(x),
            ],
            -1,
        )


class InceptionC(nnx.Module):
    def __init__(self, c: int, c7: int, rngs):
        self.branch1x1 = BasicConv2d(c, 192, 1, rngs=rngs)
        self.branch7x7_1 = BasicConv2d(c, c7, 1, rngs=rngs)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7dbl_1 = BasicConv2d(c, c7, 1, rngs=rngs)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch_pool = BasicConv2d(c, 192, 1, rngs=rngs)

    def __call__(self, x):
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = x
        for layer in (
            self.branch7x7dbl_1,
            self.branch7x7dbl_2,
            self.branch7x7dbl_3,
            self.branch7x7dbl_4,
            self.branch7x7dbl_5,
        ):
            d = layer(d)
        return jnp.concatenate([self.branch1x1(x), b7, d, self.branch_pool(_avg3(x))], -1)


class InceptionD(nnx.Module):
    def __init__(self, c: int, rngs):
        self.branch3x3_1 = BasicConv2d(c, 192, 1, rngs=rngs)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2, rngs=rngs)
        self.branch7x7x3_1 = BasicConv2d(c, 192, 1, rngs=rngs)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3), rngs=rngs)
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0), rngs=rngs)
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2, rngs=rngs)

    def __call__(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return jnp.concatenate([b3, b7, _max3s2(x)], -1)


class InceptionE(nnx.Module):
    """`last=True` is Mixed_7c: the TensorFlow graph max-pools its pool branch where the paper
    (and torchvision) average-pool."""

    def __init__(self, c: int, last: bool, rngs):
        self.last = last
        self.branch1x1 = BasicConv2d(c, 320, 1, rngs=rngs)
        self.branch3x3_1 = BasicConv2d(c, 384, 1, rngs=rngs)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1), rngs=rngs)
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0), rngs=rngs)
        self.branch3x3dbl_1 = BasicConv2d(c, 448, 1, rngs=rngs)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1, rngs=rngs)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1), rngs=rngs)
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0), rngs=rngs)
        self.branch_pool = BasicConv2d(c, 192, 1, rngs=rngs)

    def __call__(self, x):
        b3 = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = linen.max_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1))) if self.last else _avg3(x)
        return jnp.concatenate(
            [
                self.branch1x1(x),
                self.branch3x3_2a(b3),
                self.branch3x3_2b(b3),
                self.branch3x3dbl_3a(d),
                self.branch3x3dbl_3b(d),
                self.branch_pool(pooled),
            ],
            -1,
        )


def resize_tf1_bilinear(x: jax.Array, size: int) -> jax.Array:
    """TensorFlow 1.x `resize_bilinear(align_corners=False)`: source coordinate = destination x
    (in / out), computed in float32, neighbours clamped at the far edge -- not jax.image.resize's
    half-pixel-centred bilinear, which gives different pixels and a different FID."""

    def axis(n_in: int):
        grid = np.arange(size, dtype=np.float32) * np.float32(n_in / size)
        lo = grid.astype(np.int64)
        return lo, np.minimum(lo + 1, n_in - 1), (grid - lo.astype(np.float32)).astype(np.float32)

    ylo, yhi, dy = axis(x.shape[1])
    xlo, xhi, dx = axis(x.shape[2])
    top, bottom = x[:, ylo], x[:, yhi]
    dx = dx[None, None, :, None]
    row0 = top[:, :, xlo] + (top[:, :, xhi] - top[:, :, xlo]) * dx
    row1 = bottom[:, :, xlo] + (bottom[:, :, xhi] - bottom[:, :, xlo]) * dx
    return row0 + (row1 - row0) * dy[None, :, None, None]


class InceptionV3(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2, rngs=rngs)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3, rngs=rngs)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1, rngs=rngs)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1, rngs=rngs)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3, rngs=rngs)
        self.Mixed_5b = InceptionA(192, 32, rngs)
        self.Mixed_5c = InceptionA(256, 64, rngs)
        self.Mixed_5d = InceptionA(288, 64, rngs)
        self.Mixed_6a = InceptionB(288, rngs)
        self.Mixed_6b = InceptionC(768, 128, rngs)
        self.Mixed_6c = InceptionC(768, 160, rngs)
        self.Mixed_6d = InceptionC(768, 160, rngs)
        self.Mixed_6e = InceptionC(768, 192, rngs)
        self.Mixed_7a = InceptionD(768, rngs)
        self.Mixed_7b = InceptionE(1280, False, rngs)
        self.Mixed_7c = InceptionE(2048, True, rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        """uint8 [N, H, W, 3] -> pool3 features [N, 2048] (float32)."""
        x = resize_tf1_bilinear(images.astype(jnp.float32), SIZE)
        x = (x - 128.0) / 128.0
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(_max3s2(x)))
        x = _max3s2(x)
        for block in (
            self.Mixed_5b,
            self.Mixed_5c,
            self.Mixed_5d,
            self.Mixed_6a,
            self.Mixed_6b,
            self.Mixed_6c,
            self.Mixed_6d,
            self.Mixed_6e,
            self.Mixed_7a,
            self.Mixed_7b,
            self.Mixed_7c,
        ):
            x = block(x)
        return x.mean((1, 2))


# -- weights ------------------------------------------------------------------------------------
def _torch_name(key: str) -> tuple[str, str]:
    *mods, leaf = key.split("/")
    name = {"kernel": "weight", "scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}[leaf]
    return ".".join([*mods, name]), "conv" if leaf == "kernel" else "copy"


def convert_state_dict(state_dict: dict[str, np.ndarray]) -> InceptionV3:
    """Our network with the weights of torch-fidelity's / pytorch-fid's FID Inception state dict
    (the classifier `fc` is not used for pool3 features and is ignored)."""
    return from_state_dict(
        lambda: InceptionV3(nnx.Rngs(0)),
        state_dict,
        _torch_name,
        "the FID Inception (pt_inception-2015-12-05) state dict",
    )


def torch_names(model: InceptionV3) -> dict[str, np.ndarray]:
    return to_state_dict(model, _torch_name)


def save_inception(model: InceptionV3 | dict[str, np.ndarray], path: str | Path) -> None:
    save_weights(model, path, config={"net": "fid-inception-v3", "resize": RESIZE})


HINT = "convert torch-fidelity's weights-inception-2015-12-05-6726825d.pth with `dalle-ablate convert-inception`"


class InceptionFeatures:
    """Pool3 features of uint8 images, batched and jitted (one compilation per batch shape),
    with the hash of the weights file that produced them."""

    def __init__(self, path: str | Path, field: str = "eval.fid.weights", batch_size: int = 32):
        meta, arrays = open_weights(path, field, HINT)
        if meta["config"].get("net") != "fid-inception-v3":
            raise ConfigError(f"{field}: {path} is not FID Inception weights ({HINT})")
        model = with_arrays(lambda: InceptionV3(nnx.Rngs(0)), arrays, f"{field} {path}")
        self.state = nnx.state(model)
        self.hash = file_hash(path)
        self.batch_size = batch_size

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return apply_batched(_features(), self.state, np.asarray(images, np.uint8), self.batch_size)


@lru_cache(maxsize=None)  # one jitted function: every loaded copy of the weights shares its compilations
def _features():
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: InceptionV3(nnx.Rngs(0))))
    return jax.jit(lambda state, images: nnx.merge(graphdef, state)(images))
