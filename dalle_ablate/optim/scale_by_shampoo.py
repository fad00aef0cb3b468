"""Distributed Shampoo as DALL·E Mega used it, as an optax GradientTransformation.

Shampoo (Gupta et al. 2018, arXiv 1802.09568) preconditions a matrix gradient G with
L^(-1/4) G R^(-1/4), L = sum G G^T, R = sum G^T G; Distributed Shampoo (Anil et al. 2020,
arXiv 2002.09018) makes it practical: blocks of at most `block_size`, inverse roots recomputed
every few steps, and the step size taken from a simpler "graft" optimizer per block.

Layout (optim/shampoo_blocks.py): every parameter is reshaped to at most 2-D (unit dims dropped,
small dims merged), cut into blocks, and blocks of equal shape from all parameters are stacked into
one [n, b1, b2] array. Statistics, eigendecompositions and matmuls run vmapped over the stack: the
compiled step has no loop over blocks or layers, and the stacked axis is what a mesh shards.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from dalle_ablate.optim.inverse_roots import batched_inverse_roots
from dalle_ablate.optim.shampoo_blocks import MERGE_SMALL_DIMS, Plan, gather, make_plan, scatter
from dalle_ablate.registry import check, check_ranges

GRAFTS = ("rmsprop_normalized", "rmsprop", "adagrad", "sgd", "adam")
GRAFT_SCOPES = ("parameter", "block")
ROOT_DTYPES = ("float64", "float32")
STATISTICS_DTYPES = ("bfloat16", "float32")


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


# -- options: the one list ------------------------------------------------------------------------
# distributed_shampoo's keyword names, which callers of scale_by_shampoo (the parity test among
# them) may use for the options that optim=shampoo names as its other optimizers do (optim.b1 ...).
REFERENCE_NAMES = {"beta1": "b1", "beta2": "b2", "graft_beta2": "graft_b2"}
CHOICES = {
    "graft": GRAFTS,
    "graft_scope": GRAFT_SCOPES,
    "statistics_dtype": STATISTICS_DTYPES,
    "root_dtype": ("auto", *ROOT_DTYPES),
}


@dataclass(frozen=True)
class ShampooOptions:
    """Every option of the transformation, with its default and why: the one list. `optim=shampoo`'s
    config (`shampoo.ShampooConfig`) takes its fields from here, so a new option is one field here
    and the phase below that reads it. The defaults are DALL·E Mega's configuration of Google's
    `distributed_shampoo`, matched step for step (tests/optim/test_shampoo_parity.py)."""

    RANGES: ClassVar[dict[str, str]] = {
        "b1": "[0, 1)",
        "b2": "[0, 1]",  # b2 = 1: Adagrad-style sums
        "block_size": "[1, inf)",
        "graft_b2": "[0, 1] or null",
        "graft_eps": "[0, inf)",
        "matrix_eps": "[0, inf)",
        "exponent_override": "[0, inf)",
        "preconditioning_every": "[1, inf)",
        "start_preconditioning_step": "[0, inf)",
        "inverse_failure_threshold": "(0, inf)",
        "skip_preconditioning_dim_size_gt": "[1, inf)",
        "merge_small_dims": "[0, inf)",
    }

    block_size: int = 1024  # dimensions longer than this are split into blocks
    b1: float = 0.9  # momentum on the grafted direction
    b2: float = 0.99  # statistics decay; 1.0 = Adagrad-style sums
    graft: str = "rmsprop_normalized"  # rmsprop_normalized | rmsprop | adagrad | sgd | adam
    graft_b2: Optional[float] = None  # null: b2, as the reference has one beta2
    graft_eps: float = 1e-10  # Mega's diagonal_epsilon
    # parameter: each parameter's Shampoo direction takes its graft direction's norm, as the
    # reference; block: each block's (this project's rule before issue 15; blocks of one matrix
    # then move at different rates).
    graft_scope: str = "parameter"
    matrix_eps: float = 1e-6  # ridge, relative to the largest eigenvalue
    exponent_override: int = 0  # 0 = 2 x the statistics per block (4 for matrices, 2 for vectors)
    preconditioning_every: int = 10  # recompute inverse roots every k steps
    start_preconditioning_step: int = 101  # graft direction alone before this step
    inverse_failure_threshold: float = 0.1  # keep the previous root above this eigh backward error
    skip_preconditioning_dim_size_gt: int = 4096  # graft only for any larger dimension
    # Vectors (biases, norm gains) preconditioned by their one statistic, as Mega ran it
    # (skip_preconditioning_rank_lt=1); false leaves them to the graft, which is cheaper.
    precondition_1d: bool = True
    # Neighbouring dims are merged while their product is at most this (the reference's
    # merge_small_dims_block_size), so a 64 x 64 matrix is preconditioned as a 4096-vector: four
    # 1024-blocks and 1024 x 1024 roots instead of two 64 x 64. 0 keeps every matrix a matrix.
    merge_small_dims: int = MERGE_SMALL_DIMS
    moving_average_for_momentum: bool = True  # EMA momentum (dalle-mini's setting) instead of heavy ball
    nesterov: bool = False  # Nesterov momentum on the grafted direction
    statistics_dtype: str = "float32"  # float32 | bfloat16 for statistics and roots
    # Where inverse roots are computed: auto = float64 where the backend has it (CPU, GPU), float32
    # on TPU. float32 roots of ill-conditioned statistics are off by up to ~1e-3 (batched_inverse_roots).
    root_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name, valid in CHOICES.items():
            value = getattr(self, name)
            check(value in valid, f"optim.{name}={value!r} is not valid; valid: {', '.join(sorted(valid))}")
        check_ranges(self, self.RANGES, "optim")

    @property
    def graft_beta2(self) -> float:
        return self.b2 if self.graft_b2 is None else self.graft_b2

    @property
    def roots_in(self) -> str:
        """root_dtype resolved: auto is float64 unless the backend is a TPU, which has no float64."""
        if self.root_dtype != "auto":
            return self.root_dtype
        return "float32" if jax.default_backend() == "tpu" else "float64"

    def exponent(self, rank: int) -> int:
        return self.exponent_override or 2 * rank  # the reference: 2 x the number of statistics


def _decay(b: float) -> float:
    return 1 - b if b < 1 else 1.0  # beta = 1: Adagrad-style sums, as the reference


def place(stacks: list[jax.Array], stack_sharding) -> list[jax.Array]:
    """Stacked arrays constrained to their block-axis split (nothing to do on one device)."""
    if stack_sharding is None:
        return stacks
    return [jax.lax.with_sharding_constraint(x, stack_sharding(x.shape)) for x in stacks]


def plan_for(o: ShampooOptions, params, precondition_mask) -> Plan:
    leaves = jax.tree.leaves(params)
    mask = jax.tree.leaves(precondition_mask(params)) if precondition_mask else [True] * len(leaves)
    return make_plan(
        [x.shape for x in leaves],
        mask,
        o.block_size,
        o.skip_preconditioning_dim_size_gt,
        o.precondition_1d,
        o.merge_small_dims,
    )


def as_matrices(plan: Plan, xs: list[jax.Array]) -> list[Optional[jax.Array]]:
    """Each blocked parameter's array in its 2-D shape; None for the graft-only ones."""
    return [x.reshape(s) if s is not None else None for x, s in zip(xs, plan.shapes2d)]


