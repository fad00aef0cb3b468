"""Image tokenizers of the built-in data (`data.tokenizer`), one interface: `encode` (uint8
[N, H, W, 3] -> int32 [N, tokens]), `decode` (back), `size` (codes) and `grid` (tokens per side).
Each option is registered beside its builder; a builder fits (or loads from
`<data.cache_dir>/<option>/<key>.npz`) the tokenizer of the data's settings.

- `kmeans` (here): a k-means codebook of pixel patches. As ImageGPT quantised pixels with k-means
  (Chen et al. 2020), we quantise whole p x p RGB patches: encode = index of the nearest code
  (squared distance), decode = lookup and tiling; fitted deterministically from a seed.
- `dvae` (data/dvae.py): DALL·E's discrete VAE, trained here.
- `vqgan` (here): a VQGAN's weights (`data.vqgan_path`), the tokenizer of real images, applied to
  the renders.
"""

from __future__ import annotations

import functools
import hashlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dalle_ablate import interrupts
from dalle_ablate.fileio import atomic_savez
from dalle_ablate.registry import ConfigError, Registry


class ImageTokenizer(Protocol):
    size: int  # codes in the image vocabulary
    grid: tuple[int, int]  # tokens down and across an image

    def encode(self, images: np.ndarray) -> np.ndarray: ...

    def decode(self, codes: np.ndarray) -> np.ndarray: ...


class TokenizerOption(ABC):
    """An option of `data.tokenizer`: `key` hashes the settings that determine the tokenizer (with
    `data_key`, the hash of the images it is fitted on), `build` fits or loads it. `images` is
    called only when it has to be fitted; `log(step, metrics)` hears a training's progress.
    `default_size` is its number of codes when data.codebook_size is null."""

    name: str

    @abstractmethod
    def default_size(self, cfg) -> int: ...

    @abstractmethod
    def key(self, cfg, data_key: str) -> str: ...

    @abstractmethod
    def build(
        self, cfg, images: Callable[[], np.ndarray], data_key: str, log: Optional[Callable[[int, dict], None]] = None
    ) -> ImageTokenizer: ...

    def path(self, cfg, data_key: str) -> Path:
        """Where the fitted tokenizer is cached."""
        return Path(cfg.cache_dir).expanduser() / self.name / f"{self.key(cfg, data_key)}.npz"


# name -> TokenizerOption; data/dvae.py registers `dvae`
IMAGE_TOKENIZERS: Registry = Registry("image tokenizer", "data.tokenizer")


def from_patches(patches: np.ndarray, p: int) -> np.ndarray:
    """[N, tokens, p*p*3] floats in [0, 1], patches in raster order -> [N, H, W, 3] uint8."""
    n, t, d = patches.shape
    g = int(round(t**0.5))
    x = patches.reshape(n, g, g, p, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, g * p, g * p, 3)
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


