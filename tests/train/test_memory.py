"""Memory features: per-layer rematerialisation changes memory (benchmarks/mesh.py), never the math; bfloat16
compute keeps float32 master weights, and evaluation runs in float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dalle_ablate.model import build_model
from dalle_ablate.registry import ConfigError
from dalle_ablate.train.step import image_loss
from conftest import run_config
from test_model import batch, tiny_model_cfg


def loss_and_grads(cfg, seed=0):
    model = build_model(cfg, seed)
    graphdef, params = nnx.split(model, nnx.Param)
    text, mask, codes = batch(cfg, b=4)
    data = {"text": text, "text_mask": mask, "codes": codes, "weights": jnp.ones(4)}

    def loss(p):
        s, w = image_loss(nnx.merge(graphdef, p), data, jax.random.key(1))
        return s / w

    fn = jax.jit(jax.value_and_grad(loss))
    return fn(params)


@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_remat_gives_the_same_loss_and_gradients(policy):
    base = tiny_model_cfg("normformer", dropout=0.1, encoder_layers=3, decoder_layers=3)
    l0, g0 = loss_and_grads(base)
    l1, g1 = loss_and_grads(dataclasses.replace(base, remat=policy))
    assert float(l1) == pytest.approx(float(l0), abs=1e-6)  # dropout masks too: same keys, same draws
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_bad_remat_policy_is_named():
    with pytest.raises(ConfigError, match="model.remat='some' is not valid; valid: dots_saveable, full, none"):
        run_config("model.remat=some")


def test_bfloat16_compute_keeps_float32_weights_and_a_float32_loss():
    base = tiny_model_cfg("preln")
    l32, _ = loss_and_grads(base)
    l16, g16 = loss_and_grads(dataclasses.replace(base, dtype="bfloat16"))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))  # gradients of float32 master weights
    assert l16.dtype == jnp.float32
    assert float(l16) == pytest.approx(float(l32), rel=2e-2)  # bf16 has 8 bits of mantissa
    assert float(l16) != float(l32)  # the compute really ran in bfloat16


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_give_the_unrolled_loss_and_gradients(remat):
    base = tiny_model_cfg("deepnet", dropout=0.1, encoder_layers=3, decoder_layers=3, remat=remat)
    l0, g0 = loss_and_grads(base)
    l1, g1 = loss_and_grads(dataclasses.replace(base, scan_layers=True))
    assert float(l1) == pytest.approx(float(l0), abs=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_scan_with_stream_norms_is_refused():
    with pytest.raises(ConfigError, match="model.scan_layers=true conflicts with model.swin_ln_every=2"):
        run_config("model=swinv2", "model.swin_ln_every=2", "model.scan_layers=true")


def test_a_bfloat16_run_is_evaluated_in_float32(tmp_path, small_dataset):
    from dalle_ablate.model import abstract_model, resolve
    from dalle_ablate.optim import build_optimizer
    from dalle_ablate.train import checkpoint
    from dalle_ablate.train.state import TrainState
    from dalle_ablate.train.loop import JobInfo, train

    cfg = run_config(
        "model.dtype=bfloat16",
        "tracker=none",
        "trainer.steps=2",
        "trainer.eval_every=2",
        "trainer.save_every=2",
        "trainer.eval_batches=2",
    )
    result = train(cfg, JobInfo(tmp_path))
    mcfg = resolve(cfg.model, small_dataset.image_len, small_dataset.image_vocab, small_dataset.text.vocab_size)
    model = abstract_model(dataclasses.replace(mcfg, dtype="float32"))
    graphdef, shapes = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(shapes)
    opt, _ = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps)
    target = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=jax.eval_shape(opt.init, params)
    )
    _, restored = checkpoint.restore(tmp_path / "run" / "checkpoints", None, target)
    total = weight = 0.0
    for b in small_dataset.eval_batches(cfg.trainer.batch_size, 2):
        s, w = image_loss(nnx.merge(graphdef, restored.params), jax.tree.map(jnp.asarray, b))
        total, weight = total + float(s), weight + float(w)
    assert result.eval_loss == pytest.approx(total / weight, rel=1e-6)