def init_state(o: ShampooOptions, plan: Plan, params) -> ShampooState:
    sdt = jnp.dtype(o.statistics_dtype)
    stacks = []
    for (b1, b2, _), members in plan.stacks:
        n = len(members)
        eye = lambda b: jnp.broadcast_to(jnp.eye(b, dtype=sdt), (n, b, b))  # noqa: E731
        # Statistics start at matrix_eps I, as the reference's (a first root is then defined
        # even for a block whose gradient is still zero).
        stacks.append(
            StackState(
                o.matrix_eps * eye(b1),
                o.matrix_eps * eye(b2),
                eye(b1),
                eye(b2),
                jnp.zeros((n,), jnp.float32),
                jnp.zeros((n,), jnp.int32),
                jnp.zeros((n,), jnp.int32),
            )
        )
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # noqa: E731
    return ShampooState(
        jnp.zeros((), jnp.int32),
        None if o.graft == "sgd" else zeros(),
        zeros(),
        zeros(),
        tuple(stacks),
        jnp.zeros(()),
        jnp.zeros((), jnp.int32),
    )


# -- the phases of one update, in order -----------------------------------------------------------
def graft_direction(o: ShampooOptions, g: jax.Array, v, count: jax.Array):
    """Phase 1, per parameter: the graft optimizer's direction and its new second moment (None
    for sgd). Its norm is the step size the Shampoo direction takes (Anil et al. 2020, sec. 3.4)."""
    beta2 = o.graft_beta2
    if o.graft == "sgd":
        return g, v
    if o.graft == "adam":
        v = beta2 * v + _decay(beta2) * g * g
        return g / (jnp.sqrt(v / (1 - beta2 ** (count + 1))) + o.graft_eps), v
    if o.graft == "rmsprop_normalized":
        g = g / (jnp.linalg.norm(g) + 1e-16)
    if o.graft == "adagrad":
        v = v + g * g
    else:
        v = beta2 * v + _decay(beta2) * g * g
    return g / (jnp.sqrt(v) + o.graft_eps), v


