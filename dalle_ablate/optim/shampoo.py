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

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dalle_ablate.registry import ConfigError

GRAFTS = ("rmsprop_normalized", "rmsprop", "adagrad", "sgd", "adam")


# -- static plan: how each parameter is reshaped and blocked ------------------------------------
def merged_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """Drop unit dims; while the rank is above 2, merge the neighbouring pair with the smallest
    product (preferring products <= block_size, so blocks stay whole). A matrix stays a matrix:
    merging it into a vector would leave it to the graft."""
    dims = [d for d in shape if d != 1]
    while len(dims) > 2:
        i = min(range(len(dims) - 1), key=lambda j: dims[j] * dims[j + 1])
        dims[i : i + 2] = [dims[i] * dims[i + 1]]
    return tuple(dims)


def _splits(n: int, block_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + block_size, n)) for s in range(0, n, block_size)]


@dataclass(frozen=True)
class Plan:
    """Static layout: for each parameter, its 2-D shape and its blocks (or None: graft only); for
    each stack, the block shape and its members (param index, row slice, col slice)."""

    shapes2d: tuple[Optional[tuple[int, int]], ...]
    stacks: tuple[tuple[tuple[int, int], tuple[tuple[int, int, int, int, int], ...]], ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(m) for _, m in self.stacks)


def make_plan(shapes: list[tuple[int, ...]], precondition: list[bool], block_size: int, skip_dim_gt: int) -> Plan:
    shapes2d: list[Optional[tuple[int, int]]] = []
    groups: dict[tuple[int, int], list] = {}
    for i, (shape, pre) in enumerate(zip(shapes, precondition)):
        m = merged_shape(tuple(shape), block_size)
        if not pre or len(m) < 2 or max(m) > skip_dim_gt:
            shapes2d.append(None)  # 0-D/1-D, masked out, or too large a dimension: graft only
            continue
        shapes2d.append((m[0], m[1]))
        for r0, r1 in _splits(m[0], block_size):
            for c0, c1 in _splits(m[1], block_size):
                groups.setdefault((r1 - r0, c1 - c0), []).append((i, r0, r1, c0, c1))
    stacks = tuple((shape, tuple(members)) for shape, members in sorted(groups.items()))
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
def _root_from_eigh(a: jax.Array, lam: jax.Array, vec: jax.Array, p: int, ridge_eps: float):
    n = a.shape[-1]
    ridge = ridge_eps * jnp.maximum(jnp.max(lam), 0.0)
    lam = jnp.maximum(lam, 0.0) + ridge
    safe = jnp.where(lam > 0, lam, 1.0)
    root = (vec * jnp.where(lam > 0, safe ** (-1.0 / p), 0.0)) @ vec.T
    diag = jnp.arange(n)
    recon = jnp.linalg.matrix_power(root, p) @ a.at[diag, diag].add(ridge)
    # Subtract I on the diagonal only: `recon - jnp.eye(n)` lets XLA's CPU backend fuse the
    # subtraction into the matmul and emit it as a naive loop (3x slower roots at b = 680).
    return root, jnp.max(jnp.abs(recon.at[diag, diag].add(-1.0)))


def _symmetric(a: jax.Array) -> jax.Array:
    a = a.astype(jnp.float32)
    return (a + jnp.swapaxes(a, -1, -2)) / 2


def inverse_root(a: jax.Array, p: int, ridge_eps: float) -> tuple[jax.Array, jax.Array]:
    """(A + eps lambda_max I)^(-1/p) by symmetric eigendecomposition, and its relative error
    max|X^p (A + ridge) - I|."""
    a = _symmetric(a)
    lam, vec = jnp.linalg.eigh(a)
    return _root_from_eigh(a, lam, vec, p, ridge_eps)