@jax.jit
def _nearest(x: jax.Array, codes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Index of and squared distance to the nearest code for each row of x."""
    # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 does not change the argmin.
    d = jnp.sum(codes**2, axis=1)[None, :] - 2.0 * x @ codes.T
    idx = jnp.argmin(d, axis=1)
    return idx, jnp.maximum(jnp.take_along_axis(d, idx[:, None], axis=1)[:, 0] + jnp.sum(x**2, axis=1), 0.0)


@functools.partial(jax.jit, static_argnames="k")
def _lloyd_step(x: jax.Array, w: jax.Array, codes: jax.Array, k: int):
    idx, err = _nearest(x, codes)
    onehot = jax.nn.one_hot(idx, k, dtype=x.dtype) * w[:, None]
    counts = onehot.sum(0)
    sums = onehot.T @ x
    new = jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1e-12)[:, None], codes)
    return new, counts, err


def unique_patches(images: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct patches [U, p*p*3] (float32 in [0, 1]), the inverse index of every patch, and the
    count of each. Rendered images repeat patches heavily (background, the same shape edge), so
    fitting and encoding on distinct patches is exact and far cheaper."""
    n, h, w, c = images.shape
    if h % p or w % p:
        raise ConfigError(f"data.patch_size={p} does not divide the image size {h}x{w}")
    x = images.reshape(n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(-1, p * p * c)
    rows = np.ascontiguousarray(x, dtype=np.uint8).view(np.dtype((np.void, p * p * c)))[:, 0]
    uniq, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
    patches = np.frombuffer(uniq.tobytes(), np.uint8).reshape(-1, p * p * c).astype(np.float32) / 255.0
    return patches, inverse.ravel(), counts


def kmeans(x: np.ndarray, weights: np.ndarray, k: int, iters: int, seed: int) -> np.ndarray:
    """Weighted Lloyd's k-means over distinct points, started from k of them chosen by the seed.
    An empty cluster is moved to the point currently worst represented, so no code is wasted."""
    if len(x) < k:
        raise ConfigError(
            f"data.codebook_size={k} exceeds the {len(x)} distinct patches sampled; "
            "lower data.codebook_size or raise data.kmeans_patches / data.num_train"
        )
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(x[np.sort(rng.choice(len(x), size=k, replace=False))])
    xj, wj = jnp.asarray(x), jnp.asarray(weights, jnp.float32)
    for _ in range(iters):
        interrupts.check("while fitting the image tokenizer (data.tokenizer=kmeans)")
        codes, counts, err = _lloyd_step(xj, wj, codes, k)
        empty = np.flatnonzero(np.asarray(counts) == 0)
        if len(empty):
            worst = np.argsort(-np.asarray(err), kind="stable")[: len(empty)]
            codes = codes.at[empty].set(xj[worst])
    return np.asarray(codes)


class PatchCodebook:
    def __init__(self, codes: np.ndarray, patch_size: int, image_size: Optional[int] = None):
        self.codes = np.asarray(codes, np.float32)
        self.patch_size = patch_size
        self.image_size = image_size  # known once fitted; a codebook decodes any square grid

    @property
    def grid(self) -> tuple[int, int]:
        if self.image_size is None:
            raise ValueError("this codebook was saved without its image size")
        g = self.image_size // self.patch_size
        return g, g

    @property
    def size(self) -> int:
        return len(self.codes)

    def encode(self, images: np.ndarray, chunk: int = 16384) -> np.ndarray:
        """[N, H, W, 3] uint8 -> [N, tokens] int32 codes."""
        n, h, w, _ = images.shape
        t = (h // self.patch_size) * (w // self.patch_size)
        patches, inverse, _ = unique_patches(images, self.patch_size)
        codes = jnp.asarray(self.codes)
        out = []
        for i in range(0, len(patches), chunk):
            interrupts.check("while encoding the images")
            part = patches[i : i + chunk]
            pad = chunk - len(part)  # fixed shapes: one compilation
            idx, _ = _nearest(jnp.asarray(np.pad(part, ((0, pad), (0, 0)))), codes)
            out.append(np.asarray(idx)[: len(part)])
        return np.concatenate(out)[inverse].reshape(n, t).astype(np.int32)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """[N, tokens] ints -> [N, H, W, 3] uint8."""
        codes = np.asarray(codes)
        if codes.min() < 0 or codes.max() >= self.size:
            raise ValueError(f"codes outside the codebook [0, {self.size})")
        return from_patches(self.codes[codes], self.patch_size)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {} if self.image_size is None else {"image_size": self.image_size}
        atomic_savez(
            path, codes=self.codes, patch_size=self.patch_size, **extra
        )  # a crash never leaves a half-written file

    @classmethod
    def load(cls, path: str | Path) -> "PatchCodebook":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"codebook file {path} does not exist")
        try:
            with np.load(path) as f:
                return cls(f["codes"], int(f["patch_size"]), int(f["image_size"]) if "image_size" in f else None)
        except (KeyError, ValueError, OSError) as e:
            raise ConfigError(f"{path} is not a patch codebook (.npz with 'codes' and 'patch_size'): {e}") from e

    @classmethod
    def fit(cls, images: np.ndarray, patch_size: int, size: int, max_patches: int, iters: int, seed: int):
        """k-means on the patches of (at most max_patches // patches-per-image) of these images."""
        per_image = (images.shape[1] // patch_size) * (images.shape[2] // patch_size)
        keep = max(1, max_patches // per_image)
        if len(images) > keep:
            images = images[np.sort(np.random.default_rng(seed).choice(len(images), size=keep, replace=False))]
        patches, _, counts = unique_patches(images, patch_size)
        return cls(kmeans(patches, counts, size, iters, seed), patch_size, images.shape[1])


class KMeansOption(TokenizerOption):
    name = "kmeans"

    def default_size(self, cfg) -> int:
        return 145  # the distinct patches of the 48 px renders (conf/data/shapes.yaml): lossless

    def key(self, cfg, data_key: str) -> str:
        fields = ["kmeans-v1", data_key, cfg.patch_size, cfg.vocab(), cfg.kmeans_patches, cfg.kmeans_iters, cfg.seed]
        return hashlib.sha256("|".join(map(str, fields)).encode()).hexdigest()[:16]

    def build(self, cfg, images, data_key, log=None) -> PatchCodebook:
        path = self.path(cfg, data_key)
        if path.is_file():
            return PatchCodebook.load(path)
        codebook = PatchCodebook.fit(
            images(), cfg.patch_size, cfg.vocab(), cfg.kmeans_patches, cfg.kmeans_iters, cfg.seed
        )
        codebook.save(path)
        return codebook


class VQGANOption(TokenizerOption):
    """A VQGAN's codes of the renders (data.vqgan_path, at the VQGAN's resolution): the tokenizer
    of real images, to compare with the ones fitted to this data. Nothing is fitted or cached."""

    name = "vqgan"

    def default_size(self, cfg) -> int:
        raise ConfigError("data.tokenizer=vqgan needs data.codebook_size: its VQGAN's codebook size (n_embed)")

    def key(self, cfg, data_key: str) -> str:
        from dalle_ablate.weights import file_hash

        if not cfg.vqgan_path:
            raise ConfigError(
                "data.tokenizer=vqgan needs data.vqgan_path (VQGAN weights .npz from dalle-ablate convert-vqgan)"
            )
        return file_hash(Path(cfg.vqgan_path).expanduser())

    def build(self, cfg, images, data_key, log=None):
        from dalle_ablate.vqgan import load_vqgan
        from dalle_ablate.vqgan.codes import decode_codes, encode_images

        vqgan = load_vqgan(cfg.vqgan_path, "data.vqgan_path")
        factor = 2 ** (len(vqgan.cfg.ch_mult) - 1)
        want = {"image_size": vqgan.cfg.resolution, "patch_size": factor, "codebook_size": vqgan.cfg.n_embed}
        have = {"image_size": cfg.image_size, "patch_size": cfg.patch_size, "codebook_size": cfg.vocab()}
        for name, value in want.items():
            if have[name] != value:
                raise ConfigError(f"data.vqgan_path needs data.{name}={value} (got {have[name]})")
        g = cfg.image_size // factor
        return _Wrapped(vqgan.cfg.n_embed, (g, g), lambda x: encode_images(vqgan, x), lambda c: decode_codes(vqgan, c))


class _Wrapped:
    def __init__(self, size: int, grid: tuple[int, int], encode, decode):
        self.size, self.grid, self.encode, self.decode = size, grid, encode, decode


IMAGE_TOKENIZERS.register("kmeans", KMeansOption())
IMAGE_TOKENIZERS.register("vqgan", VQGANOption())
