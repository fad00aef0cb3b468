"""Inverse p-th roots (A + ridge I)^(-1/p) of stacks of symmetric statistics, with each root's
error: what Distributed Shampoo (scale_by_shampoo.py) refreshes its preconditioners with, one
eigendecomposition loop per block size."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _root_from_eigh(a: jax.Array, lam: jax.Array, vec: jax.Array, p, ridge_eps: float):
    """(A + ridge I)^(-1/p) from A's eigendecomposition, ridge = eps max(lambda_max, 1e-6) as in
    distributed_shampoo, and the decomposition's error.

    The error is the decomposition's backward error, max|A V - V diag(lambda)| relative to
    lambda_max, or V's departure from orthogonality, whichever is larger: ~n eps for a healthy
    eigh at any condition number, O(1) or NaN for a failed one. The root is then the exact
    root of a statistic that close to A. Judging it instead by max|X^p (A + ridge) - I| in float32
    measured rounding, not the root: that residual grows as cond(A + ridge) eps_32, up to ~0.1 at
    the cond 1e6 the ridge allows, so accurate roots straddled the 0.1 threshold and 13-28 % of
    refreshes were thrown away (issue 15), while the product X G the update uses was right to 6e-6."""
    n = a.shape[-1]
    lam_max = jnp.max(lam)
    ridge = ridge_eps * jnp.maximum(lam_max, 1e-6)
    root = (vec * (jnp.maximum(lam, 0.0) + ridge) ** (-1.0 / p)) @ vec.T
    scale = jnp.maximum(jnp.max(jnp.abs(lam)), jnp.finfo(lam.dtype).tiny)
    backward = jnp.max(jnp.abs(a @ vec - vec * lam)) / scale
    diag = jnp.arange(n)
    # Subtract I on the diagonal only: `x - jnp.eye(n)` lets XLA's CPU backend fuse the
    # subtraction into the matmul and emit it as a naive loop (3x slower at b = 680).
    ortho = jnp.max(jnp.abs((vec.T @ vec).at[diag, diag].add(-1.0)))
    return root, jnp.maximum(backward, ortho)


def _symmetric(a: jax.Array, dtype=jnp.float32) -> jax.Array:
    a = a.astype(dtype)
    return (a + jnp.swapaxes(a, -1, -2)) / 2


def inverse_root(a: jax.Array, p: int, ridge_eps: float, dtype: str = "float32") -> tuple[jax.Array, jax.Array]:
    """(A + ridge I)^(-1/p) of one matrix and its error (`_root_from_eigh`), both float32: a
    stack of one through `batched_inverse_roots`."""
    ((root, err),) = batched_inverse_roots([a[None]], [p], ridge_eps, dtype)
    return root[0], err[0]


def batched_inverse_roots(
    mats: list[jax.Array], ps: list[int], ridge_eps: float, dtype: str = "float32"
) -> list[tuple[jax.Array, jax.Array]]:
    """Inverse ps[k]-th roots of every statistic stack mats[k], computed in `dtype`. Stacks of
    equal block size are concatenated, so there is one eigendecomposition loop per distinct size
    (no zero-padding to the largest size: eigh is O(b^3), padding a 256-block to 680 would cost
    19x); vectors' statistics (exponent 2) share the loop of their size with matrices' (exponent 4).

    float64 (where the backend has it; `jax.enable_x64` only around this computation): a float32
    eigh's eigenvalues carry absolute errors ~eps_32 lambda_max, so a small eigenvalue's relative
    error is eps_32 cond and the root's up to ~1e-3 at cond 1e4 for p = 2 -- 30x the reference's
    coupled-Newton roots, and above issue 15's parity bound. In float64 eigh costs 1.8x float32
    on this CPU (b = 128 to 1024) and the roots are exact to float32 rounding.

    The eigendecompositions run one matrix at a time in `lax.map`, and only the matmuls are
    vmapped. jaxlib's batched CPU eigh spreads its batch over XLA's intra-op thread pool and
    blocks a pool thread waiting for it; two batched eighs that XLA schedules concurrently
    (on a 2-core machine the pool has two threads) wait on each other forever -- seen here as
    a train step that hangs at random. With one matrix per call the kernel runs inline on an
    XLA thread, with the threads of LAPACK's BLAS (`shampoo.limit_lapack_threads`)."""
    by_size: dict[int, list[int]] = {}
    for k, m in enumerate(mats):
        by_size.setdefault(m.shape[-1], []).append(k)
    out: list = [None] * len(mats)
    for ks in by_size.values():
        # Exponents ride along per matrix: one eigh loop per size, whatever the ranks.
        exps = jnp.concatenate([jnp.full((mats[k].shape[0],), ps[k], jnp.float32) for k in ks])
        with jax.enable_x64(dtype == "float64"):
            batch = _symmetric(jnp.concatenate([mats[k] for k in ks]), dtype)
            lam, vec = jax.lax.map(jnp.linalg.eigh, batch)
            roots, errors = jax.vmap(lambda a, w, v, p: _root_from_eigh(a, w, v, p.astype(dtype), ridge_eps))(
                batch, lam, vec, exps
            )
            roots, errors = roots.astype(jnp.float32), errors.astype(jnp.float32)
        start = 0
        for k in ks:
            n = mats[k].shape[0]
            out[k] = (roots[start : start + n], errors[start : start + n])
            start += n
    return out
