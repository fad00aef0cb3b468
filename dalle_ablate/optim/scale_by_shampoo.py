"""Distributed Shampoo as DALL·E Mega used it, as an optax GradientTransformation.

Shampoo (Gupta et al. 2018, arXiv 1802.09568) preconditions a matrix gradient G with
L^(-1/4) G R^(-1/4), L = sum G G^T, R = sum G^T G; Distributed Shampoo (Anil et al. 2020,
arXiv 2002.09018) makes it practical: blocks of at most `block_size`, inverse roots recomputed
every few steps, and the step size taken from a simpler "graft" optimizer per block.

Layout (this module's own): every parameter is reshaped to at most 2-D (unit dims dropped, small
dims merged), cut into blocks, and blocks of equal shape from all parameters are stacked into one
[n, b1, b2] array. Statistics, eigendecompositions and matmuls run vmapped over the stack: the
compiled step has no loop over blocks or layers, and the stacked axis is what a mesh shards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from dalle_ablate.registry import ConfigError

GRAFTS = ("rmsprop_normalized", "rmsprop", "adagrad", "sgd", "adam")
GRAFT_SCOPES = ("parameter", "block")
ROOT_DTYPES = ("float64", "float32")
STATISTICS_DTYPES = ("bfloat16", "float32")


# -- static plan: how each parameter is reshaped and blocked ------------------------------------
MERGE_SMALL_DIMS = 4096  # distributed_shampoo's merge_small_dims_block_size default, as Mega ran it


def merged_shape(shape: tuple[int, ...], merge_max: int = MERGE_SMALL_DIMS) -> tuple[int, ...]:
    """The reference's shape interpretation (distributed_shampoo's `merge_small_dims`): walking
    the dims left to right, neighbours are merged while their product stays <= merge_max, and unit
    dims vanish -- so a 32 x 128 matrix (4096 elements) is preconditioned as one vector, as Mega's
    optimizer would have. Stacks here are 2-D, so a result of rank > 2 (no model in this project
    has one) is merged further, smallest neighbouring pair first; all-unit shapes give ()."""
    dims: list[int] = []
    product = 1
    for d in shape:
        if product * d <= merge_max:
            product *= d
        else:
            if product > 1:
                dims.append(product)
            product = d
    if product > 1:
        dims.append(product)
    while len(dims) > 2:
        i = min(range(len(dims) - 1), key=lambda j: dims[j] * dims[j + 1])
        dims[i : i + 2] = [dims[i] * dims[i + 1]]
    return tuple(dims)


def _splits(n: int, block_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + block_size, n)) for s in range(0, n, block_size)]


@dataclass(frozen=True)
class Plan:
    """Static layout: for each parameter, its 2-D shape (a vector as a column, (n, 1)) and its
    blocks (or None: graft only); for each stack, its key (block rows, block cols, rank) and its
    members (param index, row slice, col slice). Rank-1 stacks have one statistic per block."""

    shapes2d: tuple[Optional[tuple[int, int]], ...]
    stacks: tuple[tuple[tuple[int, int, int], tuple[tuple[int, int, int, int, int], ...]], ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(m) for _, m in self.stacks)


def make_plan(shapes: list[tuple[int, ...]], precondition: list[bool], block_size: int, skip_dim_gt: int,
              precondition_1d: bool = True, merge_max: int = MERGE_SMALL_DIMS) -> Plan:
    shapes2d: list[Optional[tuple[int, int]]] = []
    groups: dict[tuple[int, int, int], list] = {}
    for i, (shape, pre) in enumerate(zip(shapes, precondition)):
        m = merged_shape(tuple(shape), merge_max)
        # The reference tests the parameter's own dims against skip_dim_gt, before merging, and
        # its rank (skip_preconditioning_rank_lt) too: a small matrix merged into a vector is
        # still preconditioned when vectors are not.
        vector = sum(d > 1 for d in shape) <= 1
        if not pre or not m or any(d > skip_dim_gt for d in shape) or (vector and not precondition_1d):
            shapes2d.append(None)  # masked out, scalar, too large a dimension, or a vector left to the graft
            continue
        rows, cols = (m[0], 1) if len(m) == 1 else m
        shapes2d.append((rows, cols))
        for r0, r1 in _splits(rows, block_size):
            for c0, c1 in _splits(cols, block_size):
                groups.setdefault((r1 - r0, c1 - c0, len(m)), []).append((i, r0, r1, c0, c1))
    stacks = tuple((key, tuple(members)) for key, members in sorted(groups.items()))
    return Plan(tuple(shapes2d), stacks)


def gather(plan: Plan, mats: list[Optional[jax.Array]]) -> list[jax.Array]:
    """The blocks of the 2-D parameters, one [n, b1, b2] stack per block shape."""
    return [jnp.stack([mats[i][r0:r1, c0:c1] for i, r0, r1, c0, c1 in members]) for _, members in plan.stacks]


def scatter(plan: Plan, stacks: list[jax.Array]) -> list[Optional[jax.Array]]:
    """Inverse of gather: each blocked parameter's 2-D matrix, reassembled from its blocks."""
    pieces: dict[int, dict[tuple[int, int], jax.Array]] = {}
    for (_, members), stack in zip(plan.stacks, stacks):
        for k, (i, r0, _, c0, _) in enumerate(members):
            pieces.setdefault(i, {})[(r0, c0)] = stack[k]
    out: list[Optional[jax.Array]] = []
    for i, shape in enumerate(plan.shapes2d):
        if shape is None:
            out.append(None)
            continue
        rows = sorted({r for r, _ in pieces[i]})
        cols = sorted({c for _, c in pieces[i]})
        out.append(jnp.block([[pieces[i][(r, c)] for c in cols] for r in rows]))
    return out