def batched_inverse_roots(mats: list[jax.Array], p: int, ridge_eps: float) -> list[tuple[jax.Array, jax.Array]]:
    """Inverse roots of every statistic. Stacks of equal block size are concatenated, so there
    is one eigendecomposition loop per distinct block size (no zero-padding to the largest
    size: eigh is O(b^3), padding a 256-block to 680 would cost 19x).

    The eigendecompositions run one matrix at a time in `lax.map`, and only the matmuls are
    vmapped. jaxlib's batched CPU eigh spreads its batch over XLA's intra-op thread pool and
    blocks a pool thread waiting for it; two batched eighs that XLA schedules concurrently
    (on a 2-core machine the pool has two threads) wait on each other forever — seen here as
    a train step that hangs at random. With one matrix per call the kernel runs inline, and
    LAPACK's own BLAS threads keep it as fast as the batched call (measured equal)."""
    by_size: dict[int, list[int]] = {}
    for k, m in enumerate(mats):
        by_size.setdefault(m.shape[-1], []).append(k)
    out: list = [None] * len(mats)
    for ks in by_size.values():
        batch = _symmetric(jnp.concatenate([mats[k] for k in ks]))
        lam, vec = jax.lax.map(jnp.linalg.eigh, batch)
        roots, errors = jax.vmap(lambda a, w, v: _root_from_eigh(a, w, v, p, ridge_eps))(batch, lam, vec)
        start = 0
        for k in ks:
            n = mats[k].shape[0]
            out[k] = (roots[start : start + n], errors[start : start + n])
            start += n
    return out


class StackState(NamedTuple):
    left: jax.Array  # [n, b1, b1] statistics
    right: jax.Array  # [n, b2, b2]
    left_root: jax.Array  # [n, b1, b1] L^(-1/p)
    right_root: jax.Array  # [n, b2, b2]
    error: jax.Array  # [n] relative error of the last accepted root
    failed: jax.Array  # [n] int32: inverse roots rejected so far


def stack_spec(n: int, ndim: int, mesh_sizes: dict[str, int]) -> P:
    """Where a stacked state array ([n, b, b] statistics and roots, [n] errors and failure
    counts) lives on a mesh: its block axis split over as many mesh axes as divide n (fsdp first,
    then model, then data), each block whole on one device -- Distributed Shampoo's layout
    (arXiv 2002.09018, sec. 5): every device keeps and inverts only its own blocks."""
    axes, size = [], 1
    for a in ("fsdp", "model", "data"):
        s = mesh_sizes.get(a, 1)
        if s > 1 and n % (size * s) == 0:
            axes.append(a)
            size *= s
    return P(tuple(axes) if axes else None, *([None] * (ndim - 1)))


class ShampooState(NamedTuple):
    count: jax.Array
    graft: Any  # per-parameter graft second moments; None for sgd, which keeps none
    momentum: Any  # per-parameter first moment of the grafted direction
    stacks: tuple  # StackState per block shape
    preconditioned: jax.Array  # share of parameter elements that took the Shampoo direction this step


