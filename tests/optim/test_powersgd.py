"""PowerSGD (optim/powersgd.py): exact at full rank, unbiased over steps by error feedback, the
traffic it claims, the 8-device run against a NumPy oracle, and the errors of a bad config."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, run_config
from dalle_ablate.optim import PowerSGDState, powersgd_mean, traffic
from dalle_ablate.optim.powersgd import powersgd_init
from dalle_ablate.registry import ConfigError


@functools.lru_cache
def _vmapped(w: int, exclude: tuple[str, ...]):
    return jax.jit(
        jax.vmap(
            lambda g, q, e: powersgd_mean(g, PowerSGDState(q=q, error=e), list(exclude), "data", w),
            axis_name="data",
            in_axes=(0, None, 0),
        )
    )


def simulate(grads: dict, state: PowerSGDState, exclude: list[str]):
    """powersgd_mean for W workers vmapped on one device: grads and state.error lead with W."""
    w = len(next(iter(grads.values())))
    err = jax.tree.map(lambda e: e[:, None], state.error)  # each worker sees its own row as [1, ...]
    mean, new, stats = _vmapped(w, tuple(exclude))(grads, state.q, err)
    return (
        jax.tree.map(lambda x: x[0], mean),
        PowerSGDState(q=jax.tree.map(lambda x: x[0], new.q), error=jax.tree.map(lambda e: e[:, 0], new.error)),
        stats,
    )


def test_full_rank_gives_the_uncompressed_mean_gradient():
    rng, w = np.random.default_rng(1), 4
    shapes = {"tall": (24, 7), "wide": (5, 16), "stacked": (3, 8, 6), "bias": (16,)}
    grads = {k: jnp.asarray(rng.normal(size=(w, *s)), jnp.float32) for k, s in shapes.items()}
    state = powersgd_init({k: jnp.zeros(s) for k, s in shapes.items()}, 10**6, [], w)
    mean, new, _ = simulate(grads, state, [])
    for k in shapes:
        want = np.asarray(grads[k], np.float64).sum(0)
        np.testing.assert_allclose(np.asarray(mean[k]), want, rtol=0, atol=2e-5 * np.abs(want).max())
    for k in ("tall", "wide", "stacked"):  # each worker keeps its deviation from the mean; they cancel
        assert float(jnp.abs(new.error[k].mean(0)).max()) < 1e-5 * float(jnp.abs(grads[k]).max()) * w


def test_error_feedback_makes_the_accumulated_update_unbiased_on_a_fixed_gradient():
    """Rank 1 of a rank-4 gradient: one step's update is far from the mean, but with error
    feedback the updates telescope -- their sum over T steps plus the mean residual is T times
    the mean gradient exactly -- so the average update converges to it; without the residuals
    (reset every step) it stays the rank-1 truncation."""
    rng, w, steps = np.random.default_rng(2), 4, 60
    g = {"m": jnp.asarray(rng.normal(size=(w, 12, 4)) @ rng.normal(size=(w, 4, 10)), jnp.float32)}
    mean = np.asarray(g["m"], np.float64).sum(0)
    state = powersgd_init({"m": jnp.zeros((12, 10))}, 1, [], w)
    zero_err = state.error
    total, first = np.zeros_like(mean), None
    for t in range(steps):
        approx, state, _ = simulate(g, state, [])
        total += np.asarray(approx["m"])
        first = np.asarray(approx["m"]) if first is None else first
    leftover = np.asarray(state.error["m"], np.float64).mean(0)
    np.testing.assert_allclose(total + leftover, steps * mean, atol=1e-3 * np.abs(steps * mean).max())
    biased = np.abs(first - mean).max() / np.abs(mean).max()
    unbiased = np.abs(total / steps - mean).max() / np.abs(mean).max()
    assert biased > 0.1 and unbiased < biased / 10, (biased, unbiased)
    # without error feedback the long-run average keeps the truncation's bias
    no_fb, s = np.zeros_like(mean), powersgd_init({"m": jnp.zeros((12, 10))}, 1, [], w)
    for t in range(steps):
        approx, s, _ = simulate(g, PowerSGDState(q=s.q, error=zero_err), [])
        no_fb += np.asarray(approx["m"])
    assert np.abs(no_fb / steps - mean).max() / np.abs(mean).max() > 5 * unbiased


def test_traffic_counts_factors_for_compressed_matrices_and_whole_arrays_for_the_rest():
    params = {
        "w": jnp.zeros((12, 10)),
        "s": jnp.zeros((2, 6, 5)),
        "b": jnp.zeros((10,)),
        "text_embed": jnp.zeros((20, 6)),
    }
    full = 120 + 60 + 10 + 120
    assert traffic(params, None, ["embed"]) == {"full": full, "sent": full}
    # rank 2: (12 + 10) x 2 for w, 2 x (6 + 5) x 2 for the stack; b and the embedding whole
    assert traffic(params, 2, ["embed"]) == {"full": full, "sent": 44 + 44 + 10 + 120}
    # a rank above min(rows, columns) is capped there
    assert traffic(params, 100, ["embed"])["sent"] == (12 + 10) * 10 + 2 * (6 + 5) * 5 + 10 + 120


def test_powersgd_needs_a_data_only_mesh_and_a_positive_rank():
    with pytest.raises(ConfigError) as e:
        run_config("optim.powersgd.rank=4", "mesh.fsdp=2")
    assert str(e.value) == (
        "optim.powersgd.rank=4 compresses data-parallel gradients and needs mesh.fsdp=1 and mesh.model=1 "
        "(got mesh.fsdp=2, mesh.model=1)"
    )
    with pytest.raises(ConfigError) as e:
        run_config("optim.powersgd.rank=0")
    assert str(e.value) == "optim.powersgd.rank=0 must be in [1, inf) or null"


@pytest.mark.slow
def test_on_eight_devices_powersgd_equals_the_one_device_algorithm_and_full_rank_equals_plain_training():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "powersgd_worker.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :])
    assert out["devices"] == 8
    assert out["oracle"] < 1e-5  # shard_map + psum over 8 devices vs the NumPy loop over 8 workers
    np.testing.assert_allclose(out["losses_full"], out["losses_plain"], rtol=1e-6)
    assert out["params_dev"] < 1e-6
    assert out["compression_full"] < 1  # full-rank factors are larger than the matrices
