"""Distributed Shampoo against NumPy float64 math, and its state and schedules."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import run_config
from dalle_ablate.optim import build_optimizer, build_schedule, decay_mask
from dalle_ablate.optim.inverse_roots import batched_inverse_roots, inverse_root
from dalle_ablate.optim.scale_by_shampoo import scale_by_shampoo, shampoo_stats
from dalle_ablate.optim.shampoo_blocks import gather, make_plan, merged_shape, scatter


def np_root(a: np.ndarray, p: int, eps: float) -> np.ndarray:
    lam, v = np.linalg.eigh(a)
    ridge = eps * lam.max()
    return (v * (np.maximum(lam, 0) + ridge) ** (-1.0 / p)) @ v.T


@pytest.mark.parametrize("shape", [(64, 72), (70, 80)])
def test_one_block_one_step_equals_the_numpy_formula_then_grafted(shape):
    rng = np.random.default_rng(0)
    g = rng.normal(size=shape).astype(np.float32)
    tx = scale_by_shampoo(
        block_size=128,
        beta1=0.0,
        beta2=0.5,
        graft="sgd",
        start_preconditioning_step=0,
        preconditioning_every=1,
        matrix_eps=1e-3,
    )
    params = {"w": jnp.zeros(shape)}
    update, _ = tx.update({"w": jnp.asarray(g)}, tx.init(params))
    g64 = g.astype(np.float64)
    # beta2 L0 + (1 - beta2) G G^T from L0 = matrix_eps I
    left, right = 0.5e-3 * np.eye(shape[0]) + 0.5 * g64 @ g64.T, 0.5e-3 * np.eye(shape[1]) + 0.5 * g64.T @ g64
    pre = np_root(left, 4, 1e-3) @ g64 @ np_root(right, 4, 1e-3)
    expected = pre * np.linalg.norm(g64) / np.linalg.norm(pre)  # grafted to SGD's norm
    assert np.allclose(np.asarray(update["w"]), expected, atol=1e-5 * np.abs(expected).max())


def test_a_vector_is_preconditioned_by_the_square_root_of_its_one_statistic():
    # A vector (and a matrix of at most 4096 elements, merged into one) has one statistic, the
    # sum of g g^T, and exponent 2: full-matrix AdaGrad on each block (distributed_shampoo).
    rng = np.random.default_rng(1)
    gs = [rng.normal(size=(6, 5)).astype(np.float32) for _ in range(3)]
    tx = scale_by_shampoo(
        block_size=64,
        beta1=0.0,
        beta2=1.0,
        graft="sgd",
        start_preconditioning_step=0,
        preconditioning_every=1,
        matrix_eps=1e-4,
    )
    state = tx.init({"w": jnp.zeros((6, 5))})
    for g in gs:
        update, state = tx.update({"w": jnp.asarray(g)}, state)
    vecs = [g.reshape(-1).astype(np.float64) for g in gs]
    stat = 1e-4 * np.eye(30) + sum(np.outer(v, v) for v in vecs)
    pre = np_root(stat, 2, 1e-4) @ vecs[-1]
    expected = (pre * np.linalg.norm(vecs[-1]) / np.linalg.norm(pre)).reshape(6, 5)
    assert np.allclose(np.asarray(update["w"]), expected, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("cond", [1e2, 1e4, 1e6, 1e8])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_inverse_root_error_does_not_grow_with_the_condition_number(cond, dtype):
    rng = np.random.default_rng(int(cond))
    n = 64
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    lam = np.logspace(0, -np.log10(cond), n)
    a = (q * lam) @ q.T
    root, err = jax.jit(inverse_root, static_argnums=(1, 2, 3))(jnp.asarray(a, jnp.float32), 4, 1e-6, dtype)
    ref = np_root(np.asarray(jnp.asarray(a, jnp.float32), np.float64), 4, 1e-6)
    assert float(err) < 1e-4  # the eigendecomposition's backward error: ~n eps, far below the 0.1 threshold
    tol = 1e-5 if dtype == "float64" else 0.02  # float32: small eigenvalues carry eps_32 lambda_max errors
    assert np.abs(np.asarray(root) - ref).max() <= tol * np.abs(ref).max()


def test_a_broken_eigendecomposition_is_rejected():
    from dalle_ablate.optim.inverse_roots import _root_from_eigh

    rng = np.random.default_rng(2)
    g = rng.normal(size=(16, 32))
    a = jnp.asarray(g @ g.T, jnp.float32)
    lam, vec = jnp.linalg.eigh(a)
    _, good = _root_from_eigh(a, lam, vec, 4, 1e-6)
    _, shuffled = _root_from_eigh(a, lam[::-1], vec, 4, 1e-6)  # eigenvalues paired with the wrong vectors
    _, skewed = _root_from_eigh(a, lam, vec + 0.3 * jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), 4, 1e-6)
    assert float(good) < 1e-5 and float(shuffled) > 0.1 and float(skewed) > 0.1


def test_batched_roots_of_mixed_block_sizes_equal_the_numpy_roots():
    # Stacks of three sizes, one size repeated, in interleaved order: each root and error must
    # come back in its input's place (the sizes are bucketed for the eigendecompositions).
    rng = np.random.default_rng(3)

    def spd(n, b):
        g = rng.normal(size=(n, b, 2 * b))
        return g @ np.swapaxes(g, 1, 2) / b

    mats = [spd(3, 16), spd(2, 40), spd(4, 16), spd(1, 24)]
    ps = [4, 4, 2, 4]  # the two 16-stacks have different exponents: separate loops
    out = jax.jit(lambda ms: batched_inverse_roots(ms, ps, 1e-6))([jnp.asarray(m, jnp.float32) for m in mats])
    for m, p, (roots, errors) in zip(mats, ps, out):
        assert roots.shape == m.shape and errors.shape == m.shape[:1]
        for a, r, e in zip(m, np.asarray(roots), np.asarray(errors)):
            ref = np_root(a, p, 1e-6)
            assert np.abs(r - ref).max() <= 1e-4 * np.abs(ref).max()
            assert e < 1e-5


def test_a_nan_in_the_statistics_keeps_the_previous_root():
    tx = scale_by_shampoo(block_size=128, start_preconditioning_step=0, preconditioning_every=1)
    params = {"w": jnp.zeros((8, 12))}  # one vector of 96: one block
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 12)), jnp.float32)}
    _, state = tx.update(g, tx.init(params))
    good = state.stacks[0]
    poisoned = state._replace(stacks=(good._replace(left=good.left.at[0, 0, 0].set(jnp.nan)),))
    _, after = tx.update(g, poisoned)
    assert np.array_equal(np.asarray(after.stacks[0].left_root), np.asarray(good.left_root))
    assert int(after.stacks[0].failed[0]) == int(good.failed[0]) + 1
    stats = shampoo_stats(after)  # one block, two refreshes, the second rejected
    assert float(stats["optim/shampoo/failed_roots_last_refresh"]) == 1.0
    assert float(stats["optim/shampoo/failed_root_rate"]) == 0.5
    _, healed = tx.update(g, after._replace(stacks=(after.stacks[0]._replace(left=good.left),)))
    assert float(shampoo_stats(healed)["optim/shampoo/failed_roots_last_refresh"]) == 0.0
    assert float(shampoo_stats(healed)["optim/shampoo/failed_root_rate"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("graft", ["sgd", "adagrad", "rmsprop", "rmsprop_normalized", "adam"])
def test_before_the_start_step_the_update_is_the_graft_optimizers(graft):
    rng = np.random.default_rng(1)
    params = {"w": jnp.zeros((64, 72)), "b": jnp.zeros((72,))}
    tx = scale_by_shampoo(
        block_size=32,
        beta1=0.0,
        graft=graft,
        start_preconditioning_step=3,
        preconditioning_every=1,
        graft_beta2=0.9,
        graft_eps=1e-8,
        precondition_1d=False,
    )
    state = tx.init(params)
    v = {k: np.zeros(p.shape) for k, p in params.items()}
    for t in range(3):
        g = {k: rng.normal(size=p.shape).astype(np.float32) for k, p in params.items()}
        upd, state = tx.update(jax.tree.map(jnp.asarray, g), state)
        for k in g:
            x = g[k].astype(np.float64)
            if graft == "sgd":
                ref = x
            elif graft == "adagrad":
                v[k] += x * x
                ref = x / (np.sqrt(v[k]) + 1e-8)
            else:
                if graft == "rmsprop_normalized":
                    x = x / np.linalg.norm(x)
                v[k] = 0.9 * v[k] + 0.1 * x * x
                vhat = v[k] / (1 - 0.9 ** (t + 1)) if graft == "adam" else v[k]
                ref = x / (np.sqrt(vhat) + 1e-8)
            assert np.allclose(np.asarray(upd[k]), ref, rtol=1e-4, atol=1e-6), (graft, t, k)
    g = {k: jnp.asarray(rng.normal(size=p.shape), jnp.float32) for k, p in params.items()}
    upd, state = tx.update(g, state)  # step 3: Shampoo takes over for the matrix, not the vector
    assert float(state.preconditioned) == pytest.approx(64 * 72 / (64 * 72 + 72))


def test_preconditioners_change_only_at_multiples_of_the_period():
    tx = scale_by_shampoo(block_size=16, start_preconditioning_step=0, preconditioning_every=3)
    params = {"w": jnp.zeros((6, 7))}
    state = tx.init(params)
    rng = np.random.default_rng(2)
    roots = []
    for _ in range(7):
        _, state = tx.update({"w": jnp.asarray(rng.normal(size=(6, 7)), jnp.float32)}, state)
        roots.append(np.asarray(state.stacks[0].left_root))
    changed = [t for t in range(1, 7) if not np.array_equal(roots[t], roots[t - 1])]
    assert changed == [3, 6]  # recomputed at counts 0, 3, 6


def test_skipped_parameters_get_exactly_the_graft_update():
    params = {"embed": jnp.zeros((10, 9)), "big": jnp.zeros((3, 40)), "w": jnp.zeros((9, 8))}
    kw = dict(block_size=64, beta1=0.0, graft="rmsprop", preconditioning_every=1, skip_preconditioning_dim_size_gt=32)
    tx = scale_by_shampoo(precondition_mask=decay_mask(["embed"]), start_preconditioning_step=0, **kw)
    graft_only = scale_by_shampoo(start_preconditioning_step=10**9, **kw)
    rng = np.random.default_rng(3)
    g = {k: jnp.asarray(rng.normal(size=p.shape), jnp.float32) for k, p in params.items()}
    a, _ = tx.update(g, tx.init(params))
    b, _ = graft_only.update(g, graft_only.init(params))
    assert np.array_equal(np.asarray(a["embed"]), np.asarray(b["embed"]))  # masked
    assert np.array_equal(np.asarray(a["big"]), np.asarray(b["big"]))  # a dimension > 32
    assert not np.allclose(np.asarray(a["w"]), np.asarray(b["w"]))  # preconditioned


def test_blocking_reassembles_every_parameter_exactly():
    # distributed_shampoo's merge_small_dims: neighbours merged while the product stays <= 4096.
    assert merged_shape((3, 1, 4, 6), 16) == (12, 6) and merged_shape((1, 33), 16) == (33,)
    assert merged_shape((8, 8)) == (64,) and merged_shape((64, 72)) == (64, 72) and merged_shape((1, 1)) == ()
    assert merged_shape((2, 1024, 3)) == (2048, 3) and merged_shape((2, 3, 50, 7), 16) == (300, 7)
    shapes = [(7, 5), (100, 50), (3, 1, 4, 6), (1, 33), (64, 72), (5,), (1, 1)]
    plan = make_plan(shapes, [True] * len(shapes), block_size=8, skip_dim_gt=4096)
    assert plan.shapes2d == ((35, 1), (100, 50), (72, 1), (33, 1), (64, 72), (5, 1), None)
    rng = np.random.default_rng(4)
    mats = [jnp.asarray(rng.normal(size=s)) if s else None for s in plan.shapes2d]
    stacks = gather(plan, mats)
    assert all(st.shape[1] <= 8 and st.shape[2] <= 8 for st in stacks)
    assert {rank for (_, _, rank), _ in plan.stacks} == {1, 2}
    back = scatter(plan, stacks)
    for m, b in zip(mats, back):
        assert (m is None and b is None) or np.array_equal(np.asarray(m), np.asarray(b))
    graft_only = make_plan(shapes, [True] * len(shapes), block_size=8, skip_dim_gt=4096, precondition_1d=False)
    # vectors only: a small matrix merged into a vector is still preconditioned, as the reference
    assert [s is None for s in graft_only.shapes2d] == [False, False, False, True, False, True, True]


def test_checkpointed_state_continues_with_identical_updates(tmp_path):
    from dalle_ablate.train import checkpoint

    tx = scale_by_shampoo(
        block_size=8, start_preconditioning_step=2, preconditioning_every=2, statistics_dtype="bfloat16"
    )
    params = {"a": jnp.zeros((12, 6)), "b": jnp.zeros((6,))}
    rng = np.random.default_rng(5)
    grads = [{k: jnp.asarray(rng.normal(size=p.shape), jnp.float32) for k, p in params.items()} for _ in range(8)]
    step = jax.jit(tx.update)
    state = tx.init(params)
    for g in grads[:4]:
        _, state = step(g, state)
    ck = checkpoint.Checkpointer(tmp_path / "ck", keep=1)
    ck.save(4, state)
    ck.close()
    _, restored = checkpoint.restore(tmp_path / "ck", 4, tx.init(params))
    a, b = state, restored
    for g in grads[4:]:
        ua, a = step(g, a)
        ub, b = step(g, b)
        assert all(
            np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub))
        )


def test_shampoo_beats_adam_on_an_ill_conditioned_least_squares_problem():
    """min ||X W - Y||^2 with X's singular values over 3 decades in a random rotation (so that no
    per-coordinate scaling, Adam's, can undo it; Shampoo's left preconditioner can), to 1e-4 of the
    initial loss. Each optimizer gets its best learning rate of a x3 grid. Measured here:
    Adam 471 steps, Shampoo 88 (heavy-ball momentum, which the grid's rates were chosen for)."""
    rng = np.random.default_rng(6)
    n, d, k = 256, 48, 96  # 4608 elements: W stays a matrix (<= 4096 would be merged into a vector)
    rotation, _ = np.linalg.qr(rng.normal(size=(d, d)))
    x = (rng.normal(size=(n, d)) * np.logspace(0, -3, d)) @ rotation
    w_true = rng.normal(size=(d, k))
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(x @ w_true, jnp.float32)
    loss = lambda w: jnp.mean((x @ w["w"] - y) ** 2)  # noqa: E731
    target = 1e-4 * float(loss({"w": jnp.zeros((d, k))}))

    def steps_to_target(tx, limit=1000):
        w = {"w": jnp.zeros((d, k))}
        state = tx.init(w)

        @jax.jit
        def step(w, state):
            g = jax.grad(loss)(w)
            u, state = tx.update(g, state, w)
            return optax.apply_updates(w, u), state

        for t in range(1, limit + 1):
            w, state = step(w, state)
            if float(loss(w)) < target:
                return t
        return limit

    lrs = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
    adam = min(steps_to_target(optax.adam(lr)) for lr in lrs)
    shampoo = min(
        steps_to_target(
            optax.chain(
                scale_by_shampoo(
                    block_size=64,
                    beta1=0.9,
                    beta2=1.0,
                    graft="adagrad",
                    start_preconditioning_step=1,
                    preconditioning_every=1,
                    moving_average_for_momentum=False,
                ),
                optax.scale_by_learning_rate(lr),
            )
        )
        for lr in lrs
    )
    assert shampoo * 2.5 <= adam, (shampoo, adam)


def test_shampoo_from_config_trains_and_logs_its_stats(tmp_path, small_dataset):
    from dalle_ablate.track.runstore import read_metrics
    from dalle_ablate.train.loop import JobInfo, train

    # merge_small_dims=0: the test model's 32 x 32 matrices stay matrices (merged into vectors
    # they would need 1024 x 1024 roots, most of this test's time).
    cfg = run_config(
        "optim=shampoo",
        "optim.start_preconditioning_step=2",
        "optim.preconditioning_every=2",
        "optim.merge_small_dims=0",
        "tracker=none",
    )
    res = train(cfg, JobInfo(tmp_path))
    assert res.status == "finished" and np.isfinite(res.eval_loss)
    rows = [r for r in read_metrics(res.run_dir) if "optim/shampoo/preconditioned_fraction" in r]
    assert [r["step"] for r in rows] == [2, 4, 6]
    # Embeddings and the logits head are graft-only; the layers' matrices are preconditioned.
    assert 0.4 < rows[-1]["optim/shampoo/preconditioned_fraction"] < 1.0
    # Found inside the optimizer's chain; a fresh state has preconditioned and rejected nothing.
    opt, _ = build_optimizer(cfg.optim, cfg.schedule, 10)
    fresh = {k: float(v) for k, v in shampoo_stats(opt.init({"w": jnp.zeros((4, 4))})).items()}
    assert fresh == {
        f"optim/shampoo/{k}": 0.0
        for k in ("preconditioned_fraction", "failed_roots_last_refresh", "failed_root_rate", "root_error")
    }
    adam, _ = build_optimizer(run_config("optim=adam").optim, cfg.schedule, 10)
    assert shampoo_stats(adam.init({"w": jnp.zeros((4, 4))})) == {}


def test_schedules_warmup_decay_cosine_and_offset():
    cfg = run_config(
        "schedule=cosine", "schedule.warmup_steps=10", "schedule.end_factor=0.1", "trainer.steps=110"
    ).schedule
    s = build_schedule(cfg, 1.0, total_steps=110)
    assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(0.5) and float(s(10)) == pytest.approx(1.0)
    assert float(s(60)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5)), rel=1e-5)
    assert float(s(110)) == pytest.approx(0.1, rel=1e-5)
    off = run_config(
        "schedule=linear", "schedule.warmup_steps=10", "schedule.lr_offset=20", "trainer.steps=130"
    ).schedule
    s = build_schedule(off, 1.0, total_steps=130)
    assert float(s(0)) == 0.0 and float(s(19)) == 0.0 and float(s(25)) == pytest.approx(0.5)
    assert float(s(30)) == pytest.approx(1.0) and float(s(130)) == pytest.approx(0.0, abs=1e-6)
    exp = run_config(
        "schedule=exponential",
        "schedule.warmup_steps=0",
        "schedule.transition_steps=10",
        "schedule.decay_rate=0.5",
        "schedule.staircase=true",
    ).schedule
    s = build_schedule(exp, 1.0, total_steps=100)
    assert [float(s(t)) for t in (0, 9, 10, 25)] == pytest.approx([1.0, 1.0, 0.5, 0.25])
    # Warmup-stable-decay: 10 steps up, the peak held, then the last half of the 100 steps after the
    # warm-up down to 0.2 of it, linearly.
    wsd = run_config(
        "schedule=wsd",
        "schedule.warmup_steps=10",
        "schedule.cooldown_frac=0.5",
        "schedule.end_factor=0.2",
        "trainer.steps=110",
    ).schedule
    s = build_schedule(wsd, 2.0, total_steps=110)
    assert [float(s(t)) for t in (5, 10, 40, 60, 85, 110)] == pytest.approx([1.0, 2.0, 2.0, 2.0, 1.2, 0.4])