def accumulate_statistics(o: ShampooOptions, stacks, keys, g_stacks) -> tuple[StackState, ...]:
    """Phase 2, every step: L = b2 L + (1 - b2) G G^T and R = b2 R + (1 - b2) G^T G per block
    (Gupta et al. 2018, alg. 1, with the exponential decay of Anil et al. 2020); a rank-1 stack's
    right statistic is never used."""
    sdt = jnp.dtype(o.statistics_dtype)
    out = []
    for (_, _, rank), st, gs in zip(keys, stacks, g_stacks):
        ll = o.b2 * st.left.astype(jnp.float32) + _decay(o.b2) * jnp.einsum("nij,nkj->nik", gs, gs)
        rr = o.b2 * st.right.astype(jnp.float32) + _decay(o.b2) * jnp.einsum("nji,njk->nik", gs, gs)
        out.append(st._replace(left=ll.astype(sdt), right=(rr.astype(sdt) if rank == 2 else st.right)))
    return tuple(out)


def refresh_roots(o: ShampooOptions, stacks, keys) -> tuple[StackState, ...]:
    """New inverse roots L^(-1/p), R^(-1/p) of every block; a rejected root (error above
    inverse_failure_threshold, or not finite) keeps the previous one, as the reference does."""
    sdt = jnp.dtype(o.statistics_dtype)
    mats, ps = [], []
    for (_, _, rank), st in zip(keys, stacks):
        mats += [st.left] + ([st.right] if rank == 2 else [])
        ps += [o.exponent(rank)] * rank
    roots = iter(batched_inverse_roots(mats, ps, o.matrix_eps, o.roots_in))
    out = []
    for (_, _, rank), st in zip(keys, stacks):
        lr_, err = next(roots)
        rr_ = st.right_root
        if rank == 2:
            rr_, re = next(roots)
            err = jnp.maximum(err, re)
        ok = jnp.isfinite(err) & (err <= o.inverse_failure_threshold)
        ok &= jnp.all(jnp.isfinite(lr_), axis=(1, 2)) & jnp.all(jnp.isfinite(rr_), axis=(1, 2))
        keep = lambda new, old: jnp.where(ok[:, None, None], new.astype(sdt), old)  # noqa: E731
        out.append(
            st._replace(
                left_root=keep(lr_, st.left_root),
                right_root=keep(rr_, st.right_root),
                error=jnp.where(ok, err, st.error),
                failed=st.failed + (~ok).astype(jnp.int32),
                last_failed=(~ok).astype(jnp.int32),
            )
        )
    return tuple(out)


