"""A small contrastive text-image model of the shapes data, trained here: the reranker DALL·E's
best-of-N needs (Ramesh et al. 2021, arXiv 2102.12092, section 2.5, reranked with CLIP), for the
built-in data and offline.

An image encoder (a CNN on 64 px renders) and a text encoder (word embeddings, learned positions,
two transformer layers, mean over the words) map a scene and its caption to unit vectors; training
is CLIP's symmetric InfoNCE over a batch (Radford et al. 2021, arXiv 2103.00020) with a learned
temperature, on scenes the data generator draws and renders. Training is seeded and runs once
per settings hash (`eval.scorer`); the weights are cached under `<data.cache_dir>/scorer/`, with
the retrieval accuracy on held-out pairs measured when it was trained. `dalle-ablate
train-scorer` trains it and prints that accuracy.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dalle_ablate.data.scenes import COLS, PALETTE, REL_PHRASE, ROWS, SHAPES, SIZES, random_scene, render
from dalle_ablate.evaluate.convs import conv_features, strided_convs
from dalle_ablate.fileio import atomic_savez
from dalle_ablate.registry import OptionConfig

IMAGE_SIZE = 64
MAX_WORDS = 24


@dataclass
class ScorerConfig(OptionConfig):
    """eval.scorer: the contrastive shapes scorer's training (its hash names the cached weights)."""

    RANGES = {
        "train_images": "[1, inf)",
        "steps": "[1, inf)",
        "batch": "[2, inf)",
        "lr": "(0, inf)",
        "width": "[8, inf)",
        "held_out": "[2, inf)",
    }

    seed: int = 0  # the scorer's scenes, initialisation and batches
    train_images: int = 20000  # scenes drawn and rendered for training
    steps: int = 1000  # training updates
    batch: int = 128  # pairs per InfoNCE batch (each caption against 127 other images)
    lr: float = 2e-3  # Adam's learning rate
    width: int = 64  # embedding width of both encoders
    held_out: int = 512  # pairs (another seed) the retrieval accuracy is measured on

    def digest(self) -> str:
        return hashlib.sha256(json.dumps({"version": 2, **asdict(self)}, sort_keys=True).encode()).hexdigest()[:12]


def words(caption: str) -> list[str]:
    return re.findall(r"[a-z]+|,", caption.lower())


# Every word the scene grammar (data/scenes.py) can say; anything else is [unk].
VOCAB = ["[pad]", "[unk]", ","] + sorted(
    set(SHAPES)
    | set(PALETTE)
    | set(SIZES)
    | set(ROWS)
    | set(COLS)
    | {w for phrase in REL_PHRASE.values() for w in phrase.split()}
    | set("a an and is in at the there on white background of".split())
)
WORD_IDS = {w: i for i, w in enumerate(VOCAB)}


def encode_captions(captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(captions), MAX_WORDS), np.int32)
    for i, c in enumerate(captions):
        toks = [WORD_IDS.get(w, 1) for w in words(c)][:MAX_WORDS]
        ids[i, : len(toks)] = toks
    return ids, ids > 0


class TextEncoder(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(len(VOCAB), width, rngs=rngs)
        self.pos = nnx.Embed(MAX_WORDS, width, rngs=rngs)
        self.attn = nnx.List([nnx.MultiHeadAttention(4, width, decode=False, rngs=rngs) for _ in range(2)])
        self.norms = nnx.List([nnx.LayerNorm(width, rngs=rngs) for _ in range(4)])
        self.ffn = nnx.List(
            [
                nnx.Sequential(
                    nnx.Linear(width, 2 * width, rngs=rngs), jax.nn.gelu, nnx.Linear(2 * width, width, rngs=rngs)
                )
                for _ in range(2)
            ]
        )
        self.out = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.embed(ids) + self.pos(jnp.arange(ids.shape[1]))[None]
        pair = mask[:, None, :, None] & mask[:, None, None, :] | jnp.eye(ids.shape[1], dtype=bool)
        for i, (attn, ffn) in enumerate(zip(self.attn, self.ffn)):
            x = x + attn(self.norms[2 * i](x), mask=pair)
            x = x + ffn(self.norms[2 * i + 1](x))
        pooled = (x * mask[..., None]).sum(1) / jnp.maximum(mask.sum(1, keepdims=True), 1)
        return self.out(pooled)


class ImageEncoder(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.convs = strided_convs((3, 32, 64, 64), rngs)
        self.fc = nnx.Linear(8 * 8 * 64, 2 * width, rngs=rngs)
        self.out = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.fc(conv_features(self.convs, images))))


