"""Image features for a Fréchet distance on the shapes data: a small CNN trained here, on renders
of the data generator, to name what each cell of the 3x3 grid holds (colour, shape, size). Its
penultimate layer is the feature. Training is seeded and runs once per settings hash; the
weights and the reference statistics (of real renders) are cached under that hash, which is
logged with every value. The distances are this project's own numbers, never "FID"."""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dalle_ablate.data.scenes import PALETTE, SHAPES, SIZES, random_scene, render
from dalle_ablate.evaluate.convs import conv_features, strided_convs
from dalle_ablate.evaluate.evaluators import SamplesContext, evaluator
from dalle_ablate.evaluate.frechet import frechet_of, kid, statistics
from dalle_ablate.fileio import atomic_savez
from dalle_ablate.metrics import Metric

SETTINGS = {
    "version": 1,
    "train_images": 4000,
    "steps": 400,
    "batch": 64,
    "lr": 3e-3,
    "features": 32,
    "seed": 0,
    "reference_images": 2000,
    "image_size": 64,
}
COLOR_IDS = {c: i + 1 for i, c in enumerate(PALETTE)}  # 0 = empty cell
SHAPE_IDS = {s: i + 1 for i, s in enumerate(SHAPES)}
SIZE_IDS = {s: i + 1 for i, s in enumerate(SIZES)}


def settings_hash(settings: dict = SETTINGS) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


class CellNet(nnx.Module):
    def __init__(self, features: int, rngs: nnx.Rngs):
        self.convs = strided_convs((3, 16, 32, 32), rngs)
        self.feature = nnx.Linear(8 * 8 * 32, features, rngs=rngs)
        self.head = nnx.Linear(features, 9 * (len(COLOR_IDS) + 1 + len(SHAPE_IDS) + 1 + len(SIZE_IDS) + 1), rngs=rngs)

    def features(self, images: jax.Array) -> jax.Array:
        return jnp.tanh(self.feature(conv_features(self.convs, images)))

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.head(self.features(images)).reshape(images.shape[0], 9, -1)


def _labels(scene) -> np.ndarray:
    out = np.zeros((9, 3), np.int32)
    for o in scene.objects:
        out[o.row * 3 + o.col] = (COLOR_IDS[o.color], SHAPE_IDS[o.shape], SIZE_IDS[o.size])
    return out


def real_renders(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scenes = [random_scene(rng) for _ in range(n)]
    return np.stack([render(s, SETTINGS["image_size"]) for s in scenes]), np.stack([_labels(s) for s in scenes])


def _train(settings: dict) -> CellNet:
    images, labels = real_renders(settings["train_images"], settings["seed"] + 1)
    model = CellNet(settings["features"], nnx.Rngs(settings["seed"]))
    opt = nnx.Optimizer(model, optax.adam(settings["lr"]), wrt=nnx.Param)
    splits = np.cumsum([len(COLOR_IDS) + 1, len(SHAPE_IDS) + 1])

    @nnx.jit
    def step(model, opt, x, y):
        def loss_fn(m):
            heads = jnp.split(m(x), splits, axis=-1)
            return sum(
                optax.softmax_cross_entropy_with_integer_labels(h, y[..., k]).mean() for k, h in enumerate(heads)
            )

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(settings["seed"])
    for _ in range(settings["steps"]):
        idx = rng.choice(len(images), settings["batch"], replace=False)
        step(model, opt, jnp.asarray(images[idx]), jnp.asarray(labels[idx]))
    return model


class ShapesFeatures:
    """Trained (or loaded from the cache) feature network and the reference statistics."""

    def __init__(self, cache_dir: str | Path, settings: dict = SETTINGS):
        self.hash = settings_hash(settings)
        root = Path(cache_dir).expanduser() / "shapes_features"
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{self.hash}.npz"
        self._features = nnx.jit(lambda m, x: m.features(x))
        model = CellNet(settings["features"], nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        if path.exists():
            flat = dict(np.load(path))
            leaves, treedef = jax.tree_util.tree_flatten(nnx.to_pure_dict(state))
            state_dict = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[f"p{i}"]) for i in range(len(leaves))])
            nnx.replace_by_pure_dict(state, state_dict)
            self.model = nnx.merge(graphdef, state)
            self.reference = flat["reference"]
        else:
            self.model = _train(settings)
            self.reference = self.extract(real_renders(settings["reference_images"], settings["seed"] + 2)[0])
            leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(self.model)))
            atomic_savez(path, reference=self.reference, **{f"p{i}": np.asarray(x) for i, x in enumerate(leaves)})
        self.reference_stats = statistics(self.reference)

    def resized(self, images: np.ndarray) -> np.ndarray:
        """Images of another size brought to the network's (bilinear); the floor in the
        evaluator is computed through the same resize, so it still says what a perfect model gets."""
        size = SETTINGS["image_size"]
        if images.shape[1:3] == (size, size):
            return images
        from PIL import Image

        return np.stack(
            [np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BILINEAR)) for im in images]
        )

    def extract(self, images: np.ndarray, batch: int = 256) -> np.ndarray:
        return np.concatenate(
            [
                np.asarray(self._features(self.model, jnp.asarray(images[i : i + batch])))
                for i in range(0, len(images), batch)
            ]
        )


@lru_cache(maxsize=4)
def shapes_features(cache_dir: str) -> ShapesFeatures:
    return ShapesFeatures(cache_dir)


@evaluator(
    "shapes_fd",
    "samples",
    needs_specs=True,
    metrics=[
        Metric(
            "fd",
            "Fréchet distance of the images' shapes features to real renders",
            "Fréchet distance",
            "lower",
            headline=6,
            pareto_against="shapes/all",
        ),
    ],
)
def shapes_fd_evaluator(images: np.ndarray, ctx: SamplesContext) -> dict[str, float]:
    """eval.metrics=[shapes_fd]: Fréchet distance and KID of the images' features against real
    renders; `floor` is the distance of real renders of these same prompts, the value a perfect
    model would get at this N (both distances are biased upwards at small N)."""
    net = shapes_features(ctx.cache_dir)
    feats = net.extract(net.resized(images))
    if "shapes_fd/floor" not in ctx.cache:  # the prompts are fixed for the Evaluation's life
        real = net.resized(ctx.reference_images())
        ctx.cache["shapes_fd/floor"] = frechet_of(net.extract(real), *net.reference_stats)
    return {
        "fd": frechet_of(feats, *net.reference_stats),
        "kid": kid(feats, net.reference, subset_size=min(100, len(feats))),
        "floor": ctx.cache["shapes_fd/floor"],
        "n": float(len(feats)),
        "features": net.hash,
    }
