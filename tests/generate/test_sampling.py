"""The KV-cache sampler: cached decoding equals the full forward pass token by token for every
layout, super conditioning follows its formula, scale 1 is unguided sampling, and invalid ids
are never drawn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import CONF, cached_vs_full, run_config
from dalle_ablate.generate import guide_logits, make_sampler, top_p_mask
from dalle_ablate.model import build_model, resolve

LAYOUTS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
IMAGE_LEN, IMAGE_VOCAB, TEXT_VOCAB = 16, 30, 40


def small_model(*overrides: str, image_len: int = IMAGE_LEN):
    swin = ["model.swin_ln_every=2"] if "model=swinv2" in overrides else []  # a stream norm inside the stack
    dalle = ["model.conv_kernel=3"] if "model=dalle" in overrides else []  # a 4 x 4 grid
    cfg = run_config(*overrides, "model.decoder_layers=3", *swin, *dalle).model
    return build_model(resolve(cfg, image_len=image_len, image_vocab=IMAGE_VOCAB, text_vocab=TEXT_VOCAB), seed=1)


def text_batch(b: int, t: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t, b)
    return (
        jnp.asarray(rng.integers(4, TEXT_VOCAB, (b, t)), jnp.int32),
        jnp.asarray(np.arange(t)[None] < lengths[:, None]),
    )


def test_every_layout_is_covered():
    assert {"preln", "postln", "normformer", "deepnet", "sandwich", "subln", "swinv2"} <= set(LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_decoding_equals_the_full_forward_pass_token_by_token(layout):
    """Every model preset, the single-stream `dalle` (its default row, column and conv layers) included."""
    model = small_model(f"model={layout}", "model.dropout=0.1", "model.attention_dropout=0.1")
    text, mask = text_batch(3)
    codes = jnp.asarray(np.random.default_rng(1).integers(0, IMAGE_VOCAB, (3, IMAGE_LEN)), jnp.int32)
    assert cached_vs_full(model, text, mask, codes) <= 1, layout


def test_cached_decoding_with_norm_softmax_equals_the_full_forward_pass():
    """NormSoftmax's std is over the keys a query sees: a cached row's filled keys, a causal row's
    keys before it, the caption's unpadded tokens in cross-attention. Both layout families."""
    for layout in ("preln", "dalle"):
        model = small_model(f"model={layout}", "model.norm_softmax=true")
        text, mask = text_batch(3)
        codes = jnp.asarray(np.random.default_rng(1).integers(0, IMAGE_VOCAB, (3, IMAGE_LEN)), jnp.int32)
        assert cached_vs_full(model, text, mask, codes) <= 1, layout


def test_guidance_formula_on_hand_made_logits():
    c = jnp.array([[2.0, 0.0, -1.0]])
    u = jnp.array([[1.0, 1.0, -1.0]])
    for s in (0.0, 1.0, 3.0):
        np.testing.assert_allclose(np.asarray(guide_logits(c, u, jnp.asarray(s))), [[1 + s, 1 - s, -1.0]])
    # scale 1 is the conditional logits exactly, not u + (c - u) rounded
    c = jnp.array([[0.1, 1e8, -3.3]], jnp.float32)
    u = jnp.array([[7.7, -2e8, 0.9]], jnp.float32)
    assert np.array_equal(np.asarray(guide_logits(c, u, jnp.asarray(1.0))), np.asarray(c))


def test_top_p_keeps_the_smallest_set_above_p():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.25, 0.05]]))
    kept = np.asarray(top_p_mask(logits, 0.7))
    assert kept.tolist() == [[True, False, True, False]]  # 0.5 + 0.25 >= 0.7
    assert np.asarray(top_p_mask(logits, 0.5)).tolist() == [[True, False, False, False]]
    assert np.asarray(top_p_mask(logits, 1.0)).all()


def test_scale_one_equals_unguided_and_seeds_are_fixed_across_scales():
    model = small_model("model=preln")
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask = text_batch(4)
    blank, blank_mask = text_batch(1, seed=5)
    key = jax.random.key(3)
    plain = make_sampler(graphdef, IMAGE_LEN, guided=False)
    guided = make_sampler(graphdef, IMAGE_LEN, guided=True)
    a = np.asarray(plain(params, text, mask, key))
    b = np.asarray(guided(params, text, mask, key, blank, blank_mask, jnp.asarray(1.0)))
    assert np.array_equal(a, b)
    assert np.array_equal(a, np.asarray(plain(params, text, mask, key)))  # seeded: same key, same codes
    assert not np.array_equal(a, np.asarray(plain(params, text, mask, jax.random.key(4))))
    assert a.min() >= 0 and a.max() < IMAGE_VOCAB
    # a large scale changes the samples, with the same noise
    c = np.asarray(guided(params, text, mask, key, blank, blank_mask, jnp.asarray(8.0)))
    assert not np.array_equal(a, c)


