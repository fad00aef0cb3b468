"""The device side of the members' program (program.py `Stacked`): their train states stacked on
a leading member axis, where that axis lives on the devices, and the step, eval step and slices
mapped over it -- `jax.vmap` (one batched program) or `jax.lax.map` (each member's own program in
one loop)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dalle_ablate.parallel import BATCH_AXES, Placement
from dalle_ablate.train.assembly import Assembly
from dalle_ablate.train.state import TrainState
from dalle_ablate.train.step import dropout_key, image_nll, train_step_core


def over_members(fn: Callable, impl: str, in_axes: tuple, mesh: Mesh | None = None) -> Callable:
    """`fn` mapped over a leading member axis of the arguments whose `in_axes` is 0 (the others
    shared): `jax.vmap` (one batched program), or `jax.lax.map` (`fn`'s own program per member).
    On a `mesh` whose member axis splits the members, each group of devices maps over its own."""
    if impl == "vmap":
        mapped = jax.vmap(fn, in_axes=in_axes)
    else:

        def mapped(*args):
            over = tuple(a for a, ax in zip(args, in_axes) if ax == 0)

            def one(xs):
                it = iter(xs)
                return fn(*(next(it) if ax == 0 else a for a, ax in zip(args, in_axes)))

            return jax.lax.map(one, over)

    if mesh is None or mesh.shape["member"] == 1:
        return mapped
    # The groups exchange nothing, so each runs its members in a program of its own (the mesh's
    # other axes left to the partitioner). Handed the map whole, the partitioner gathered the
    # members: 4 on 2 CPU devices took 1.8x one device's time (docs/results/benchmarks/step-levers.md).
    specs = tuple(P("member") if ax == 0 else P() for ax in in_axes)
    return jax.shard_map(
        mapped, mesh=mesh, in_specs=specs, out_specs=P("member"), axis_names=frozenset({"member"}), check_vma=False
    )


@struct.dataclass
class MembersState:
    """The members' train states stacked on a leading axis, and which are still training."""

    state: TrainState
    alive: jax.Array  # bool [members]: False once a member's loss was not finite (its state frozen there)

    @property
    def step(self) -> jax.Array:
        """The job's step: its live members' (a frozen member stopped earlier)."""
        return jnp.max(self.state.step)

    @property
    def params(self):
        """The members' parameters, stacked (what the validation and the evaluation read)."""
        return self.state.params


@dataclass(frozen=True)
class MemberPlacement:
    """Where the stacked state lives: a mesh ("member", data, fsdp, model) whose member axis splits
    the members over `mesh.member` groups of devices, each group the member's own run's mesh."""

    mesh: Mesh
    state: Any  # the run's state shardings with the member axis in front
    vector: NamedSharding  # [members]: keys, alive
    replicated: NamedSharding
    shared: Placement  # a batch all members read (validation), split over data x fsdp in every group

    @property
    def batch(self) -> NamedSharding:
        return NamedSharding(self.mesh, P("member", BATCH_AXES))

    @property
    def params(self):
        return self.state.params

    def global_batch(self, local: dict, batch_size: int) -> dict:
        """The members' batches [members, batch, ...] -> arrays on the mesh: one process holds every
        row (multi-process members are refused), so `batch_size` needs no checking against it."""
        return jax.device_put({k: np.asarray(v) for k, v in local.items()}, self.batch)


def member_placement(run: Assembly, devices: list, groups: int) -> MemberPlacement:
    """The members' shardings on `devices` split into `groups` (outermost: members exchange nothing),
    each group shaped like `run`'s own mesh; the run's specs, computed for its mesh, keep their
    meaning (they name the axes, not the devices)."""
    inner = run.mesh
    mesh = Mesh(np.asarray(devices).reshape(groups, *inner.devices.shape), ("member", *inner.axis_names))
    state = jax.tree.map(lambda s: NamedSharding(mesh, P("member", *s.spec)), run.placement.state)
    replicated = NamedSharding(mesh, P())
    shared = Placement(mesh, None, None, NamedSharding(mesh, P(BATCH_AXES)), replicated)
    return MemberPlacement(mesh, state, NamedSharding(mesh, P("member")), replicated, shared)


def member_slice(tree, i: int):
    """Member `i` of a stacked tree (what its checkpoint saves, what its evaluation reads), each
    leaf laid out as its run lays it out: the run's spec on the members' mesh, each device holding
    its run's share of the member. Not `x[i]`: on a mesh, that is a whole, unsplit copy of the
    member on every device (P()), a member too big for one device failing at its first save.

    One program for the whole tree, finished before it returns: on 8 fake CPU devices under load,
    one small program per leaf, each with a collective and all in flight at once, was seen to
    deadlock (one device's thread never joining an all-gather; XLA aborts after 40 s)."""
    leaves, treedef = jax.tree.flatten(tree)
    inner = tuple(
        NamedSharding(x.sharding.mesh, P(*x.sharding.spec[1:]))
        if isinstance(getattr(x, "sharding", None), NamedSharding)
        and x.sharding.spec
        and x.sharding.spec[0] == "member"
        else None
        for x in leaves
    )
    if not leaves or None in inner:  # not a members' stack (host arrays): plain indexing
        return jax.tree.map(lambda x: x[i], tree)
    return jax.tree.unflatten(treedef, jax.block_until_ready(_slicer(inner)(leaves, i)))


@functools.lru_cache(maxsize=None)
def _slicer(inner: tuple) -> Callable:
    """The compiled slice of one member out of stacked leaves laid out as `inner` (one per layout)."""
    return jax.jit(lambda xs, j: [jax.lax.dynamic_index_in_dim(x, j, 0, False) for x in xs], out_shardings=list(inner))


def members_step(run: Assembly, seeds: list[int], impl: str, mp: MemberPlacement) -> Callable:
    """step(MembersState, batches) -> (MembersState, metrics [members]): the run's step core over
    the members, each with its own dropout key; a member whose loss is not finite keeps its state."""
    core = train_step_core(run.graphdef, run.optimizer, run.schedule, run.gradient_options)
    over = over_members(core, impl, (0, 0, 0), mp.mesh)
    keys = jnp.stack([dropout_key(s) for s in seeds])  # each run's, as make_train_step derives it

    def step(ms: MembersState, batch: dict, keys):
        new, metrics = over(ms.state, batch, keys)
        ok = ms.alive & jnp.isfinite(metrics["train/loss"])
        kept = jax.tree.map(lambda n, o: jnp.where(ok.reshape(ok.shape + (1,) * (n.ndim - 1)), n, o), new, ms.state)
        return MembersState(kept, ok), metrics

    shardings = MembersState(mp.state, mp.vector)
    jitted = jax.jit(
        step, in_shardings=(shardings, mp.batch, mp.vector), out_shardings=(shardings, mp.replicated), donate_argnums=0
    )
    return lambda ms, batch: jitted(ms, batch, keys)


def members_eval_step(graphdef, impl: str, mp: MemberPlacement) -> Callable:
    """eval(stacked params, batch) -> (weighted NLL sums, weight sums) [members] and each example's
    NLL [members, batch], the batch shared."""
    over = over_members(lambda params, batch: image_nll(nnx.merge(graphdef, params), batch), impl, (0, None), mp.mesh)
    return jax.jit(over, in_shardings=(mp.params, mp.shared.batch), out_shardings=mp.replicated)


def stacked(states: list, mp: MemberPlacement):
    """Per-member states -> one state with a leading member axis, in the members' shards."""
    return jax.device_put(jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *states), mp.state)