# -- inverse p-th roots ---------------------------------------------------------------------------
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


def batched_inverse_roots(mats: list[jax.Array], ps: list[int], ridge_eps: float,
                          dtype: str = "float32") -> list[tuple[jax.Array, jax.Array]]:
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
                batch, lam, vec, exps)
            roots, errors = roots.astype(jnp.float32), errors.astype(jnp.float32)
        start = 0
        for k in ks:
            n = mats[k].shape[0]
            out[k] = (roots[start : start + n], errors[start : start + n])
            start += n
    return out


class StackState(NamedTuple):
    left: jax.Array  # [n, b1, b1] statistics
    right: jax.Array  # [n, b2, b2] (rank-1 stacks: [n, 1, 1], never used)
    left_root: jax.Array  # [n, b1, b1] L^(-1/p)
    right_root: jax.Array  # [n, b2, b2]
    error: jax.Array  # [n] error of the last accepted root
    failed: jax.Array  # [n] int32: inverse roots rejected so far
    last_failed: jax.Array  # [n] int32: 1 where the latest refresh was rejected


class ShampooState(NamedTuple):
    count: jax.Array
    graft: Any  # per-parameter graft second moments; None for sgd, which keeps none
    graft_momentum: Any  # momentum of the graft direction (the reference's diagonal_momentum)
    momentum: Any  # momentum of the grafted Shampoo direction
    stacks: tuple  # StackState per stack key
    preconditioned: jax.Array  # share of parameter elements that took the Shampoo direction this step
    # Inverse-root refreshes so far, the failure rate's denominator: ceil(count / period), kept
    # here so that shampoo_stats needs only the state, not the optimizer's period.
    refreshes: jax.Array


