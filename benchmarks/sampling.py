"""Sampling and evaluator throughput.

    python benchmarks/sampling.py [--batch 8] [overrides...]        (default size=tiny)

Prints image tokens/s of the KV-cache sampler against re-running the decoder over the whole
prefix at every position (what the sampler did before), for 64 and 256 image tokens, the cost of
super conditioning (guided / unguided time), and the throughput of the evaluators. Random
weights: speed does not depend on them. Ratios come from one run of this script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import writes_page  # noqa: E402


def timed(fn, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def uncached_sampler(graphdef, image_len: int):
    """The sampler without a cache: the decoder re-runs over all positions for every token."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    def sample(params, text, text_mask, key):
        model = nnx.merge(graphdef, params)
        enc = model.encode(text, text_mask)

        def body(i, codes):
            logits = model.decode(model.decoder_inputs(codes), enc, text_mask)[:, i]
            return codes.at[:, i].set(jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32))

        return jax.lax.fori_loop(0, image_len, body, jnp.zeros((text.shape[0], image_len), jnp.int32))

    return jax.jit(sample)


@writes_page("Sampling and evaluator throughput")
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dalle_ablate.validate import compose
    from dalle_ablate.generate import make_sampler
    from dalle_ablate.model import build_model, resolve
    from dalle_ablate.validate import to_run_config

    cfg = to_run_config(compose(["size=tiny", *args.overrides]))
    b = args.batch
    rng = np.random.default_rng(0)
    text = jnp.asarray(rng.integers(4, 500, (b, cfg.model.text_len)), jnp.int32)
    mask = jnp.ones((b, cfg.model.text_len), bool)
    blank, blank_mask = text[:1], mask[:1].at[:, 1:].set(False)
    key = jax.random.key(0)
    print(f"size: d_model={cfg.model.d_model} decoder_layers={cfg.model.decoder_layers}, batch {b}")
    print(f"{'image tokens':>12}{'cached tok/s':>14}{'uncached tok/s':>16}{'speed-up':>10}{'guided / unguided':>19}")
    for image_len in (64, 256):
        mcfg = resolve(cfg.model, image_len=image_len, image_vocab=1024, text_vocab=512)
        graphdef, params = nnx.split(build_model(mcfg, 0), nnx.Param)
        plain = make_sampler(graphdef, image_len)
        guided = make_sampler(graphdef, image_len, guided=True)
        t_cached = timed(lambda: plain(params, text, mask, key))
        t_guided = timed(lambda: guided(params, text, mask, key, blank, blank_mask, jnp.asarray(3.0)))
        t_full = timed(lambda: uncached_sampler(graphdef, image_len)(params, text, mask, key), repeats=1)
        tokens = b * image_len
        print(
            f"{image_len:>12}{tokens / t_cached:>14,.0f}{tokens / t_full:>16,.0f}{t_full / t_cached:>9.1f}x{t_guided / t_cached:>18.2f}x"
        )

    from dalle_ablate.data.scenes import random_scene, render
    from dalle_ablate.evaluate.shapes_features import shapes_features
    from dalle_ablate.evaluate.shapes_parser import accuracy

    r = np.random.default_rng(1)
    scenes = [random_scene(r) for _ in range(256)]
    images = np.stack([render(s) for s in scenes])
    specs = [s.to_dict() for s in scenes]
    t = time.perf_counter()
    accuracy(images, specs)
    parse_rate = len(images) / (time.perf_counter() - t)
    net = shapes_features(str(Path(cfg.data.cache_dir).expanduser()))
    net.extract(images)
    t = time.perf_counter()
    net.extract(images)
    feat_rate = len(images) / (time.perf_counter() - t)
    print(f"\nevaluators (64 px images/s): shapes parser {parse_rate:,.0f}, shapes_fd features {feat_rate:,.0f}")

    # The pretrained scorers at their real sizes, random weights (speed does not depend on them).
    import tempfile

    from flax import nnx

    from dalle_ablate.evaluate import clip, inception
    from dalle_ablate.weights import random_arrays

    with tempfile.TemporaryDirectory() as tmp:
        inception.save_inception(random_arrays(lambda: inception.InceptionV3(nnx.Rngs(0)), 0), f"{tmp}/i.npz")
        fid_net = inception.InceptionFeatures(f"{tmp}/i.npz", batch_size=32)
        cfg_b32 = clip.PRESETS["ViT-B/32"]
        merges = [f"{a} {b}" for a in "abcdefghij" for b in "abcdefghij"]  # the tokenizer's cost is not measured here
        clip.save_clip(random_arrays(lambda: clip.CLIP(cfg_b32, nnx.Rngs(0)), 0), merges, f"{tmp}/c.npz", cfg_b32)
        scorer = clip.CLIPScorer(f"{tmp}/c.npz", batch_size=32)
    batch, captions = images[:32], [s["caption"] for s in specs[:32]]
    rates = {}
    for name, fn in (
        ("fid (Inception, 299 px)", lambda: fid_net(batch)),
        ("clip (ViT-B/32, 224 px)", lambda: scorer.scores(batch, captions)),
    ):
        fn()  # compile
        t = time.perf_counter()
        for _ in range(2):
            fn()
        rates[name] = 2 * len(batch) / (time.perf_counter() - t)
    print("pretrained scorers (images/s, batch 32): " + ", ".join(f"{k} {v:,.1f}" for k, v in rates.items()))


if __name__ == "__main__":
    main()
