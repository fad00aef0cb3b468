"""Every registered layout builds and gives finite values forward and backward; large presets
are checked by abstract shapes only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import compose, run_config
from dalle_ablate.model import LAYOUTS, abstract_model, build_model, param_count, resolve
from dalle_ablate.model.flops import forward_flops_per_example
from dalle_ablate.model.seq2seq import padded
from dalle_ablate.validate import to_run_config


def tiny_model_cfg(layout: str, **kw):
    cfg = run_config(f"model={layout}").model
    return resolve(dataclasses.replace(cfg, **kw), image_len=16, image_vocab=50, text_vocab=40)


def batch(cfg, b=3, seed=0):
    rng = np.random.default_rng(seed)
    text = rng.integers(4, cfg.text_vocab, (b, cfg.text_len)).astype(np.int32)
    lengths = rng.integers(2, cfg.text_len, b)
    mask = np.arange(cfg.text_len)[None] < lengths[:, None]
    codes = rng.integers(0, cfg.image_vocab, (b, cfg.image_len)).astype(np.int32)
    return jnp.asarray(text), jnp.asarray(mask), jnp.asarray(codes)


@pytest.mark.parametrize("layout", LAYOUTS.names())
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("activation", ["gelu", "swish", "smelu"])
@pytest.mark.parametrize("glu", [True, False])
def test_every_layout_builds_forward_backward_finite(layout, norm, activation, glu):
    extra = {"swin_ln_every": 1} if layout == "swinv2" else {}  # exercise the stream norm too
    cfg = tiny_model_cfg(
        layout, norm=norm, activation=activation, glu=glu, encoder_layers=1, d_model=16, ffn_dim=32, **extra
    )
    model = build_model(cfg, 0)
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask, codes = batch(cfg)

    def loss(p):
        logits = nnx.merge(graphdef, p)(text, mask, codes)
        return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    assert logits.shape == (3, cfg.image_len, padded(cfg.image_vocab + 1, cfg.vocab_pad_multiple))
    assert np.isfinite(float(value))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_bos_and_padding_rows_are_never_predicted():
    cfg = tiny_model_cfg("preln")
    model = build_model(cfg, 0)
    logits = np.asarray(model(*batch(cfg)))
    probs = np.asarray(jax.nn.softmax(logits, -1))
    assert probs[..., cfg.image_vocab :].max() == 0.0  # BOS (= image_vocab) and the padding rows
    assert np.allclose(probs[..., : cfg.image_vocab].sum(-1), 1.0, atol=1e-5)


def test_decoder_is_causal_and_ignores_text_padding():
    cfg = tiny_model_cfg("normformer")
    model = build_model(cfg, 0)
    text, mask, codes = batch(cfg)
    base = np.asarray(model(text, mask, codes))
    # Changing code t changes no logit at positions <= t (position t predicts code t from codes < t).
    t = 7
    changed = np.asarray(model(text, mask, codes.at[:, t].set((codes[:, t] + 1) % cfg.image_vocab)))
    assert np.array_equal(base[:, : t + 1], changed[:, : t + 1])
    assert not np.allclose(base[:, t + 1 :], changed[:, t + 1 :])
    # Tokens under the padding mask do not matter.
    other = jnp.where(mask, text, (text + 1) % cfg.text_vocab)
    assert np.allclose(base, np.asarray(model(other, mask, codes)), atol=1e-6)


def test_parameters_carry_logical_axes():
    model = build_model(tiny_model_cfg("swinv2", learn_tau=True, head_scale=True), 0)
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    allowed = {"vocab", "embed", "heads", "mlp", "pos", None}
    for path, var in leaves:
        spec = var.get_metadata().get("out_sharding")
        assert spec is not None and len(spec) == var[...].ndim and set(spec) <= allowed, path


def test_mega_preset_by_abstract_shapes_only():
    cfg = to_run_config(compose("size=mega", "model=normformer")).model
    model = abstract_model(cfg)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    n = param_count(model)
    assert 2.4e9 < n < 2.8e9  # DALL·E Mega is ~2.6B parameters


def test_flops_formula_matches_xla_cost_analysis():
    """The analytic matmul FLOPs are what XLA counts, up to the non-matmul work it adds."""
    cfg = tiny_model_cfg("preln", d_model=64, heads=2, ffn_dim=128, glu=True)
    model = build_model(cfg, 0)
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask, codes = batch(cfg, b=1)
    fwd = jax.jit(lambda p: nnx.merge(graphdef, p)(text, mask, codes))
    xla = fwd.lower(params).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    ours = forward_flops_per_example(cfg)
    assert ours <= xla["flops"] <= 1.15 * ours, (ours, xla["flops"])