def scale_by_shampoo(
    *,
    block_size: int = 1024,
    beta1: float = 0.9,
    beta2: float = 0.99,
    graft: str = "rmsprop_normalized",
    graft_beta2: float = 0.99,
    graft_eps: float = 1e-8,
    matrix_eps: float = 1e-6,
    exponent_override: int = 0,
    preconditioning_every: int = 10,
    start_preconditioning_step: int = 101,
    inverse_failure_threshold: float = 0.1,
    skip_preconditioning_dim_size_gt: int = 4096,
    moving_average_for_momentum: bool = False,
    nesterov: bool = False,
    statistics_dtype: Any = jnp.float32,
    precondition_mask: Optional[Callable[[Any], Any]] = None,
    mesh: Optional[Mesh] = None,
) -> optax.GradientTransformation:
    """The grafted, momentum-averaged Shampoo direction (chain with weight decay and
    optax.scale_by_learning_rate). `precondition_mask(params)` gives True where a parameter may
    be preconditioned (DALL·E Mega left embeddings to the graft). With a `mesh`, the stacked
    state is split along its block axis (`stack_spec`) and each device refreshes the inverse
    roots of its own blocks."""
    if graft not in GRAFTS:
        raise ConfigError(f"optim.graft={graft!r} is not a known graft; valid: {', '.join(sorted(GRAFTS))}")
    if preconditioning_every < 1 or block_size < 1:
        raise ConfigError("optim.preconditioning_every and optim.block_size must be >= 1")
    sdt = jnp.dtype(statistics_dtype)
    sharded = mesh is not None and mesh.size > 1

    def spec_of(x: jax.Array) -> P:
        return stack_spec(int(x.shape[0]), x.ndim, dict(mesh.shape))

    def place(stacks: list[jax.Array]) -> list[jax.Array]:
        """Stacked arrays constrained to their block-axis split (nothing to do on one device)."""
        if not sharded:
            return stacks
        return [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_of(x))) for x in stacks]

    def plan_for(params) -> Plan:
        leaves = jax.tree.leaves(params)
        mask = jax.tree.leaves(precondition_mask(params)) if precondition_mask else [True] * len(leaves)
        return make_plan([x.shape for x in leaves], mask, block_size, skip_preconditioning_dim_size_gt)

    def init(params):
        plan = plan_for(params)
        stacks = []
        for (b1, b2), members in plan.stacks:
            n = len(members)
            eye = lambda b: jnp.broadcast_to(jnp.eye(b, dtype=sdt), (n, b, b))  # noqa: E731
            stacks.append(StackState(jnp.zeros((n, b1, b1), sdt), jnp.zeros((n, b2, b2), sdt), eye(b1), eye(b2),
                                     jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.int32)))
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        graft_state = None if graft == "sgd" else zeros
        return ShampooState(jnp.zeros((), jnp.int32), graft_state, jax.tree.map(jnp.copy, zeros), tuple(stacks), jnp.zeros(()))

    def graft_direction(g, v, count):
        if graft == "sgd":
            return g, v
        if graft == "rmsprop_normalized":
            g = g / (jnp.linalg.norm(g) + 1e-16)
        if graft == "adagrad":
            v = v + g * g
            return g / (jnp.sqrt(v) + graft_eps), v
        v = graft_beta2 * v + (1 - graft_beta2) * g * g
        vhat = v / (1 - graft_beta2 ** (count + 1)) if graft == "adam" else v
        return g / (jnp.sqrt(vhat) + graft_eps), v

    def update(updates, state: ShampooState, params=None):
        del params
        plan = plan_for(updates)
        grads, treedef = jax.tree.flatten(updates)
        grads = [g.astype(jnp.float32) for g in grads]
        count = state.count
        # 1. graft directions (and their statistics), per parameter
        moments = [None] * len(grads) if state.graft is None else jax.tree.leaves(state.graft)
        pairs = [graft_direction(g, v, count) for g, v in zip(grads, moments)]
        graft_dirs = [d for d, _ in pairs]
        new_graft = None if state.graft is None else jax.tree.unflatten(treedef, [v for _, v in pairs])
        # 2. Shampoo statistics, stacked
        mats = [g.reshape(s) if s is not None else None for g, s in zip(grads, plan.shapes2d)]
        g_stacks = place(gather(plan, mats))
        new_stacks = []
        c2 = 1 - beta2 if beta2 < 1 else 1.0  # beta2 = 1: Adagrad-style sums
        for st, gs in zip(state.stacks, g_stacks):
            ll = beta2 * st.left.astype(jnp.float32) + c2 * jnp.einsum("nij,nkj->nik", gs, gs)
            rr = beta2 * st.right.astype(jnp.float32) + c2 * jnp.einsum("nji,njk->nik", gs, gs)
            new_stacks.append(st._replace(left=ll.astype(sdt), right=rr.astype(sdt)))
        # 3. inverse roots, every preconditioning_every steps; a failed root keeps the previous one
        p = exponent_override or 4  # 2 x rank, rank 2 after reshaping

        def refresh(stacks):
            roots = batched_inverse_roots([m for st in stacks for m in (st.left, st.right)], p, matrix_eps)
            out = []
            for k, st in enumerate(stacks):
                (lr_, le), (rr_, re) = roots[2 * k], roots[2 * k + 1]
                err = jnp.maximum(le, re)
                ok = jnp.isfinite(err) & (err <= inverse_failure_threshold)
                ok &= jnp.all(jnp.isfinite(lr_), axis=(1, 2)) & jnp.all(jnp.isfinite(rr_), axis=(1, 2))
                keep = lambda new, old: jnp.where(ok[:, None, None], new.astype(sdt), old)  # noqa: E731
                out.append(st._replace(left_root=keep(lr_, st.left_root), right_root=keep(rr_, st.right_root),
                                       error=jnp.where(ok, err, st.error), failed=st.failed + (~ok).astype(jnp.int32)))
            return tuple(out)

        new_stacks = tuple(StackState(*place(list(st))) for st in new_stacks)
        if sharded:
            # Per device, in shard_map over the block axis: no communication inside the loop of
            # eighs. Left to XLA's SPMD partitioner, the loop over a sharded stack inside the
            # refresh's lax.cond became collectives that devices reached in different orders
            # (a (2, 2, 2) mesh of CPU devices hung: some in an all-gather inside the
            # conditional, the others in the next all-reduce).
            specs = tuple(StackState(*(spec_of(v) for v in st)) for st in new_stacks)
            # check_vma=False: the refresh concatenates the local blocks of equal size from stacks
            # split over different axes, so JAX's type check sees every output as varying over
            # all of them; each block's root depends on that block alone, so a stack replicated
            # over an axis comes out identical on every device of it.
            refresh = jax.shard_map(refresh, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
        new_stacks = jax.lax.cond(count % preconditioning_every == 0, refresh, tuple, new_stacks)
        # 4. preconditioned blocks, each grafted to the norm of the graft direction's block. Before
        # start_preconditioning_step the graft direction is used alone and, under lax.cond, the
        # preconditioning matmuls are not run at all (statistics and roots still accumulate).
        use_shampoo = count >= start_preconditioning_step

        # Blocks move between the parameters' layout and the stacks' only outside the conds, so
        # neither branch communicates: every stack operand is split the same way along its block
        # axis, and the false branch hands the graft blocks back unchanged.
        graft_stacks = place(gather(plan, [d.reshape(s) if s is not None else None for d, s in zip(graft_dirs, plan.shapes2d)]))

        def preconditioned(graft_stacks):
            out_stacks = []
            for st, gs, gr in zip(new_stacks, g_stacks, graft_stacks):
                pre = jnp.einsum("nij,njk,nkl->nil", st.left_root.astype(jnp.float32), gs, st.right_root.astype(jnp.float32))
                scale = jnp.linalg.norm(gr, axis=(1, 2)) / (jnp.linalg.norm(pre, axis=(1, 2)) + 1e-16)
                out_stacks.append(pre * scale[:, None, None])
            return out_stacks

        out_stacks = jax.lax.cond(use_shampoo, preconditioned, list, graft_stacks) if plan.stacks else []
        directions = [d if m is None else m.reshape(d.shape) for d, m in zip(graft_dirs, scatter(plan, out_stacks))]
        # 5. momentum on the grafted direction: EMA or heavy ball, optionally Nesterov
        c = (1 - beta1) if moving_average_for_momentum else 1.0
        new_m = [beta1 * m + c * d for m, d in zip(jax.tree.leaves(state.momentum), directions)]
        out = [beta1 * m + c * d if nesterov else m for m, d in zip(new_m, directions)] if beta1 > 0 else directions
        out = [o.astype(u.dtype) for o, u in zip(out, jax.tree.leaves(updates))]
        total = sum(g.size for g in grads)
        covered = sum(g.size for g, s in zip(grads, plan.shapes2d) if s is not None)
        share = jnp.where(use_shampoo, covered / max(total, 1), 0.0).astype(jnp.float32)
        new_state = ShampooState(count + 1, new_graft, jax.tree.unflatten(treedef, new_m), tuple(new_stacks), share)
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init, update)


def shampoo_stats(opt_state) -> dict[str, jax.Array]:
    """Logged every trainer.log_every steps: share of blocks preconditioned, inverse roots
    rejected so far, mean error of the roots in use. Empty when no Shampoo state is present."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ShampooState)) if isinstance(s, ShampooState)]
    if not found:
        return {}
    stacks = found[0].stacks
    n = sum(int(s.error.shape[0]) for s in stacks)
    if n == 0:
        return {"optim/shampoo/preconditioned_fraction": found[0].preconditioned}
    return {
        "optim/shampoo/preconditioned_fraction": found[0].preconditioned,
        "optim/shampoo/failed_roots": sum(jnp.sum(s.failed) for s in stacks).astype(jnp.float32),
        "optim/shampoo/root_error": sum(jnp.sum(s.error) for s in stacks) / n,
    }
