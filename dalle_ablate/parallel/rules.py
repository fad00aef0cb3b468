"""Logical-axis rules: each parameter's logical axes (set where the layer is defined) become a
PartitionSpec over the mesh, and the optimizer state is laid out like the parameters.

`embed` goes to `fsdp` (parameters sharded as in ZeRO-3, gathered per layer by XLA), `heads`,
`mlp` and `vocab` to `model` (the Megatron split: column-parallel in, row-parallel out, arXiv
1909.08053), `pos` stays replicated. Only this package builds a PartitionSpec.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dalle_ablate.optim import PowerSGDState, path_str
from dalle_ablate.optim.scale_by_shampoo import StackState
from dalle_ablate.registry import ConfigError

# logical axis -> mesh axis (or None: replicated along it)
LOGICAL_RULES: dict[str, Optional[str]] = {
    "vocab": "model",
    "embed": "fsdp",
    "heads": "model",
    "mlp": "model",
    "pos": None,
}


def _is_spec(x) -> bool:
    return isinstance(x, P)


def spec_for(name: str, logical: P, shape: tuple[int, ...], mesh_sizes: dict[str, int]) -> P:
    """The mesh PartitionSpec of one parameter. A mesh axis is used once per parameter (the first
    logical axis that maps to it keeps it); a dimension must divide evenly by its mesh axis."""
    if len(logical) != len(shape):
        raise ConfigError(
            f"parameter {name} {tuple(shape)} has logical axes {tuple(logical)}; every dimension needs one "
            f"(one of {', '.join(sorted(LOGICAL_RULES))} or None)"
        )
    used: set[str] = set()
    out = []
    for axis, dim in zip(logical, shape):
        if axis is not None and axis not in LOGICAL_RULES:
            raise ConfigError(
                f"parameter {name}: logical axis {axis!r} matches no rule; rules: "
                + ", ".join(f"{k}->{v}" for k, v in LOGICAL_RULES.items())
            )
        mesh_axis = LOGICAL_RULES.get(axis) if axis is not None else None
        if mesh_axis is None or mesh_axis in used or mesh_sizes.get(mesh_axis, 1) == 1:
            out.append(None)
            continue
        if dim % mesh_sizes[mesh_axis]:
            raise ConfigError(
                f"parameter {name} {tuple(shape)}: its {axis!r} dimension {dim} is not divisible by "
                f"mesh.{mesh_axis}={mesh_sizes[mesh_axis]}"
            )
        used.add(mesh_axis)
        out.append(mesh_axis)
    return P(*out)


def param_specs(logical_specs, shapes, mesh_sizes: dict[str, int]):
    """Tree of mesh PartitionSpecs for a tree of parameters. `logical_specs` is what
    `nnx.get_partition_spec` gives (PartitionSpecs of logical names); `shapes` the parameters or
    their ShapeDtypeStructs."""
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_logical, treedef = jax.tree_util.tree_flatten(logical_specs, is_leaf=lambda x: _is_spec(x) or x is None)
    specs = []
    for (path, x), logical in zip(flat_shapes, flat_logical):
        specs.append(spec_for(path_str(path), logical if logical is not None else P(), tuple(x.shape), mesh_sizes))
    return jax.tree_util.tree_unflatten(treedef, specs)


def stack_spec(n: int, ndim: int, mesh_sizes: dict[str, int]) -> P:
    """Where a stacked Shampoo state array ([n, b, b] statistics and roots, [n] errors and failure
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


def stack_sharding(mesh: Optional[Mesh]) -> Optional[Callable[[tuple[int, ...]], NamedSharding]]:
    """What `scale_by_shampoo(stack_sharding=...)` needs: a stacked array's shape -> its
    NamedSharding on this mesh; None on one device (nothing to place)."""
    if mesh is None or mesh.size == 1:
        return None
    return lambda shape: NamedSharding(mesh, stack_spec(int(shape[0]), len(shape), dict(mesh.shape)))


def state_specs(state, params, specs, mesh_sizes: dict[str, int]):
    """PartitionSpecs for a train or optax state: a leaf that sits under a copy of the parameter
    tree (the parameters themselves, Adam's moments, Shampoo's graft and momentum) and has its
    parameter's shape gets the parameter's spec; Shampoo's stacked statistics follow
    `stack_spec`; PowerSGD's residuals are split over `data`, one per worker; everything else
    (counts, Adafactor's factored rows and columns, the gradient scaler, scalars) is replicated."""
    by_path: dict[tuple, tuple[tuple[int, ...], P]] = {}
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=_is_spec)
    for (path, p), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_specs):
        by_path[tuple(str(k) for k in path)] = (tuple(p.shape), spec)
    depths = sorted({len(k) for k in by_path}, reverse=True)  # the longest matching suffix wins

    def leaf_spec(path, x) -> Any:
        if isinstance(x, StackState):
            return StackState(*(stack_spec(int(v.shape[0]), v.ndim, mesh_sizes) for v in x))
        if isinstance(x, PowerSGDState):
            return PowerSGDState(
                q=jax.tree.map(lambda _: P(), x.q),
                error=jax.tree.map(lambda v: P("data", *([None] * (v.ndim - 1))), x.error),
            )
        keys = tuple(str(k) for k in path)
        for d in depths:
            hit = by_path.get(keys[-d:]) if len(keys) >= d else None
            if hit is not None and hit[0] == tuple(x.shape):
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(
        leaf_spec, state, is_leaf=lambda x: isinstance(x, (StackState, PowerSGDState))
    )


def layout_specs(abstract_model, new_state, mesh_sizes: dict[str, int]):
    """(parameter shapes, their specs, the train state's shapes, their specs) for a mesh of these
    sizes, from abstract shapes only: what training places and what `plan` counts. `new_state`:
    params -> the train state (the parameters in it get their own specs, by path)."""
    state = nnx.state(abstract_model, nnx.Param)
    shapes = nnx.to_pure_dict(state)
    pspecs = param_specs(nnx.to_pure_dict(nnx.get_partition_spec(state)), shapes, mesh_sizes)
    state_shapes = jax.eval_shape(new_state, shapes)
    return shapes, pspecs, state_shapes, state_specs(state_shapes, shapes, pspecs, mesh_sizes)
