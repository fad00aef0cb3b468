"""Random weights files of the pretrained scoring networks (dalle_ablate.weights.random_arrays:
NumPy draws from the abstract shapes, no torch)."""

from __future__ import annotations

from flax import nnx

from dalle_ablate.evaluate import clip, inception
from dalle_ablate.weights import random_arrays


def inception_file(path, seed: int = 0):
    inception.save_inception(random_arrays(lambda: inception.InceptionV3(nnx.Rngs(0)), seed), path)
    return path


# A small BPE (every pair of ten letters) and a small CLIP over it: the layout of the real one.
MERGES = [f"{a} {b}" for a in "abcdefghij" for b in "abcdefghij"]
SMALL_CLIP = clip.CLIPConfig(
    embed_dim=16,
    image_size=32,
    patch_size=16,
    vision_width=32,
    vision_layers=1,
    vision_heads=2,
    context_length=77,
    vocab_size=512 + len(MERGES) + 2,
    text_width=32,
    text_heads=2,
    text_layers=1,
)


def clip_file(path, seed: int = 0):
    clip.save_clip(random_arrays(lambda: clip.CLIP(SMALL_CLIP, nnx.Rngs(0)), seed), MERGES, path, SMALL_CLIP)
    return path
