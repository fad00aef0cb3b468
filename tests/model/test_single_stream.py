"""The single-stream family (OpenAI's DALL·E): its masks against hand-written references, the
learned per-position padding, the text/image loss weighting, cached decoding for every pattern,
and the `dalle12b` parameter count from the paper's shapes."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT, cached_vs_full, compose, run_config
from dalle_ablate.model import abstract_model, build_model, param_count, resolve
from dalle_ablate.model.masks import image_pairs, layer_patterns, stream_mask
from dalle_ablate.registry import ConfigError
from dalle_ablate.train.gradients import objective
from dalle_ablate.validate import to_run_config

TEXT_VOCAB, IMAGE_VOCAB = 40, 30


def seen(mask: np.ndarray) -> dict[int, set[int]]:
    return {q: set(np.flatnonzero(row).tolist()) for q, row in enumerate(mask)}


# A 3 x 3 grid, raster order:   0 1 2
#                               3 4 5
#                               6 7 8
def test_row_mask_sees_back_to_the_same_column_of_the_previous_row():
    assert seen(image_pairs("row", 3, 0)) == {
        0: {0},
        1: {0, 1},
        2: {0, 1, 2},
        3: {0, 1, 2, 3},
        4: {1, 2, 3, 4},
        5: {2, 3, 4, 5},
        6: {3, 4, 5, 6},
        7: {4, 5, 6, 7},
        8: {5, 6, 7, 8},
    }


def test_column_mask_sees_the_earlier_tokens_of_its_column():
    assert seen(image_pairs("column", 3, 0)) == {
        0: {0},
        1: {1},
        2: {2},
        3: {0, 3},
        4: {1, 4},
        5: {2, 5},
        6: {0, 3, 6},
        7: {1, 4, 7},
        8: {2, 5, 8},
    }


def test_conv_mask_is_a_causal_3x3_neighbourhood_that_wraps_like_the_row_mask():
    # 4: rows 0-1, columns 0-2 up to itself; 3 (left edge) wraps to 2, the end of the row above
    assert seen(image_pairs("conv", 3, 3)) == {
        0: {0},
        1: {0, 1},
        2: {0, 1, 2},
        3: {0, 1, 2, 3},
        4: {0, 1, 2, 3, 4},
        5: {1, 2, 3, 4, 5},
        6: {2, 3, 4, 5, 6},
        7: {3, 4, 5, 6, 7},
        8: {4, 5, 6, 7, 8},
    }


def test_dense_mask_is_causal():
    assert seen(image_pairs("dense", 3, 0)) == {q: set(range(q + 1)) for q in range(9)}


def test_stream_mask_text_is_causal_and_every_image_token_sees_all_text():
    m = stream_mask("column", 2, 2, 3)  # 2 text positions, then a 2 x 2 grid at 2..5
    assert seen(m) == {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 3}, 4: {0, 1, 2, 4}, 5: {0, 1, 3, 5}}


def test_the_papers_layer_rule_and_explicit_cycles():
    assert layer_patterns("dalle", 8) == ("row", "column", "row", "row", "row", "column", "row", "conv")
    assert layer_patterns("row,conv", 3) == ("row", "conv", "row")
    with pytest.raises(
        ConfigError, match=r"^model.attention_pattern='row,diag': 'diag' is not a pattern; valid: dalle"
    ):
        layer_patterns("row,diag", 3)


def model_cfg(*overrides: str, image_len: int = 9):
    cfg = run_config(
        "model=dalle",
        "model.conv_kernel=3",
        "model.d_model=32",
        "model.heads=2",
        "model.ffn_dim=48",
        "model.text_len=6",
        *overrides,
    ).model
    return resolve(cfg, image_len=image_len, image_vocab=IMAGE_VOCAB, text_vocab=TEXT_VOCAB)


def batch(b=3, t=6, image_len=9, seed=0):
    rng = np.random.default_rng(seed)
    text = jnp.asarray(rng.integers(4, TEXT_VOCAB, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None] < np.array([2, 4, 6][:b])[:, None])
    codes = jnp.asarray(rng.integers(0, IMAGE_VOCAB, (b, image_len)), jnp.int32)
    return text, mask, codes


@pytest.mark.parametrize("pattern", ["dense", "row", "column", "conv", "dalle"])
def test_cached_decoding_equals_the_full_forward_pass_for_every_pattern(pattern):
    model = build_model(model_cfg(f"model.attention_pattern={pattern}", "model.layers=3"), 0)
    assert cached_vs_full(model, *batch()) <= 1, pattern


def test_learned_padding_changes_the_loss_only_through_the_padding_positions():
    cfg = model_cfg("model.layers=2")
    model = build_model(cfg, 0)
    text, mask, codes = batch()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p, ids):
        nll = nnx.merge(graphdef, p).nll(ids, mask, codes)
        return nll["text"].sum() + nll["image"].sum()

    # whatever id sits in an empty slot, the stream holds that slot's own padding token
    other = jnp.where(mask, text, 7)
    np.testing.assert_allclose(loss(params, text), loss(params, other), rtol=1e-6)
    grad = jax.grad(loss)(params, text)["text_embed"]["embedding"][...]
    pad_rows = np.abs(np.asarray(grad[TEXT_VOCAB : TEXT_VOCAB + cfg.text_len])).sum(-1)
    empty = ~np.asarray(mask).all(0)  # slots 2..5 are empty in some caption, 0 and 1 in none
    assert np.all(pad_rows[~empty] == 0) and np.all(pad_rows[empty] > 0), pad_rows


def test_the_objective_weights_text_and_image_means_one_eighth_and_seven_eighths():
    nll = {"text": jnp.array([[1.0, 3.0], [0.0, 0.0]]), "image": jnp.array([[2.0, 2.0, 2.0], [4.0, 1.0, 1.0]])}
    fake = SimpleNamespace(nll=lambda *a, **k: nll, cfg=SimpleNamespace(loss_weights=model_cfg().loss_weights))
    b = {"text": None, "text_mask": None, "codes": None, "weights": jnp.array([1.0, 0.5])}
    total, streams = objective(fake, b)
    # text means 2 and 0, image means 2 and 2; weights 1 and 0.5
    assert float(streams["text"]) == pytest.approx(2.0) and float(streams["image"]) == pytest.approx(3.0)
    assert float(total) == pytest.approx(2.0 / 8 + 3.0 * 7 / 8)


def test_the_text_loss_predicts_the_next_text_token_and_the_image_loss_equals_the_eval_nll():
    from dalle_ablate.model import token_nll

    model = build_model(model_cfg("model.layers=2"), 0)
    text, mask, codes = batch()
    nll = model.nll(text, mask, codes)
    assert nll["text"].shape == (3, 5) and nll["image"].shape == (3, 9)
    np.testing.assert_allclose(nll["image"], token_nll(model, text, mask, codes), rtol=1e-6)


def test_dalle12b_has_the_papers_shapes_and_about_12_billion_parameters():
    cfg = to_run_config(compose("model=dalle", "size=dalle12b")).model
    n = param_count(abstract_model(cfg))
    d, f, layers, t, text_vocab, grid, codes = 3968, 4 * 3968, 64, 256, 16384, 32, 8192
    per_layer = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 2 * d  # attention, FFN (biases), two pre-LN biases
    embeddings = (text_vocab + t) * d + t * d + codes * d + 2 * grid * d  # text with pads, positions, image, row, col
    heads = (text_vocab + t) * d + codes * d  # text and image logits
    assert n == layers * per_layer + embeddings + heads + d  # + the final norm's bias
    assert 12.2e9 < n < 12.4e9
    # docs/variants.md states the untied heads' share (issue #43: it said 131 M)
    assert (
        f"untied from the embeddings ({heads / 1e6:.1f} M of the total" in (ROOT / "docs" / "variants.md").read_text()
    )


def test_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match=r"^model.conv_kernel=4 must be odd"):
        model_cfg("model.conv_kernel=4")
    with pytest.raises(ConfigError, match=r"^model.position_bias=true is the seq2seq decoder's Swin v2 bias"):
        model_cfg("model.position_bias=true")
    with pytest.raises(ConfigError, match=r"^model.conv_kernel=7 is wider than the 3x3 image grid allows; at most 5"):
        build_model(dataclasses.replace(model_cfg(), conv_kernel=7), 0)
    with pytest.raises(ConfigError, match=r"^model.family=single_stream needs a square image grid; model.image_len=8"):
        build_model(model_cfg(image_len=8), 0)


def test_the_empty_caption_is_all_padding_for_the_single_stream_family():
    from dalle_ablate.data import build_dataset

    cfg = run_config("model=dalle")
    dataset = build_dataset(cfg.data, cfg.model)
    ids, mask = dataset.empty_caption()
    assert not mask.any() and ids.shape == (1, cfg.model.text_len)
    seq2seq = run_config("model=preln")
    assert build_dataset(seq2seq.data, seq2seq.model).empty_caption()[1].sum() == 2  # BOS, EOS
