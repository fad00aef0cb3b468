"""Where every array lives: the device mesh, parameters and optimizer state by logical-axis
rules, the batch over data x fsdp. XLA's SPMD partitioner inserts the communication; nothing
here moves data by hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dalle_ablate.parallel.mesh import AXES, BATCH_AXES, build_mesh, check_batch, mesh_shape, pad_vocab_for_mesh
from dalle_ablate.parallel.rules import LOGICAL_RULES, layout_specs, param_specs, stack_sharding, state_specs


@dataclass(frozen=True)
class Placement:
    """Shardings of one run: `state` is a tree of NamedShardings shaped like the train state."""

    mesh: Mesh
    params: Any
    state: Any
    batch: NamedSharding
    replicated: NamedSharding

    @property
    def micro_batch(self) -> NamedSharding:
        """[grad_accum, micro-batch, ...]: the scan axis whole, each micro-batch split."""
        return NamedSharding(self.mesh, P(None, BATCH_AXES))

    def host_rows(self, batch_size: int) -> tuple[int, int]:
        """(index, count): this process feeds rows [index * b / count, (index + 1) * b / count)
        of every global batch of b. Processes whose devices hold the same rows (the batch is not
        split over the model axis) read the same share."""
        spans = {
            (s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
            for s in self.batch.addressable_devices_indices_map((batch_size,)).values()
        }
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        covered = sum(b - a for a, b in spans)
        if covered != hi - lo or batch_size % (hi - lo) or lo % (hi - lo):
            raise ValueError(
                f"this process's devices hold rows {sorted(spans)} of a batch of {batch_size}: not one block"
            )
        return lo // (hi - lo), batch_size // (hi - lo)

    def global_batch(self, local: dict, batch_size: int) -> dict:
        """This process's rows of a batch (numpy) -> global arrays sharded over data x fsdp."""
        return {
            k: jax.make_array_from_process_local_data(self.batch, np.asarray(v), (batch_size, *np.shape(v)[1:]))
            for k, v in local.items()
        }


def make_placement(mesh: Mesh, abstract_model: nnx.Module, new_state: Callable) -> Placement:
    """Shardings for parameters (by the rules) and the train state `new_state(params)` (each
    leaf like its parameter where it has one's shape, `state_specs`), from abstract shapes only."""
    _, pspecs, _, sspecs = layout_specs(abstract_model, new_state, dict(mesh.shape))

    def named(tree):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, P))

    return Placement(mesh, named(pspecs), named(sspecs), NamedSharding(mesh, P(BATCH_AXES)), NamedSharding(mesh, P()))


def over_data(fn, mesh: Mesh, in_split, out_split):
    """`fn` run once per data-parallel worker (`shard_map` over `data`, where `fn` may `psum` over
    "data"): each argument and output flagged True in `in_split` / `out_split` (prefix trees of
    bools) is split along its leading axis over `data` (the batch, per-worker state), the others
    replicated. Only on meshes whose fsdp and model axes are 1."""
    if mesh.shape["fsdp"] != 1 or mesh.shape["model"] != 1:
        raise ValueError(f"over_data needs a data-only mesh, got {dict(mesh.shape)}")

    def specs(split):
        return jax.tree.map(lambda s: P("data") if s else P(), split)

    return jax.shard_map(fn, mesh=mesh, in_specs=specs(in_split), out_specs=specs(out_split))


def _initialiser(graph_fn, new_state):
    def init(*args):
        return new_state(nnx.to_pure_dict(nnx.split(graph_fn(*args), nnx.Param)[1]))

    return init


def init_state(graph_fn, new_state, placement: Placement, *args):
    """The initial train state `new_state(params)`, created directly in its shards (never whole on
    one device): `graph_fn(*args)` builds the model inside the jitted initialiser. What differs
    between runs of one shape -- their init keys (model.init_keys) -- goes in as `args`, so that
    the initialiser is one program for all of them."""
    return jax.jit(_initialiser(graph_fn, new_state), out_shardings=placement.state)(*args)


def abstract_state(graph_fn, new_state, placement: Placement):
    """The train state's shapes, dtypes and shardings, nothing allocated: a restore target."""
    shapes = jax.eval_shape(_initialiser(graph_fn, new_state))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, placement.state)


__all__ = [
    "AXES",
    "BATCH_AXES",
    "LOGICAL_RULES",
    "Placement",
    "abstract_state",
    "build_mesh",
    "check_batch",
    "init_state",
    "layout_specs",
    "make_placement",
    "mesh_shape",
    "over_data",
    "pad_vocab_for_mesh",
    "param_specs",
    "stack_sharding",
    "state_specs",
]