class Contrastive(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.image = ImageEncoder(width, rngs)
        self.text = TextEncoder(width, rngs)
        self.log_scale = nnx.Param(jnp.asarray(np.log(1 / 0.07), jnp.float32))  # CLIP's initial temperature

    def embed(self, images, ids, mask) -> tuple[jax.Array, jax.Array]:
        """Unit embeddings of the images and of the captions."""
        return unit(self.image(images)), self.embed_text(ids, mask)

    def embed_text(self, ids, mask) -> jax.Array:
        return unit(self.text(ids, mask))


def unit(v: jax.Array) -> jax.Array:
    return v / jnp.linalg.norm(v, axis=-1, keepdims=True)


def info_nce(model: Contrastive, images, ids, mask, neg_ids, neg_mask) -> jax.Array:
    """CLIP's symmetric cross-entropy, each image against every caption of the batch and back,
    with each image's hard negative caption (`hard_negative`) among its candidates too."""
    a, b = model.embed(images, ids, mask)
    neg = model.embed_text(neg_ids, neg_mask)
    scale = jnp.exp(jnp.minimum(model.log_scale[...], np.log(100.0)))  # CLIP clamps the scale at 100
    labels = jnp.arange(len(a))
    ce = optax.softmax_cross_entropy_with_integer_labels
    image_to_text = scale * jnp.concatenate([a @ b.T, a @ neg.T], axis=1)
    return 0.5 * (ce(image_to_text, labels).mean() + ce(scale * b @ a.T, labels).mean())


def hard_negative(caption: str, rng: np.random.Generator) -> str:
    """A caption that is wrong about the same scene: two different colours swapped (the binding
    error a bag of words cannot see), else one colour or shape word replaced. Trained against, as
    NegCLIP does (Yuksekgonul et al. 2023, arXiv 2210.01936), they make the scorer read which
    colour goes with which shape."""
    toks = caption.split(" ")
    colours = [i for i, w in enumerate(toks) if w.strip(",") in PALETTE]
    distinct = {toks[i].strip(",") for i in colours}
    if len(distinct) >= 2 and rng.random() < 0.7:
        i, j = rng.choice(colours, 2, replace=False)
        while toks[i].strip(",") == toks[j].strip(","):
            i, j = rng.choice(colours, 2, replace=False)
        wi, wj = toks[i].strip(","), toks[j].strip(",")
        toks[i], toks[j] = toks[i].replace(wi, wj), toks[j].replace(wj, wi)
        return " ".join(toks)
    slots = [(i, PALETTE) for i in colours] + [(i, SHAPES) for i, w in enumerate(toks) if w.strip(",") in SHAPES]
    i, kind = slots[rng.integers(len(slots))]
    word = toks[i].strip(",")
    toks[i] = toks[i].replace(word, str(rng.choice([w for w in kind if w != word])))
    return " ".join(toks)


def scene_pairs(n: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """n scenes of the data generator (one to three objects): 64 px renders and their captions."""
    rng = np.random.default_rng(seed)
    scenes = [random_scene(rng) for _ in range(n)]
    return np.stack([render(s, IMAGE_SIZE) for s in scenes]), [s.caption for s in scenes]


def resized(images: np.ndarray) -> np.ndarray:
    """Images of another size brought to the encoder's 64 px (bilinear)."""
    if images.shape[1:3] == (IMAGE_SIZE, IMAGE_SIZE):
        return images
    from PIL import Image

    return np.stack(
        [np.asarray(Image.fromarray(im).resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)) for im in images]
    )


def train(settings: ScorerConfig) -> Contrastive:
    images, captions = scene_pairs(settings.train_images, settings.seed + 1)
    ids, mask = encode_captions(captions)
    model = Contrastive(settings.width, nnx.Rngs(settings.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.lr, min(100, settings.steps // 10), settings.steps)
    opt = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, t, m, nt, nm):
        loss, grads = nnx.value_and_grad(lambda mdl: info_nce(mdl, x, t, m, nt, nm))(model)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(settings.seed)
    for _ in range(settings.steps):
        idx = rng.choice(len(images), settings.batch, replace=False)
        neg_ids, neg_mask = encode_captions([hard_negative(captions[i], rng) for i in idx])
        step(model, opt, *(jnp.asarray(x) for x in (images[idx], ids[idx], mask[idx], neg_ids, neg_mask)))
    return model


class ContrastiveScorer:
    """The scorer's interface (as `clip.CLIPScorer`): `scores(images, texts)`, 100 * cos per pair,
    and `hash`. `retrieval` holds the held-out accuracy measured when it was trained."""

    def __init__(self, cache_dir: str | Path, settings: ScorerConfig):
        self.settings = settings
        self.hash = settings.digest()
        self._embed = nnx.jit(lambda m, x, t, k: m.embed(x, t, k))
        path = Path(cache_dir).expanduser() / "scorer" / f"{self.hash}.npz"
        graphdef, state = nnx.split(Contrastive(settings.width, nnx.Rngs(0)))
        leaves, treedef = jax.tree_util.tree_flatten(nnx.to_pure_dict(state))
        if path.exists():
            flat = np.load(path)
            nnx.replace_by_pure_dict(
                state, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[f"p{i}"]) for i in range(len(leaves))])
            )
            self.model = nnx.merge(graphdef, state)
            self.retrieval = json.loads(str(flat["retrieval"]))
            self.trained = False
        else:
            self.model = train(settings)
            self.retrieval = retrieval_accuracy(self, *scene_pairs(settings.held_out, settings.seed + 2))
            path.parent.mkdir(parents=True, exist_ok=True)
            leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(self.model)))
            atomic_savez(
                path, retrieval=json.dumps(self.retrieval), **{f"p{i}": np.asarray(x) for i, x in enumerate(leaves)}
            )
            self.trained = True
        self.path = path

    def embeddings(self, images: np.ndarray, texts: list[str], batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = encode_captions(texts)
        images = resized(np.asarray(images, np.uint8))
        out = [
            self._embed(
                self.model,
                jnp.asarray(images[i : i + batch]),
                jnp.asarray(ids[i : i + batch]),
                jnp.asarray(mask[i : i + batch]),
            )
            for i in range(0, len(images), batch)
        ]
        return np.concatenate([np.asarray(a) for a, _ in out]), np.concatenate([np.asarray(b) for _, b in out])

    def scores(self, images: np.ndarray, texts: list[str]) -> np.ndarray:
        a, b = self.embeddings(images, texts)
        return 100.0 * (a * b).sum(-1)


def retrieval_accuracy(
    scorer: ContrastiveScorer, images: np.ndarray, captions: list[str], group: int = 64
) -> dict[str, Any]:
    """Top-1 retrieval in groups of `group` held-out pairs: each caption's image among the group's
    images, and each image's caption among its captions (chance 1 / group)."""
    a, b = scorer.embeddings(images, captions)
    hits_t2i = hits_i2t = n = 0
    for s in range(0, len(a) - group + 1, group):
        sim = a[s : s + group] @ b[s : s + group].T  # [image, caption]
        hits_t2i += int((sim.argmax(0) == np.arange(group)).sum())
        hits_i2t += int((sim.argmax(1) == np.arange(group)).sum())
        n += group
    return {
        "text_to_image": hits_t2i / n,
        "image_to_text": hits_i2t / n,
        "pairs": n,
        "group": group,
        "binding": binding_accuracy(scorer, images, captions),
    }


def binding_accuracy(scorer: ContrastiveScorer, images: np.ndarray, captions: list[str]) -> float:
    """Over the pairs whose caption names two different colours: how often the true caption
    outscores it with two of those colours swapped (0.5: a bag of words)."""
    rng = np.random.default_rng(0)
    picked, swapped = [], []
    for i, c in enumerate(captions):
        if len({w for w in words(c) if w in PALETTE}) >= 2:
            neg = c
            while neg == c or sorted(words(neg)) != sorted(words(c)):  # a swap, not a replacement
                neg = hard_negative(c, rng)
            picked.append(i)
            swapped.append(neg)
    if not picked:
        return float("nan")
    return float(
        (scorer.scores(images[picked], [captions[i] for i in picked]) > scorer.scores(images[picked], swapped)).mean()
    )


_LOADED: dict[tuple[str, str], ContrastiveScorer] = {}


def contrastive_scorer(cache_dir: str, settings: ScorerConfig) -> ContrastiveScorer:
    """The scorer of these settings, trained or loaded once per process."""
    key = (str(cache_dir), settings.digest())
    if key not in _LOADED:
        _LOADED[key] = ContrastiveScorer(cache_dir, settings)
    return _LOADED[key]
