"""Distributed Shampoo's static plan (optim/scale_by_shampoo.py): how each parameter is reshaped to
at most 2-D (unit dims dropped, small dims merged as distributed_shampoo's `merge_small_dims`
does), cut into blocks of at most `block_size`, and how blocks of equal shape from all parameters
are stacked into one [n, b1, b2] array -- and back. Decided once from the shapes, before any step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

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


def make_plan(
    shapes: list[tuple[int, ...]],
    precondition: list[bool],
    block_size: int,
    skip_dim_gt: int,
    precondition_1d: bool = True,
    merge_max: int = MERGE_SMALL_DIMS,
) -> Plan:
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
