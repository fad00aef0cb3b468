"""Every formula of docs/variants.md, checked against the math written out independently here."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import compose, run_config
from dalle_ablate.model import abstract_model, build_model, param_count
from dalle_ablate.model.attention import MASKED, PositionBias, attention_logits, grid_offsets, norm_softmax
from dalle_ablate.model.layers import Norm, smelu
from dalle_ablate.model.layouts import deepnet_constants, magneto_gains
from dalle_ablate.model.seq2seq import EncoderLayer
from dalle_ablate.registry import ConfigError
from dalle_ablate.train.loop import JobInfo, train
from dalle_ablate.validate import to_run_config
from test_model import batch, tiny_model_cfg


def std(linear) -> float:
    return float(np.std(np.asarray(linear.kernel[...])))


# -- DeepNet and Magneto init ---------------------------------------------------------------------
def test_deepnet_constants_match_the_paper():
    c = deepnet_constants(12, 12)
    assert c["encoder"] == pytest.approx((1.76, 0.40), abs=0.01)
    assert c["decoder"] == pytest.approx((2.45, 0.29), abs=0.01)
    n, m = 6, 18
    assert c["encoder"][0] * c["encoder"][1] == pytest.approx(0.81 * 0.87)  # alpha beta: the N^4 M factors cancel
    assert deepnet_constants(n, m)["decoder"] == pytest.approx(((3 * m) ** 0.25, (12 * m) ** -0.25))


def test_magneto_gains_match_the_paper():
    g = magneto_gains(12, 12)
    assert g["encoder"] == pytest.approx(1.95, abs=0.01) and g["decoder"] == pytest.approx(1.89, abs=0.01)


@pytest.mark.parametrize("layout", ["deepnet", "subln"])
def test_init_gains_reach_exactly_the_kernels_variants_md_names(layout):
    s = 0.1
    n = 6
    cfg = tiny_model_cfg(layout, init_std=s, d_model=256, heads=4, ffn_dim=256, encoder_layers=n, decoder_layers=n)
    model = build_model(cfg, 0)
    if layout == "deepnet":
        enc, dec = deepnet_constants(n, n)["encoder"][1], deepnet_constants(n, n)["decoder"][1]
        cross = dec  # cross-attention uses the decoder's beta
    else:
        enc, dec = magneto_gains(n, n)["encoder"], magneto_gains(n, n)["decoder"]
        cross = 1.0  # Magneto scales self-attention only
    e, d = model.encoder[0], model.decoder[0]
    for lin, gain in [
        (e.attn.q, 1),
        (e.attn.k, 1),
        (e.attn.v, enc),
        (e.attn.o, enc),
        (e.ffn.wi, enc),
        (e.ffn.wv, enc),
        (e.ffn.wo, enc),
        (d.self_attn.q, 1),
        (d.self_attn.k, 1),
        (d.self_attn.v, dec),
        (d.self_attn.o, dec),
        (d.cross_attn.q, 1),
        (d.cross_attn.k, 1),
        (d.cross_attn.v, cross),
        (d.cross_attn.o, cross),
        (d.ffn.wi, dec),
        (d.ffn.wv, dec),
        (d.ffn.wo, dec),
        (model.lm_head, 1),
    ]:
        assert std(lin) == pytest.approx(s * gain, rel=0.03)
    assert float(np.std(np.asarray(model.text_embed.embedding[...]))) == pytest.approx(s, rel=0.03)


# -- activations and norms ----------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_smelu_values_and_gradients_are_the_piecewise_formulas(beta):
    def value(x):
        return 0.0 if x <= -beta else x if x >= beta else (x + beta) ** 2 / (4 * beta)

    def slope(x):
        return 0.0 if x <= -beta else 1.0 if x >= beta else (x + beta) / (2 * beta)

    points = [-3 * beta, -1.5 * beta, -beta, -0.5 * beta, 0.0, 0.3 * beta, beta, 1.7 * beta, 4 * beta]
    grad = jax.grad(lambda x: smelu(x, beta))
    for x in points:
        assert float(smelu(jnp.float32(x), beta)) == pytest.approx(value(x), abs=1e-6)
        assert float(grad(jnp.float32(x))) == pytest.approx(slope(x), abs=1e-6)
    assert float(smelu(jnp.float32(-10.0), beta)) == 0.0  # not dalle-mini's 0.25
    # Continuity at the joins from both sides.
    for j in (-beta, beta):
        left, right = float(grad(jnp.float32(j - 1e-4))), float(grad(jnp.float32(j + 1e-4)))
        assert left == pytest.approx(right, abs=1e-3)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_norms_match_a_float64_numpy_reference(kind, dtype):
    cfg = dataclasses.replace(run_config().model, norm=kind)
    d = 48
    norm = Norm(d, cfg, use_scale=True, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    g = rng.normal(1, 0.2, d)
    norm.norm.scale[...] = jnp.asarray(g, jnp.float32)
    if kind == "layernorm":
        b = rng.normal(0, 0.2, d)
        norm.norm.bias[...] = jnp.asarray(b, jnp.float32)
    x = rng.normal(3, 2, (5, d)).astype(np.float32)
    xin = jnp.asarray(x, dtype)
    x64 = np.asarray(xin.astype(jnp.float32), np.float64)  # the values the norm actually receives
    if kind == "layernorm":
        ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * g + b
    else:
        ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * g
    out = norm(xin)
    assert out.dtype == jnp.dtype(dtype)  # computed in float32, returned in the compute dtype
    tol = 1e-5 if dtype == "float32" else 1e-2 * np.abs(ref).max()  # bf16 output rounding only
    assert np.allclose(np.asarray(out, np.float64), ref, atol=tol)


@pytest.mark.parametrize("layout", ["postln", "deepnet"])
def test_post_norm_blocks_output_zero_mean_unit_variance_rows(layout):
    cfg = tiny_model_cfg(layout, d_model=64, heads=4, ffn_dim=128)
    layer = EncoderLayer(cfg, nnx.Rngs(0))  # at init the norms' affine part is the identity
    x = jax.random.normal(jax.random.key(1), (2, 12, 64)) * 3 + 1
    y = np.asarray(layer(x, jnp.ones((2, 1, 12, 12), bool)), np.float64)
    assert np.allclose(y.mean(-1), 0, atol=1e-5)
    assert np.allclose(y.var(-1), 1, atol=1e-3)  # eps 1e-5 keeps it just under 1


# -- attention ------------------------------------------------------------------------------------
def test_cosine_attention_logits_are_bounded_by_one_over_tau():
    q, k = jax.random.normal(jax.random.key(0), (2, 2, 7, 3, 16)) * 10
    tau = jnp.array([0.05, 0.1, 1.0])
    logits = np.asarray(attention_logits(q, k, tau))
    assert (np.abs(logits) <= 1 / np.asarray(tau)[None, :, None, None] + 1e-4).all()
    same = np.asarray(attention_logits(q, q, tau))  # a vector with itself: cos = 1 exactly, no 1/sqrt(d)
    diag = np.diagonal(same, axis1=2, axis2=3)
    assert np.allclose(diag, 1 / np.asarray(tau)[None, :, None], rtol=1e-5)
    dot = np.asarray(attention_logits(q, k))  # and the plain path is q.k / sqrt(d)
    assert np.allclose(
        dot,
        np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)) / 4.0,
        rtol=1e-5,
        atol=1e-3,
    )


@pytest.mark.parametrize("spread", [0.05, 100.0])
def test_norm_softmax_divides_q_k_by_the_smaller_of_sqrt_d_and_their_std_over_the_visible_keys(spread):
    """Against the definition written out in float64 (the authors' norm_softmax_std): per query row,
    the raw q.k of the keys the causal mask lets it see, divided by min(sqrt(D), their unbiased
    std). spread 0.05: logits nearly equal, divided by their small std (sharpened); 100: by sqrt(D),
    the usual attention."""
    d, t = 16, 6
    q, k = (
        np.asarray(jax.random.normal(jax.random.key(1), (2, 2, t, 3, d)))
        * np.array([spread, 1.0])[:, None, None, None, None]
    )
    mask = np.tril(np.ones((t, t), bool))[None, None]
    logits = norm_softmax(attention_logits(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)), jnp.asarray(mask))
    got = np.asarray(jax.nn.softmax(jnp.where(mask, logits, MASKED), axis=-1))
    raw = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64))
    want = np.zeros_like(raw)
    divisors = []
    for b, h, i in np.ndindex(raw.shape[:3]):
        row = raw[b, h, i, : i + 1]
        divisor = min(math.sqrt(d), np.std(row, ddof=1)) if i else math.sqrt(d)  # one key: its weight is 1 anyway
        divisors.append(divisor)
        e = np.exp((row - row.max()) / divisor)
        want[b, h, i, : i + 1] = e / e.sum()
    assert np.allclose(got, want, atol=1e-5)
    plain = np.asarray(jax.nn.softmax(jnp.where(mask, attention_logits(jnp.asarray(q), jnp.asarray(k)), MASKED), -1))
    if spread > 1:  # every row's std is above sqrt(D): the usual attention
        assert set(divisors) == {math.sqrt(d)} and np.allclose(got, plain, atol=1e-5)
    else:  # the rows are sharpened: further from uniform than the usual attention's
        assert min(divisors) < 1 and np.abs(got - plain).max() > 0.1


def test_learned_tau_is_clamped():
    cfg = tiny_model_cfg("swinv2", learn_tau=True)
    attn = build_model(cfg, 0).decoder[0].self_attn
    attn.tau[...] = jnp.array([0.001, 0.5])
    assert np.allclose(np.asarray(attn.temperature()), [cfg.tau_min, 0.5])


def test_swin_position_bias_depends_only_on_relative_offsets():
    cfg = tiny_model_cfg("swinv2", heads=3)
    pb = PositionBias(cfg, nnx.Rngs(0))
    bias = np.asarray(pb(16))  # 4x4 grid
    off = grid_offsets(16)
    seen = {}
    for i in range(16):
        for j in range(16):
            key = tuple(off[i, j])
            if key in seen:
                assert np.array_equal(bias[:, i, j], seen[key])
            seen[key] = bias[:, i, j]
    assert len(seen) == 49  # (2*4 - 1)^2 distinct offsets
    assert np.allclose(bias[:, 5, 1], np.asarray(pb.table(jnp.array([[1, 0]])))[0])  # (1,1)-(0,1) = (1, 0)
    assert not np.allclose(seen[(1, 0)], seen[(0, 1)])  # rows and columns are told apart


def test_normformer_with_identity_norms_equals_preln():
    pre_cfg = tiny_model_cfg("preln")
    nf_cfg = tiny_model_cfg("normformer", head_scale=True)
    pre, nf = build_model(pre_cfg, 0), build_model(nf_cfg, 1)
    # Copy preln's parameters into NormFormer where the paths agree; head scales stay at 1.
    pre_params = nnx.to_pure_dict(nnx.state(pre, nnx.Param))
    nf_graph, nf_params = nnx.split(nf, nnx.Param)
    nf_params = nnx.to_pure_dict(nf_params)

    def copy(dst, src):
        for k, v in dst.items():
            if k in src:
                dst[k] = copy(v, src[k]) if isinstance(v, dict) else src[k]
        return dst

    nf = nnx.merge(nf_graph, copy(nf_params, pre_params))
    for layer in list(nf.encoder) + list(nf.decoder):  # the extra norms become identities
        for block in (getattr(layer, n) for n in ("attn_block", "self_block", "cross_block") if hasattr(layer, n)):
            block.post = None
        layer.ffn.mid_norm = None
    args = batch(pre_cfg)
    assert np.allclose(np.asarray(nf(*args)), np.asarray(pre(*args)), atol=1e-6)


# -- parameter counts -------------------------------------------------------------------------------
def test_glu_at_two_thirds_width_has_the_dense_ffn_parameter_count():
    dense = tiny_model_cfg("preln", d_model=192, heads=4, ffn_dim=768, glu=False)
    glu = dataclasses.replace(dense, glu=True, ffn_dim=512)
    count = lambda cfg: sum(  # noqa: E731
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract_model(cfg).encoder[0].ffn, nnx.Param))
    )
    assert count(glu) == pytest.approx(count(dense), rel=0.01)


def mega_normformer_count() -> int:
    """Parameters of `size=mega model=normformer`, counted from the architecture by hand."""
    d, f, n, m = 2048, 4096, 24, 24
    pad = lambda v: -(-v // 8) * 8  # noqa: E731
    ln_noscale, ln_scale = d, 2 * d  # LayerNorm: bias always, scale only when not feeding a Dense
    enc_layer = (ln_noscale + 4 * d * d + ln_scale) + (ln_noscale + 3 * d * f + f)  # attn; ffn with GLU + mid norm
    dec_layer = 2 * (ln_noscale + 4 * d * d + ln_scale) + (ln_noscale + 3 * d * f + f)
    embeddings = pad(50264) * d + 64 * d + pad(16384 + 1) * d + 256 * d
    return embeddings + n * enc_layer + m * dec_layer + 2 * ln_noscale + d * pad(16384 + 1)


def test_mega_parameter_count_equals_an_analytic_count():
    cfg = to_run_config(compose("size=mega", "model=normformer")).model
    assert param_count(abstract_model(cfg)) == mega_normformer_count()


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=preln", "model.swin_ln_every=6"], "model.swin_ln_every=6 conflicts with model.layout=preln"),
        (
            ["model=postln", "model.final_ln_decoder=true"],
            "model.final_ln_decoder=true conflicts with model.layout=postln",
        ),
        (["model=swinv2", "model.tau_init=0"], "model.tau_init=0.0 and model.tau_min=0.01 must be positive"),
        (["model=preln", "model.learn_tau=true"], "model.learn_tau=true conflicts with model.cosine_attention=false"),
        (
            ["model=swinv2", "model.norm_softmax=true"],
            "model.norm_softmax=true conflicts with model.cosine_attention=true",
        ),
        (["model.dropout=1.0"], "model.dropout=1.0 must be in [0, 1)"),
        (["model.smelu_beta=-1"], "model.smelu_beta=-1.0 must be positive"),
    ],
)
def test_illegal_variant_combinations_fail_before_compilation_naming_the_flags(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_config(*overrides)


# -- end to end ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["postln", "swinv2", "subln"])
def test_layouts_train_three_steps(tmp_path, small_dataset, layout):
    cfg = run_config(
        f"model={layout}",
        "tracker=none",
        "trainer.steps=3",
        "model.dropout=0.1",
        "model.attention_dropout=0.1",
        "model.activation_dropout=0.1",
        "model.scale_embedding=true",
    )
    res = train(cfg, JobInfo(tmp_path))
    assert res.status == "finished" and math.isfinite(res.eval_loss)


def test_dropout_is_active_in_training_only():
    cfg = tiny_model_cfg("preln", dropout=0.5, attention_dropout=0.5, activation_dropout=0.5)
    model = build_model(cfg, 0)
    args = batch(cfg)
    assert np.array_equal(np.asarray(model(*args)), np.asarray(model(*args)))  # eval: deterministic
    a = np.asarray(model(*args, dropout_key=jax.random.key(0)))
    b = np.asarray(model(*args, dropout_key=jax.random.key(1)))
    assert not np.allclose(a, b)
    assert np.array_equal(a, np.asarray(model(*args, dropout_key=jax.random.key(0))))


def test_describe_prints_counts_flops_and_memory_for_mega_without_allocating():
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_ablate.cli", "describe", "model=normformer", "size=mega"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    total = mega_normformer_count()
    assert f"total{'':<23}{total:>16,}" in out
    assert "FLOPs per image token" in out and "optimizer state" in out
    assert f"{4 * total / 2**30:.2f} GiB" in out and f"{2 * total / 2**30:.2f} GiB" in out