def test_guided_sampling_follows_the_guided_distribution():
    """With temperature 1, the first token's empirical distribution over many seeds matches
    softmax(u + s (c - u)) computed here from the model's own logits."""
    model = small_model("model=preln", "model.init_std=0.2")
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask = text_batch(1)
    blank, blank_mask = text_batch(1, seed=5)
    s = 3.0
    n = 4000
    bos = jnp.full((1,), model.bos_id, jnp.int32)
    c = model.decode_step(bos, jnp.asarray(0), model.start_decoding(model.encode(text, mask)), mask)[0]
    u = model.decode_step(bos, jnp.asarray(0), model.start_decoding(model.encode(blank, blank_mask)), blank_mask)[0]
    want = np.asarray(jax.nn.softmax(u + s * (c - u)))[0, :IMAGE_VOCAB]
    guided = make_sampler(graphdef, 1, guided=True)
    first = jax.vmap(lambda k: guided(params, text, mask, k, blank, blank_mask, jnp.asarray(s))[0, 0])(
        jax.random.split(jax.random.key(0), n)
    )
    got = np.bincount(np.asarray(first), minlength=IMAGE_VOCAB) / n
    assert got.shape == (IMAGE_VOCAB,)  # BOS and padding rows never drawn
    assert np.abs(got - want).max() < 4 * np.sqrt(want.max() / n) + 1e-3


def test_bos_and_padding_ids_are_never_sampled_even_if_their_logits_win():
    model = small_model("model=preln")
    head = model.lm_head.kernel
    head[...] = head[...].at[:, IMAGE_VOCAB:].set(100.0)  # BOS and padding rows would dominate
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask = text_batch(4)
    blank, blank_mask = text_batch(1, seed=5)
    codes = np.asarray(
        make_sampler(graphdef, IMAGE_LEN, guided=True, top_p=0.9)(
            params, text, mask, jax.random.key(0), blank, blank_mask, jnp.asarray(3.0)
        )
    )
    assert codes.max() < IMAGE_VOCAB


def test_sampler_config_errors_name_the_flag():
    from dalle_ablate.registry import ConfigError

    model = small_model("model=preln")
    graphdef = nnx.split(model, nnx.Param)[0]
    with pytest.raises(ConfigError, match=r"samples.top_p=1.5 must be in \(0, 1\] or null"):
        make_sampler(graphdef, IMAGE_LEN, top_p=1.5)
    with pytest.raises(ConfigError, match="samples.temperature=0 must be positive"):
        make_sampler(graphdef, IMAGE_LEN, temperature=0)


def test_cached_sampling_matches_uncached_sampling():
    """The KV-cache sampler draws exactly what re-running the decoder over the prefix draws."""
    model = small_model("model=swinv2")
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask = text_batch(2)
    key = jax.random.key(7)
    codes = np.asarray(make_sampler(graphdef, IMAGE_LEN)(params, text, mask, key))
    enc = model.encode(text, mask)
    ref = jnp.zeros((2, IMAGE_LEN), jnp.int32)
    for i in range(IMAGE_LEN):
        logits = model.decode(model.decoder_inputs(ref), enc, mask)[:, i]
        ref = ref.at[:, i].set(jax.random.categorical(jax.random.fold_in(key, i), logits))
    assert np.array_equal(codes, np.asarray(ref))


def test_image_grid_puts_captions_above_framed_nearest_neighbour_images():
    from dalle_ablate.generate import image_grid

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 5, 7, 3)).astype(np.uint8)  # 2 captions x 3 samples, 5x7 px
    grid = image_grid(images, ["a red circle", "two blue squares"], per_row=3, scale=3)
    label, pad, ih, iw = 16, 2, 5 * 3 + 4, 7 * 3 + 4
    assert grid.shape == (2 * (label + ih), 3 * iw, 3)
    for k, img in enumerate(images):
        r, c = divmod(k, 3)
        y, x = r * (label + ih) + label, c * iw
        # the image, each pixel repeated 3x3 (nearest neighbour), inside a grey frame
        np.testing.assert_array_equal(
            grid[y + pad : y + ih - pad, x + pad : x + iw - pad], img.repeat(3, 0).repeat(3, 1)
        )
        frame = np.concatenate(
            [grid[y, x : x + iw], grid[y + ih - 1, x : x + iw], grid[y : y + ih, x], grid[y : y + ih, x + iw - 1]]
        )
        assert (frame == 170).all()
    for r in range(2):  # the caption band: text (dark) on white, and some text drawn
        band = grid[r * (label + ih) : r * (label + ih) + label]
        assert (band.min(-1) == band.max(-1)).all() and (band < 128).any()
