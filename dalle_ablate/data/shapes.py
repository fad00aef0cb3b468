"""The built-in `shapes` dataset: scenes rendered, tokenised by an image tokenizer
(`data.tokenizer`: kmeans, dvae or vqgan; data/image_tokenizer.py) and cached.

Splits are generated from `data.seed` (train, valid and test each from their own stream), so the
same settings always give the same examples; the run's `seed` only orders them. Everything that
is slow (rendering, fitting the tokenizer, encoding) is cached under a hash of the settings: the
tokenizer under its own (`<cache_dir>/<tokenizer>/`), the codes under both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from dalle_ablate import interrupts
from dalle_ablate.data.base import DATASETS, Batch, DataConfig, Dataset, eval_index_batches, host_share, unigram_entropy
from dalle_ablate.data.dvae import DVAEConfig, groups
from dalle_ablate.data.image_tokenizer import IMAGE_TOKENIZERS, ImageTokenizer
from dalle_ablate.data.scenes import DEMO_CAPTIONS, MIXES, TIER_OBJECTS, TIERS, Scene, random_scene, render, tier
from dalle_ablate.data.text_tokenizer import TextTokenizer
from dalle_ablate.fileio import atomic_savez, atomic_write
from dalle_ablate.registry import ConfigError, check

SPLITS = ("train", "valid", "test")


@dataclass
class ShapesDataConfig(DataConfig):
    """Procedural scenes of coloured shapes, tokenised by an image tokenizer (data.tokenizer)."""

    RANGES = {
        "image_size": "[1, inf)",
        "patch_size": "[1, inf)",
        "codebook_size": "[2, inf) or null",
        "num_train": "[1, inf)",
        "num_valid": "[1, inf)",
        "num_test": "[1, inf)",
        "kmeans_patches": "[1, inf)",
        "kmeans_iters": "[1, inf)",
        "min_objects": "[1, 9]",
        "max_objects": "[1, 9]",  # the scene grid has 9 cells
    }

    name: str = "shapes"
    seed: int = 0  # fixes the scenes of every split; the run's seed only orders them
    # 48 px: the 3x3 scene grid falls on the 8 px patch grid (a cell is 2x2 patches), so every object
    # is the same 4 patches wherever it stands and the image is 36 tokens. The renders have exactly
    # 145 distinct patches (white, and 4 for each of 6 colours x 3 shapes x 2 sizes): 145 codes make
    # the k-means tokenizer lossless, so whatever a sample gets wrong, the model got wrong. At 64 px
    # (cells of 21.3 px, 64 tokens, 1024 codes) the default model drew 34% of single objects right
    # after 3000 steps, at 48 px 70% (docs/results/default-job.md).
    image_size: int = 48
    patch_size: int = 8  # pixels per token side: 8 on 48 px = 36 image tokens; on 64 px 64 tokens, 4 on 64 px = 256 (DALL·E Mega's count)
    # Codes of the image tokenizer (the model's image vocabulary); null = the tokenizer's own default
    # (kmeans 145: every distinct patch at 48 px, lossless; dvae 512, data/dvae.py says why); vqgan
    # needs its weights' n_embed.
    codebook_size: Optional[int] = None
    tokenizer: str = "kmeans"  # kmeans | dvae | vqgan (data/image_tokenizer.py)
    dvae: DVAEConfig = field(default_factory=DVAEConfig)  # data.tokenizer=dvae's shape and training
    vqgan_path: Optional[str] = None  # data.tokenizer=vqgan's weights (.npz, dalle-ablate convert-vqgan)
    num_train: int = 20000  # scenes rendered for training
    num_valid: int = 512  # scenes of the validation split (eval/valid/loss)
    num_test: int = 512  # scenes of the test split
    min_objects: int = 1  # objects per scene, at least
    max_objects: int = 3  # objects per scene, at most (the captions know 1 to 3)
    # How scenes are drawn (data/scenes.py random_scene): tiers = each evaluation tier (one, two,
    # three, relation) equally often; counts = the object count uniform, which left lists of two
    # objects at 13% of the data and the quickstart's two-object tier its weakest (docs/results/default-job.md).
    mix: str = "tiers"
    kmeans_patches: int = 1_000_000  # patches (of whole training renders) the codebook is fitted on
    kmeans_iters: int = 20  # Lloyd iterations of the k-means codebook
    text_vocab_size: int = 256

    def validate(self, run) -> None:
        super().validate(run)
        check(
            self.min_objects <= self.max_objects,
            f"data.min_objects={self.min_objects} exceeds data.max_objects={self.max_objects}",
        )
        check(
            self.max_objects <= 3,  # the captions and the evaluation's tiers know scenes of 1 to 3 objects
            f"data.min_objects={self.min_objects}, data.max_objects={self.max_objects}: need 1 <= min <= max <= 3",
        )
        check(self.mix in MIXES, f"data.mix={self.mix!r} is not one of {', '.join(MIXES)}")
        check(
            self.image_size % self.patch_size == 0,
            f"data.patch_size={self.patch_size} does not divide data.image_size={self.image_size}",
        )
        IMAGE_TOKENIZERS.get(self.tokenizer)
        if self.tokenizer == "dvae":
            groups(self.patch_size)
            self.dvae.check_all(run, "data.dvae")
        check(
            self.tokenizer != "vqgan" or bool(self.vqgan_path),
            "data.tokenizer=vqgan needs data.vqgan_path (VQGAN weights .npz from dalle-ablate convert-vqgan)",
        )
        self.vocab()  # a tokenizer without a default size (vqgan) refuses a null data.codebook_size here

    def vocab(self) -> int:
        """data.codebook_size, or the tokenizer's default where it is null."""
        return self.codebook_size or IMAGE_TOKENIZERS.get(self.tokenizer).default_size(self)

    def image_sizes(self) -> dict[str, int]:
        return {"image_len": (self.image_size // self.patch_size) ** 2, "image_vocab": self.vocab()}


_VERSION = "shapes-v3"  # bump when scenes, rendering or the cache's layout change


def generate_split(cfg, split: str) -> tuple[list[dict], np.ndarray]:
    """Scene specs (with captions) and renders [N, S, S, 3] uint8 of one split."""
    n = {"train": cfg.num_train, "valid": cfg.num_valid, "test": cfg.num_test}[split]
    rng = np.random.default_rng([cfg.seed, SPLITS.index(split)])
    scenes = [random_scene(rng, cfg.min_objects, cfg.max_objects, cfg.mix) for _ in range(n)]
    images = (
        np.stack([_render(s, cfg.image_size) for s in scenes])
        if n
        else np.zeros((0, cfg.image_size, cfg.image_size, 3), np.uint8)
    )
    return [s.to_dict() for s in scenes], images


def _render(scene: Scene, size: int) -> np.ndarray:
    interrupts.check("while rendering the data")  # the training split alone takes a minute at the default size
    return render(scene, size)


def stratified_prompts(n: int, seed: int) -> list[dict]:
    """n scene specs, tier by tier (the first n % 4 tiers get one more), each tier drawn by
    rejection from random scenes of its object count; deterministic in (n, seed)."""
    rng = np.random.default_rng([seed, len(SPLITS)])  # a stream no split uses
    out = []
    for i, name in enumerate(TIERS):
        out += [tier_prompt(rng, name) for _ in range(n // len(TIERS) + (i < n % len(TIERS)))]
    return out


def tier_prompt(rng: np.random.Generator, name: str) -> dict:
    """One evaluation prompt's scene spec of tier `name`: a random scene of its object count,
    drawn again until it is of that tier (for one object, until its caption states all four
    attributes)."""
    objects = TIER_OBJECTS[name]
    while True:
        spec = random_scene(rng, objects, objects).to_dict()
        if tier(spec) == name and (name != "one" or len(spec["objects"][0]["said"]) == 4):
            return spec


def scenes_key(cfg) -> str:
    """The hash of the settings that determine the scenes and their renders."""
    fields = [
        _VERSION,
        cfg.seed,
        cfg.image_size,
        cfg.num_train,
        cfg.num_valid,
        cfg.num_test,
        cfg.min_objects,
        cfg.max_objects,
        cfg.mix,
    ]
    return hashlib.sha256("|".join(map(str, fields)).encode()).hexdigest()[:16]


def cache_key(cfg) -> str:
    """The scenes' hash with the tokenizer's: names the cached codes."""
    scenes = scenes_key(cfg)
    fields = [scenes, cfg.tokenizer, IMAGE_TOKENIZERS.get(cfg.tokenizer).key(cfg, scenes)]
    return hashlib.sha256("|".join(map(str, fields)).encode()).hexdigest()[:16]


def build_tokenizer(cfg, log=None) -> ImageTokenizer:
    """data.tokenizer fitted on the training renders, or loaded from its cache (rendering only
    when it has to be fitted); `log(step, metrics)` hears a training's progress."""
    return IMAGE_TOKENIZERS.get(cfg.tokenizer).build(cfg, lambda: generate_split(cfg, "train")[1], scenes_key(cfg), log)


def build_or_load(cfg) -> tuple[dict[str, list[dict]], dict[str, np.ndarray], ImageTokenizer]:
    """(scene specs per split, codes per split, tokenizer), from the cache when present."""
    root = Path(cfg.cache_dir).expanduser() / "shapes" / cache_key(cfg)
    if (root / "done").is_file():
        specs = json.loads((root / "scenes.json").read_text())
        with np.load(root / "codes.npz") as f:
            codes = {s: f[s] for s in SPLITS}
        return specs, codes, build_tokenizer(cfg)
    specs, images = {}, {}
    for split in SPLITS:
        specs[split], images[split] = generate_split(cfg, split)
    tokenizer = IMAGE_TOKENIZERS.get(cfg.tokenizer).build(cfg, lambda: images["train"], scenes_key(cfg))
    codes = {s: tokenizer.encode(images[s]) for s in SPLITS}
    root.mkdir(parents=True, exist_ok=True)
    # Each file is written under a temporary name and renamed, and "done" comes last: a crash
    # leaves a cache that is rebuilt, never read, and concurrent builders (parallel test workers,
    # a multirun's jobs) write identical files without tearing them.
    atomic_savez(root / "codes.npz", **codes)
    atomic_write(root / "scenes.json", json.dumps(specs))
    atomic_write(root / "done", "ok\n")
    return specs, codes, tokenizer


class ShapesDataset(Dataset):
    name = "shapes"

    def __init__(self, cfg, text_len: int):
        self.cfg = cfg
        self.specs, self.codes, self.tokenizer = build_or_load(cfg)
        self.captions = {s: [d["caption"] for d in self.specs[s]] for s in SPLITS}
        if cfg.tokenizer_path:
            self.text = TextTokenizer.from_file(cfg.tokenizer_path, text_len)
        else:
            self.text = TextTokenizer.trained_or_cached(
                self.captions["train"], cfg.text_vocab_size, text_len, Path(cfg.cache_dir).expanduser()
            )
        self.tokens = {s: self.text.encode(self.captions[s]) for s in SPLITS}
        self.image_len = self.codes["train"].shape[1]
        self.image_vocab = self.tokenizer.size
        self.blank_caption_prob = cfg.blank_caption_prob
        self.info = {
            "num_train": cfg.num_train,
            "num_valid": cfg.num_valid,
            "image_len": self.image_len,
            "image_vocab": self.image_vocab,
            "text_vocab": self.text.vocab_size,
            "code_unigram_entropy": unigram_entropy(self.codes["train"], self.image_vocab),
        }

    def split_batch(self, split: str, idx: np.ndarray, weights: np.ndarray | None = None) -> Batch:
        ids, mask = self.tokens[split]
        return self.make_batch(ids[idx], mask[idx], self.codes[split][idx], weights)

    def train_batches(self, batch_size, seed, start_step=0, process_index=0, process_count=1) -> Iterator[Batch]:
        n = len(self.codes["train"])
        per_epoch = n // batch_size
        if per_epoch == 0:
            raise ConfigError(f"trainer.batch_size={batch_size} exceeds data.num_train={n}")
        step = start_step
        while True:
            epoch, pos = divmod(step, per_epoch)
            # The order of every epoch is a function of (seed, epoch) alone: resuming at any
            # step reproduces exactly the batches an uninterrupted run would have seen.
            perm = np.random.default_rng([seed, 1, epoch]).permutation(n)
            rows = host_share(np.arange(batch_size), process_index, process_count)
            batch = self.split_batch("train", perm[pos * batch_size : (pos + 1) * batch_size][rows])
            yield self.blank_captions(batch, np.random.default_rng([seed, 2, step]), rows, batch_size)
            step += 1

    def eval_batches(self, batch_size: int, max_batches: Optional[int] = None, split: str = "valid") -> Iterator[Batch]:
        for idx, weights in eval_index_batches(len(self.codes[split]), batch_size, max_batches):
            yield self.split_batch(split, idx, weights)

    def demo_captions(self) -> list[str]:
        return list(DEMO_CAPTIONS)

    def has_image_decoder(self) -> bool:
        return True

    def decode_images(self, codes: np.ndarray) -> np.ndarray:
        return self.tokenizer.decode(codes)

    def valid_examples(self, n: int) -> tuple[list[str], np.ndarray]:
        return self.captions["valid"][:n], self.codes["valid"][:n]

    def reference_images(self, n: int) -> np.ndarray:
        return np.stack([render(Scene.from_dict(s), self.cfg.image_size) for s in self.specs["valid"][:n]])

    def eval_prompts(self, n: int) -> tuple[list[str], list[dict]]:
        """A fixed, stratified prompt set: n split equally over the difficulty tiers (one object
        with colour, shape, size and cell stated; two; three; two in a relation), drawn from a
        stream of their own (data.seed), so every run of these settings is scored on the same
        prompts whatever the valid split holds."""
        specs = stratified_prompts(n, self.cfg.seed)
        return [s["caption"] for s in specs], specs

    def eval_reference_images(self, n: int) -> np.ndarray:
        return np.stack([render(Scene.from_dict(s), self.cfg.image_size) for s in self.eval_prompts(n)[1]])


@DATASETS.option("shapes", ShapesDataConfig)
def shapes(cfg: ShapesDataConfig, model_cfg) -> ShapesDataset:
    return ShapesDataset(cfg, model_cfg.text_len)