def scale_by_shampoo(
    *,
    block_size: int = 1024,
    beta1: float = 0.9,
    beta2: float = 0.99,
    graft: str = "rmsprop_normalized",
    graft_beta2: Optional[float] = None,
    graft_eps: float = 1e-10,
    graft_scope: str = "parameter",
    matrix_eps: float = 1e-6,
    exponent_override: int = 0,
    preconditioning_every: int = 10,
    start_preconditioning_step: int = 101,
    inverse_failure_threshold: float = 0.1,
    skip_preconditioning_dim_size_gt: int = 4096,
    precondition_1d: bool = True,
    merge_small_dims: int = MERGE_SMALL_DIMS,
    moving_average_for_momentum: bool = True,
    nesterov: bool = False,
    statistics_dtype: Any = jnp.float32,
    root_dtype: str = "float64",
    precondition_mask: Optional[Callable[[Any], Any]] = None,
    stack_sharding: Optional[Callable[[tuple[int, ...]], NamedSharding]] = None,
) -> optax.GradientTransformation:
    """The grafted, momentum-averaged Shampoo direction (chain with weight decay and
    optax.scale_by_learning_rate), step for step Google's `distributed_shampoo` as DALL·E Mega
    configured it (tests/optim/test_shampoo_parity.py): statistics from matrix_eps I, grafting per
    parameter, a graft and a Shampoo momentum buffer both updated from step 0 (the Shampoo one
    takes over at start_preconditioning_step), vectors preconditioned with their one statistic.
    `graft_beta2` None: beta2, as the reference has one beta2. `precondition_mask(params)` gives
    True where a parameter may be preconditioned (Mega's embeddings were too large for it). With
    `stack_sharding` (the shape of a stacked state array -> where it lives; `parallel.stack_sharding`
    splits the block axis over the mesh) each device refreshes the inverse roots of its own blocks.
    `root_dtype`: where the eigendecompositions run (`batched_inverse_roots`); TPUs have no float64."""
    if graft not in GRAFTS:
        raise ConfigError(f"optim.graft={graft!r} is not a known graft; valid: {', '.join(sorted(GRAFTS))}")
    if graft_scope not in GRAFT_SCOPES:
        raise ConfigError(f"optim.graft_scope={graft_scope!r} is not valid; valid: {', '.join(GRAFT_SCOPES)}")
    if root_dtype not in ROOT_DTYPES:
        raise ConfigError(f"optim.root_dtype={root_dtype!r} is not valid; valid: {', '.join(ROOT_DTYPES)}")
    if preconditioning_every < 1 or block_size < 1:
        raise ConfigError("optim.preconditioning_every and optim.block_size must be >= 1")
    sdt = jnp.dtype(statistics_dtype)
    sharded = stack_sharding is not None
    graft_beta2 = beta2 if graft_beta2 is None else graft_beta2

    def decay(b: float) -> float:
        return 1 - b if b < 1 else 1.0  # beta = 1: Adagrad-style sums, as the reference

    def exponent(rank: int) -> int:
        return exponent_override or 2 * rank  # the reference: 2 x the number of statistics

    def place(stacks: list[jax.Array]) -> list[jax.Array]:
        """Stacked arrays constrained to their block-axis split (nothing to do on one device)."""
        if not sharded:
            return stacks
        return [jax.lax.with_sharding_constraint(x, stack_sharding(x.shape)) for x in stacks]

    def plan_for(params) -> Plan:
        leaves = jax.tree.leaves(params)
        mask = jax.tree.leaves(precondition_mask(params)) if precondition_mask else [True] * len(leaves)
        return make_plan([x.shape for x in leaves], mask, block_size, skip_preconditioning_dim_size_gt, precondition_1d,
                         merge_small_dims)

    def init(params):
        plan = plan_for(params)
        stacks = []
        for (b1, b2, _), members in plan.stacks:
            n = len(members)
            eye = lambda b: jnp.broadcast_to(jnp.eye(b, dtype=sdt), (n, b, b))  # noqa: E731
            # Statistics start at matrix_eps I, as the reference's (a first root is then defined
            # even for a block whose gradient is still zero).
            stacks.append(StackState(matrix_eps * eye(b1), matrix_eps * eye(b2), eye(b1), eye(b2),
                                     jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32)))
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # noqa: E731
        return ShampooState(jnp.zeros((), jnp.int32), None if graft == "sgd" else zeros(), zeros(), zeros(),
                            tuple(stacks), jnp.zeros(()), jnp.zeros((), jnp.int32))

    def graft_direction(g, v):
        if graft == "sgd":
            return g, v
        if graft == "rmsprop_normalized":
            g = g / (jnp.linalg.norm(g) + 1e-16)
        if graft == "adagrad":
            v = v + g * g
        else:
            v = graft_beta2 * v + decay(graft_beta2) * g * g
        return g / (jnp.sqrt(v) + graft_eps), v

    def adam_direction(g, v, count):
        v = graft_beta2 * v + decay(graft_beta2) * g * g
        return g / (jnp.sqrt(v / (1 - graft_beta2 ** (count + 1))) + graft_eps), v

    def refresh(stacks, keys):
        """New inverse roots of every block; a rejected root keeps the previous one."""
        mats, ps = [], []
        for (_, _, rank), st in zip(keys, stacks):
            mats += [st.left] + ([st.right] if rank == 2 else [])
            ps += [exponent(rank)] * rank
        roots = iter(batched_inverse_roots(mats, ps, matrix_eps, root_dtype))
        out = []
        for (_, _, rank), st in zip(keys, stacks):
            lr_, err = next(roots)
            rr_ = st.right_root
            if rank == 2:
                rr_, re = next(roots)
                err = jnp.maximum(err, re)
            ok = jnp.isfinite(err) & (err <= inverse_failure_threshold)
            ok &= jnp.all(jnp.isfinite(lr_), axis=(1, 2)) & jnp.all(jnp.isfinite(rr_), axis=(1, 2))
            keep = lambda new, old: jnp.where(ok[:, None, None], new.astype(sdt), old)  # noqa: E731
            out.append(st._replace(left_root=keep(lr_, st.left_root), right_root=keep(rr_, st.right_root),
                                   error=jnp.where(ok, err, st.error), failed=st.failed + (~ok).astype(jnp.int32),
                                   last_failed=(~ok).astype(jnp.int32)))
        return tuple(out)

    def update(updates, state: ShampooState, params=None):
        del params
        plan = plan_for(updates)
        keys = [key for key, _ in plan.stacks]
        grads, treedef = jax.tree.flatten(updates)
        grads = [g.astype(jnp.float32) for g in grads]
        count = state.count
        # 1. graft directions (and their statistics), per parameter
        moments = [None] * len(grads) if state.graft is None else jax.tree.leaves(state.graft)
        pairs = [adam_direction(g, v, count) if graft == "adam" else graft_direction(g, v) for g, v in zip(grads, moments)]
        graft_dirs = [d for d, _ in pairs]
        new_graft = None if state.graft is None else jax.tree.unflatten(treedef, [v for _, v in pairs])
        # 2. Shampoo statistics, stacked (a rank-1 stack's right statistic is never used)
        mats = [g.reshape(s) if s is not None else None for g, s in zip(grads, plan.shapes2d)]
        g_stacks = place(gather(plan, mats))
        new_stacks = []
        for (_, _, rank), st, gs in zip(keys, state.stacks, g_stacks):
            ll = beta2 * st.left.astype(jnp.float32) + decay(beta2) * jnp.einsum("nij,nkj->nik", gs, gs)
            rr = beta2 * st.right.astype(jnp.float32) + decay(beta2) * jnp.einsum("nji,njk->nik", gs, gs)
            new_stacks.append(st._replace(left=ll.astype(sdt), right=(rr.astype(sdt) if rank == 2 else st.right)))
        # 3. inverse roots, every preconditioning_every steps
        new_stacks = tuple(StackState(*place(list(st))) for st in new_stacks)
        do_refresh = functools.partial(refresh, keys=keys)
        if sharded and new_stacks:
            # Per device, in shard_map over the block axis: no communication inside the loop of
            # eighs. Left to XLA's SPMD partitioner, the loop over a sharded stack inside the
            # refresh's lax.cond became collectives that devices reached in different orders
            # (a (2, 2, 2) mesh of CPU devices hung: some in an all-gather inside the
            # conditional, the others in the next all-reduce).
            specs = tuple(StackState(*(stack_sharding(v.shape).spec for v in st)) for st in new_stacks)
            mesh = stack_sharding(new_stacks[0].left.shape).mesh
            # check_vma=False: the refresh concatenates the local blocks of equal size from stacks
            # split over different axes, so JAX's type check sees every output as varying over
            # all of them; each block's root depends on that block alone, so a stack replicated
            # over an axis comes out identical on every device of it.
            do_refresh = jax.shard_map(do_refresh, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
        refreshing = count % preconditioning_every == 0
        new_stacks = jax.lax.cond(refreshing, do_refresh, tuple, new_stacks)
        # 4. preconditioned blocks, every step: the Shampoo momentum accumulates from step 0, as the
        # reference's, so it is warm when it takes over at start_preconditioning_step.
        pre_stacks = [jnp.einsum("nij,njk,nkl->nil", st.left_root.astype(jnp.float32), gs, st.right_root.astype(jnp.float32))
                      for st, gs in zip(new_stacks, g_stacks)]
        # 5. grafting: the preconditioned direction takes the graft direction's norm -- per
        # parameter as the reference (arXiv 2002.09018 sec. 3.4 grafts layer-wise), or per block.
        if graft_scope == "parameter":
            owners = [np.array([m[0] for m in members]) for _, members in plan.stacks]  # each block's parameter
            graft_norms = jnp.stack([jnp.linalg.norm(d) for d in graft_dirs]) if grads else jnp.zeros((0,))
            pre_sq = jnp.zeros((len(grads),), jnp.float32)
            for idx, pre in zip(owners, pre_stacks):
                pre_sq = pre_sq.at[idx].add(jnp.sum(pre * pre, axis=(1, 2)))
            scales = [graft_norms[idx] / (jnp.sqrt(pre_sq[idx]) + 1e-16) for idx in owners]
        else:
            graft_stacks = place(gather(plan, [d.reshape(s) if s is not None else None for d, s in zip(graft_dirs, plan.shapes2d)]))
            scales = [jnp.linalg.norm(gr, axis=(1, 2)) / (jnp.linalg.norm(pre, axis=(1, 2)) + 1e-16)
                      for gr, pre in zip(graft_stacks, pre_stacks)]
        out_stacks = [pre * sc[:, None, None] for pre, sc in zip(pre_stacks, scales)]
        shampoo_dirs = [d if m is None else m.reshape(d.shape) for d, m in zip(graft_dirs, scatter(plan, out_stacks))]
        # 6. momentum (EMA or heavy ball, optionally Nesterov) on both directions; the graft's is
        # used before start_preconditioning_step, the Shampoo one from it on.
        w = (1 - beta1) if moving_average_for_momentum else 1.0
        graft_m = [beta1 * m + w * d for m, d in zip(jax.tree.leaves(state.graft_momentum), graft_dirs)]
        shampoo_m = [beta1 * m + w * d for m, d in zip(jax.tree.leaves(state.momentum), shampoo_dirs)]
        use_shampoo = count >= start_preconditioning_step
        out = []
        for gm, sm, gd, sd, u in zip(graft_m, shampoo_m, graft_dirs, shampoo_dirs, jax.tree.leaves(updates)):
            m, d = jnp.where(use_shampoo, sm, gm), jnp.where(use_shampoo, sd, gd)
            out.append((w * d + beta1 * m if nesterov else m).astype(u.dtype))
        total = sum(g.size for g in grads)
        covered = sum(g.size for g, s in zip(grads, plan.shapes2d) if s is not None)
        share = jnp.where(use_shampoo, covered / max(total, 1), 0.0).astype(jnp.float32)
        new_state = ShampooState(count + 1, new_graft, jax.tree.unflatten(treedef, graft_m),
                                 jax.tree.unflatten(treedef, shampoo_m), tuple(new_stacks), share,
                                 state.refreshes + refreshing.astype(jnp.int32))
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init, update)


def shampoo_stats(opt_state) -> dict[str, jax.Array]:
    """Logged every trainer.log_every steps: share of parameter elements preconditioned, share of
    blocks whose root the latest refresh rejected, share of all root refreshes so far rejected,
    and the mean error of the roots in use. Empty when no Shampoo state is present."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ShampooState)) if isinstance(s, ShampooState)]
    if not found:
        return {}
    state = found[0]
    n = sum(int(s.error.shape[0]) for s in state.stacks)
    if n == 0:
        return {"optim/shampoo/preconditioned_fraction": state.preconditioned}
    failed = sum(jnp.sum(s.failed) for s in state.stacks).astype(jnp.float32)
    return {
        "optim/shampoo/preconditioned_fraction": state.preconditioned,
        "optim/shampoo/failed_roots_last_refresh": sum(jnp.sum(s.last_failed) for s in state.stacks) / n,
        "optim/shampoo/failed_root_rate": failed / (n * jnp.maximum(state.refreshes, 1)),
        "optim/shampoo/root_error": sum(jnp.sum(s.error) for s in state.stacks) / n,
    }