def refresh_if_due(o: ShampooOptions, stacks, keys, count, stack_sharding) -> tuple[tuple[StackState, ...], jax.Array]:
    """Phase 3: the stacks with new inverse roots every preconditioning_every steps (Anil et al.
    2020, sec. 5: the roots are the costly part and change slowly), and whether this step refreshed."""
    stacks = tuple(StackState(*place(list(st), stack_sharding)) for st in stacks)
    do_refresh = functools.partial(refresh_roots, o, keys=keys)
    if stack_sharding is not None and stacks:
        # Per device, in shard_map over the block axis: no communication inside the loop of
        # eighs. Left to XLA's SPMD partitioner, the loop over a sharded stack inside the
        # refresh's lax.cond became collectives that devices reached in different orders
        # (a (2, 2, 2) mesh of CPU devices hung: some in an all-gather inside the
        # conditional, the others in the next all-reduce).
        specs = tuple(StackState(*(stack_sharding(v.shape).spec for v in st)) for st in stacks)
        mesh = stack_sharding(stacks[0].left.shape).mesh
        # check_vma=False: the refresh concatenates the local blocks of equal size from stacks
        # split over different axes, so JAX's type check sees every output as varying over
        # all of them; each block's root depends on that block alone, so a stack replicated
        # over an axis comes out identical on every device of it.
        do_refresh = jax.shard_map(do_refresh, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
    refreshing = count % o.preconditioning_every == 0
    return jax.lax.cond(refreshing, do_refresh, tuple, stacks), refreshing


def precondition_and_graft(
    o: ShampooOptions, plan: Plan, stacks, g_stacks, graft_dirs, stack_sharding
) -> list[jax.Array]:
    """Phase 4, every step: each block's L^(-1/p) G R^(-1/p) (Gupta et al. 2018), rescaled to the
    graft direction's norm -- per parameter as the reference (Anil et al. 2020, sec. 3.4, grafts
    layer-wise), or per block -- as each parameter's Shampoo direction; graft-only parameters keep
    their graft direction. Computed from step 0 so that the Shampoo momentum is warm when it takes
    over at start_preconditioning_step, as the reference's."""
    pre_stacks = [
        jnp.einsum("nij,njk,nkl->nil", st.left_root.astype(jnp.float32), gs, st.right_root.astype(jnp.float32))
        for st, gs in zip(stacks, g_stacks)
    ]
    if o.graft_scope == "parameter":
        owners = [np.array([m[0] for m in members]) for _, members in plan.stacks]  # each block's parameter
        graft_norms = jnp.stack([jnp.linalg.norm(d) for d in graft_dirs]) if graft_dirs else jnp.zeros((0,))
        pre_sq = jnp.zeros((len(graft_dirs),), jnp.float32)
        for idx, pre in zip(owners, pre_stacks):
            pre_sq = pre_sq.at[idx].add(jnp.sum(pre * pre, axis=(1, 2)))
        scales = [graft_norms[idx] / (jnp.sqrt(pre_sq[idx]) + 1e-16) for idx in owners]
    else:
        graft_stacks = place(gather(plan, as_matrices(plan, graft_dirs)), stack_sharding)
        scales = [
            jnp.linalg.norm(gr, axis=(1, 2)) / (jnp.linalg.norm(pre, axis=(1, 2)) + 1e-16)
            for gr, pre in zip(graft_stacks, pre_stacks)
        ]
    out_stacks = [pre * sc[:, None, None] for pre, sc in zip(pre_stacks, scales)]
    return [d if m is None else m.reshape(d.shape) for d, m in zip(graft_dirs, scatter(plan, out_stacks))]


def momentum(o: ShampooOptions, state: ShampooState, graft_dirs, shampoo_dirs, use_shampoo):
    """Phase 5: momentum (EMA or heavy ball, optionally Nesterov) on both directions; the graft's
    is used before start_preconditioning_step, the Shampoo one from it on. Returns the update and
    the two new momentum buffers, as flat lists."""
    w = (1 - o.b1) if o.moving_average_for_momentum else 1.0
    graft_m = [o.b1 * m + w * d for m, d in zip(jax.tree.leaves(state.graft_momentum), graft_dirs)]
    shampoo_m = [o.b1 * m + w * d for m, d in zip(jax.tree.leaves(state.momentum), shampoo_dirs)]
    out = []
    for gm, sm, gd, sd in zip(graft_m, shampoo_m, graft_dirs, shampoo_dirs):
        m, d = jnp.where(use_shampoo, sm, gm), jnp.where(use_shampoo, sd, gd)
        out.append(w * d + o.b1 * m if o.nesterov else m)
    return out, graft_m, shampoo_m


def scale_by_shampoo(
    options: Optional[ShampooOptions] = None,
    *,
    precondition_mask: Optional[Callable[[Any], Any]] = None,
    stack_sharding: Optional[Callable[[tuple[int, ...]], NamedSharding]] = None,
    **changes,
) -> optax.GradientTransformation:
    """The grafted, momentum-averaged Shampoo direction (chain with weight decay and
    optax.scale_by_learning_rate), step for step Google's `distributed_shampoo` as DALL·E Mega
    configured it (tests/optim/test_shampoo_parity.py): statistics from matrix_eps I, grafting per
    parameter, a graft and a Shampoo momentum buffer both updated from step 0 (the Shampoo one
    takes over at start_preconditioning_step), vectors preconditioned with their one statistic.

    `options` (ShampooOptions() by default) with `changes`, by field name or by
    distributed_shampoo's (REFERENCE_NAMES): `scale_by_shampoo(block_size=128, beta1=0.0)`.
    `precondition_mask(params)` gives True where a parameter may be preconditioned (Mega's
    embeddings were too large for it). With `stack_sharding` (the shape of a stacked state array
    -> where it lives; `parallel.stack_sharding` splits the block axis over the mesh) each device
    refreshes the inverse roots of its own blocks."""
    o = dataclasses.replace(options or ShampooOptions(), **{REFERENCE_NAMES.get(k, k): v for k, v in changes.items()})

    def init(params):
        return init_state(o, plan_for(o, params, precondition_mask), params)

    def update(updates, state: ShampooState, params=None):
        del params
        plan = plan_for(o, updates, precondition_mask)
        keys = [key for key, _ in plan.stacks]
        leaves, treedef = jax.tree.flatten(updates)
        grads = [g.astype(jnp.float32) for g in leaves]
        moments = [None] * len(grads) if state.graft is None else jax.tree.leaves(state.graft)
        pairs = [graft_direction(o, g, v, state.count) for g, v in zip(grads, moments)]
        graft_dirs, new_moments = [d for d, _ in pairs], [v for _, v in pairs]
        g_stacks = place(gather(plan, as_matrices(plan, grads)), stack_sharding)
        stacks = accumulate_statistics(o, state.stacks, keys, g_stacks)
        stacks, refreshing = refresh_if_due(o, stacks, keys, state.count, stack_sharding)
        shampoo_dirs = precondition_and_graft(o, plan, stacks, g_stacks, graft_dirs, stack_sharding)
        use_shampoo = state.count >= o.start_preconditioning_step
        out, graft_m, shampoo_m = momentum(o, state, graft_dirs, shampoo_dirs, use_shampoo)
        covered = sum(g.size for g, s in zip(grads, plan.shapes2d) if s is not None)
        share = jnp.where(use_shampoo, covered / max(sum(g.size for g in grads), 1), 0.0).astype(jnp.float32)
        tree = functools.partial(jax.tree.unflatten, treedef)
        new_state = ShampooState(
            state.count + 1,
            None if state.graft is None else tree(new_moments),
            tree(graft_m),
            tree(shampoo_m),
            stacks,
            share,
            state.refreshes + refreshing.astype(jnp.int32),
        )
        return tree([u.astype(x.dtype) for u, x in zip(out, leaves)]), new_state

    return optax.GradientTransformation(init, update)


def shampoo_stats(opt_state) -> dict[str, jax.Array]:
    """Logged every trainer.log_every steps: share of parameter elements preconditioned, share of
    blocks whose root the latest refresh rejected, share of all root refreshes so far rejected,
    and the mean error of the roots in use. Empty when no Shampoo state is present."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ShampooState))
        if isinstance(s, ShampooState)
    ]
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
