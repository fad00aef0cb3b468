"""Shampoo step for step against Google's distributed_shampoo (optax-shampoo 0.0.6, the `ref`
extra), configured as DALL·E Mega configured it, fed the same gradients.

The reference was written for JAX 0.3: it calls jax.tree_map / tree_flatten / tree_unflatten and
jax.experimental.pjit's PartitionSpec, which JAX has since moved, and starts a while_loop carry
with a Python bool where the body returns a float (JAX 0.3 promoted weakly typed initial values to
the body's types; JAX 0.10 refuses). `old_jax` puts those names and that promotion back for the
duration of a test, for the reference module only; the reference's algorithm is untouched. Its
inverse roots run coupled Newton iterations in float32 (its float64 needs jax_enable_x64, off
here as on Mega's TPUs); ours use eigh -- the difference this test bounds.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dalle_ablate.optim.scale_by_shampoo import scale_by_shampoo

ds = pytest.importorskip("optax_shampoo.distributed_shampoo", reason="the reference is in the ref extra")


class _LaxWithPromotion:
    """jax.lax, but while_loop casts its initial carry to the types the body returns."""

    def __getattr__(self, name):
        return getattr(jax.lax, name)

    @staticmethod
    def while_loop(cond, body, init):
        out = jax.eval_shape(body, init)
        return jax.lax.while_loop(cond, body, jax.tree.map(lambda a, o: jnp.asarray(a, o.dtype), init, out))


@contextlib.contextmanager
def old_jax():
    from jax.experimental import pjit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ds, "lax", _LaxWithPromotion())
        mp.setattr(jax, "tree_map", jax.tree.map, raising=False)
        mp.setattr(jax, "tree_flatten", jax.tree.flatten, raising=False)
        mp.setattr(jax, "tree_unflatten", jax.tree.unflatten, raising=False)
        mp.setattr(pjit, "PartitionSpec", jax.sharding.PartitionSpec, raising=False)
        mp.setattr(pjit, "with_sharding_constraint", jax.lax.with_sharding_constraint, raising=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")
            yield


# A 3-layer MLP whose parameters exercise every layout: with block_size 32, w1 (48 x 100) splits
# into 2 x 4 blocks with odd remainders (16 rows, 4 columns), w2 (100 x 64) into 4 x 2, w3 (64 x 70)
# into 2 x 3; w0 (8 x 12, 96 elements) is merged into one vector of 3 blocks, as the reference's
# merge_small_dims does; b1 (100) is a vector of 4 blocks, one of 4 elements.
SHAPES = {"w0": (8, 12), "w1": (48, 100), "b1": (100,), "w2": (100, 64), "b2": (64,), "w3": (64, 70)}
BLOCK, EVERY, STEPS, LR = 32, 5, 60, 0.05


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"])
    z = x[:, :8] @ p["w0"]  # a small matrix on a side branch
    return jnp.mean((h @ p["w3"] - y) ** 2) + jnp.mean((z - y[:, :12]) ** 2)


def worst_differences(start: int, graft: str, ema: bool, **ours_kw) -> tuple[list[float], dict, dict]:
    """max over parameters of |u_ours - u_ref| / |u_ref| at each of STEPS steps, with the last
    updates and gradients."""
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32) for k, s in SHAPES.items()}
    x = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(64, 70)), jnp.float32)
    ours = optax.chain(
        scale_by_shampoo(
            block_size=BLOCK,
            beta1=0.9,
            beta2=0.99,
            graft=graft,
            graft_eps=1e-10,
            matrix_eps=1e-6,
            preconditioning_every=EVERY,
            start_preconditioning_step=start,
            moving_average_for_momentum=ema,
            **ours_kw,
        ),
        optax.scale_by_learning_rate(LR),
    )
    graft_type = {
        "rmsprop_normalized": ds.GraftingType.RMSPROP_NORMALIZED,
        "sgd": ds.GraftingType.SGD,
        "adagrad": ds.GraftingType.ADAGRAD,
    }[graft]
    with old_jax():
        # DALL·E Mega's call (dalle-mini tools/train/train.py), at this test's sizes and rates.
        ref = ds.distributed_shampoo(
            LR,
            block_size=BLOCK,
            beta1=0.9,
            beta2=0.99,
            diagonal_epsilon=1e-10,
            matrix_epsilon=1e-6,
            weight_decay=0.0,
            start_preconditioning_step=start,
            preconditioning_compute_steps=EVERY,
            statistics_compute_steps=1,
            best_effort_shape_interpretation=True,
            graft_type=graft_type,
            nesterov=False,
            exponent_override=0,
            inverse_failure_threshold=0.1,
            moving_average_for_momentum=ema,
            skip_preconditioning_dim_size_gt=4096,
            clip_by_scaled_gradient_norm=None,
            precision=jax.lax.Precision.HIGHEST,
        )
        ref_update = jax.jit(ref.update)
        ref_state = ref.init(params)
        ours_update = jax.jit(ours.update)
        our_state = ours.init(params)
        grad = jax.jit(jax.grad(mlp_loss))
        worst = []
        for _ in range(STEPS):
            g = grad(params, x, y)
            u_ref, ref_state = ref_update(g, ref_state, params)
            u_ours, our_state = ours_update(g, our_state, params)
            worst.append(max(float(jnp.linalg.norm(u_ours[k] - u_ref[k]) / jnp.linalg.norm(u_ref[k])) for k in SHAPES))
            params = optax.apply_updates(params, u_ours)
    return worst, u_ours, g


@pytest.mark.slow
@pytest.mark.parametrize(
    "start, graft, ema",
    [
        (0, "rmsprop_normalized", True),
        (21, "rmsprop_normalized", True),
        (21, "sgd", False),
        (0, "adagrad", False),
        (21, "adagrad", True),
    ],
)
def test_updates_match_distributed_shampoo_step_for_step(start, graft, ema):
    worst, u, g = worst_differences(start, graft, ema)
    assert max(worst) <= 1e-3, [f"{w:.1e}" for w in worst]
    # The run preconditioned for real: the Shampoo direction is not the gradient's.
    assert float(jnp.linalg.norm(u["w1"] / jnp.linalg.norm(u["w1"]) + g["w1"] / jnp.linalg.norm(g["w1"]))) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("option", [{"graft_scope": "block"}, {"precondition_1d": False}, {"root_dtype": "float32"}])
def test_the_named_departures_from_the_reference_are_visible(option):
    """The comparison can fail: each old behaviour, kept as an option, moves the updates beyond
    the parity bound (float32 roots by ~2e-3 on the merged 8 x 12 matrix, whose statistic has
    cond ~1e4 and exponent 2)."""
    worst, _, _ = worst_differences(0, "rmsprop_normalized", True, **option)
    assert max(worst) > 1e-3