def test_building_shampoo_caps_the_blas_under_jaxs_eigh_and_only_it():
    import scipy
    from threadpoolctl import threadpool_info

    from dalle_ablate.optim.shampoo import limit_lapack_threads

    def threads() -> dict[str, int]:
        return {info["filepath"]: info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"}

    scipy_dir = str(Path(scipy.__file__).resolve().parent)  # its wheel's BLAS sits in the sibling scipy.libs
    limit_lapack_threads(2)
    before = threads()
    assert any(path.startswith(scipy_dir) for path in before) and all(
        n == 2 for path, n in before.items() if path.startswith(scipy_dir)
    )
    try:
        build_optimizer(run_config("optim=shampoo", "optim.lapack_threads=null").optim, run_config().schedule, 10)
        assert threads() == before
        build_optimizer(run_config("optim=shampoo").optim, run_config().schedule, 10)  # the preset: 1
        after = threads()
        assert {p: n for p, n in after.items() if p.startswith(scipy_dir)} == {
            p: 1 for p in before if p.startswith(scipy_dir)
        }
        # NumPy's own BLAS (the data pipeline's) is not touched.
        assert {p: n for p, n in after.items() if not p.startswith(scipy_dir)} == {
            p: n for p, n in before.items() if not p.startswith(scipy_dir)
        }
    finally:
        limit_lapack_threads(1)
