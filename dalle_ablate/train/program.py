"""What trains a job's members, and what varies between a plain run and `seeds=[...]`: the
program. `OneState` is one run's own state, unbatched (a plain run; several processes allowed);
`Stacked` holds the members' states on a leading axis and maps the run's step over it
(member_program.py: `jax.vmap`, or `jax.lax.map`: each member's own program in one loop). Both
give the trainer (loop.py) the same things: the initial state, the step, the batches, the
validation pass and the sampling evaluation of every member at once, and member i's part of
what they return (`member`, `saved`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dalle_ablate.config import RunConfig, data_seed, init_seed
from dalle_ablate.evaluate.runner import MemberEvaluations, evaluation_or_none
from dalle_ablate.generate import make_sampler
from dalle_ablate.model import init_keys, model_from_keys
from dalle_ablate.parallel import init_state
from dalle_ablate.train.assembly import Assembly, assemble
from dalle_ablate.train.hooks import eval_graph, evaluate
from dalle_ablate.train.member_program import (
    MembersState,
    member_placement,
    member_slice,
    members_eval_step,
    members_step,
    over_members,
    stacked,
)
from dalle_ablate.train.step import make_eval_step


def grid_captions(dataset, cfg: RunConfig) -> Optional[tuple[list[str], Any, Any]]:
    """(captions, ids, mask) of the end-of-run sample grid, each caption `per_caption` times; None
    when the data cannot draw (e.g. parquet data without data.codebook_path)."""
    captions = list(cfg.samples.captions or dataset.demo_captions())
    if not captions or not dataset.has_image_decoder():
        return None
    ids, mask = dataset.text.encode([c for c in captions for _ in range(cfg.samples.per_caption)])
    return captions, ids, mask


def grid_sampler(graphdef, model_cfg, cfg: RunConfig, out_sharding=None):
    """sample(params, ids, mask, key) -> codes, as the sample grid draws them."""
    return make_sampler(
        graphdef,
        model_cfg.image_len,
        temperature=cfg.samples.temperature,
        top_k=cfg.samples.top_k,
        out_sharding=out_sharding,
    )


def grid_key(seed: int):
    """The end-of-run sample grid's noise, from the run's seed."""
    return jax.random.fold_in(jax.random.key(seed), 1)


class OneState:
    """One run's own train state, unbatched: the program of a plain run (a job of one member), on
    one process or several (each feeds its own rows of every batch)."""

    def __init__(self, run: Assembly, cfgs: list[RunConfig]):
        (self.cfg,) = cfgs
        self.run, self.placement, self.devices = run, run.placement, run.mesh.size
        self.step = run.train_step()  # (state, global batch) -> (state, metrics)
        self.graph = eval_graph(run)
        self.eval_step = make_eval_step(self.graph, run.placement)

    def init(self, points: list) -> Any:
        """The state the run starts from: its restored checkpoint, else the initial one."""
        return points[0].state if points[0].state is not None else self.run.init_state()

    def batches(self, start: int):
        bs = self.cfg.trainer.batch_size
        return self.run.dataset.train_batches(bs, data_seed(self.cfg), start, *self.placement.host_rows(bs))

    @staticmethod
    def member(tree, i: int):
        """Member i's part of what the program returns: the whole (one member)."""
        return tree

    def saved(self, state, i: int):
        """Member i's train state, as its checkpoint saves it."""
        return state

    def validate(self, params) -> tuple[np.ndarray, np.ndarray]:
        t = self.cfg.trainer
        return evaluate(self.eval_step, params, self.run.dataset, t.batch_size, t.eval_batches, self.placement)

    def evaluation(self, trackers: list) -> Optional[Callable]:
        """evaluate(params, step, {i: run name}) -> {i: result} (evaluate/runner.py), or None
        when nothing is left to evaluate on this data."""
        ev = evaluation_or_none(
            self.cfg, self.run.dataset, self.run.model_cfg, self.graph, trackers[0], self.placement.replicated
        )
        return (
            None if ev is None else lambda params, step, names: {i: ev.run(params, step, n) for i, n in names.items()}
        )

    def grid(self, params, ids, mask):
        """The end-of-run sample grid's codes, drawn with the run's grid key."""
        sampler = grid_sampler(self.run.graphdef, self.run.model_cfg, self.cfg, self.placement.replicated)
        return sampler(params, ids, mask, grid_key(self.cfg.seed))


class MemberBatches:
    """The members' training batches, each from its own seed's data order, stacked: [members, batch, ...]."""

    def __init__(self, run: Assembly, cfgs: list[RunConfig], start: int):
        bs = run.cfg.trainer.batch_size
        self.iters = [run.dataset.train_batches(bs, data_seed(c), start, 0, 1) for c in cfgs]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batches = [next(it) for it in self.iters]
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


class Stacked:
    """The members' train states stacked on a leading member axis (`seeds=[...]`, one process),
    each member's randomness derived from its seed as its separate run derives it: one step, one
    validation pass and one batched sampler for all of them. A member whose loss is not finite
    is frozen on the device (member_program.members_step)."""

    def __init__(self, run: Assembly, placement, cfgs: list[RunConfig], impl: str):
        self.run, self.placement, self.cfgs, self.impl = run, placement, cfgs, impl
        self.devices = placement.mesh.size
        self.step = members_step(run, [c.seed for c in cfgs], impl, placement)
        self.graph = eval_graph(run)
        self.eval_step = members_eval_step(self.graph, impl, placement)

    def init(self, points: list) -> MembersState:
        run = self.run
        states = [
            p.state
            if p.state is not None
            else init_state(
                lambda k: model_from_keys(run.model_cfg, k),
                run.new_state,
                run.placement,
                init_keys(run.model_cfg, init_seed(c)),
            )
            for p, c in zip(points, self.cfgs)
        ]
        return MembersState(
            stacked(states, self.placement), jax.device_put(np.ones(len(states), bool), self.placement.vector)
        )

    def batches(self, start: int) -> MemberBatches:
        return MemberBatches(self.run, self.cfgs, start)

    @staticmethod
    def member(tree, i: int):
        """Member i of a stacked tree: host values indexed, device arrays in its run's layout."""
        return member_slice(tree, i)

    def saved(self, state: MembersState, i: int):
        return member_slice(state.state, i)

    def validate(self, params) -> tuple[np.ndarray, np.ndarray]:
        t = self.cfgs[0].trainer
        return evaluate(self.eval_step, params, self.run.dataset, t.batch_size, t.eval_batches, self.placement.shared)

    def evaluation(self, trackers: list) -> Optional[Callable]:
        """As OneState's: each member's evaluation logged to its tracker, every draw made once for
        all members, each with the noise its separate run draws (evaluate/runner.py MemberEvaluations)."""
        base = evaluation_or_none(
            self.cfgs[0], self.run.dataset, self.run.model_cfg, self.graph, None, self.placement.replicated
        )
        if base is None:
            return None
        evaluations = MemberEvaluations(
            base, trackers, jax.jit(over_members(base.sampler, self.impl, (0, *(None,) * 6)))
        )
        return lambda params, step, names: evaluations.run(
            params, step, {i: (member_slice(params, i), n) for i, n in names.items()}
        )

    def grid(self, params, ids, mask):
        """Every member's sample grid, drawn at once, each with its own grid key: [members, ...]."""
        run = self.run
        sampler = jax.jit(
            over_members(grid_sampler(run.graphdef, run.model_cfg, self.cfgs[0]), self.impl, (0, None, None, 0)),
            out_shardings=self.placement.replicated,
        )
        return sampler(params, ids, mask, jnp.stack([grid_key(c.seed) for c in self.cfgs]))


def program_for(cfg: RunConfig, cfgs: list[RunConfig]) -> OneState | Stacked:
    """The program of a job of `cfg` whose members to train have the configs `cfgs` (each the run
    `seed=k`): `OneState` for a plain run, else `Stacked` (`members.impl`) -- the devices split
    into `mesh.member` groups, each group a member's own run mesh. The mesh and batch are checked
    before any data is read or anything compiles (assembly.py)."""
    if cfg.seeds is None:
        return OneState(assemble(cfg), cfgs)
    devices = jax.devices()
    groups = math.gcd(
        cfg.mesh.member, len(cfgs)
    )  # mesh.member divides the job's members; those left to train it may not
    run = assemble(cfgs[0], devices=devices[: len(devices) // groups])
    return Stacked(run, member_placement(run, devices, groups), cfgs, cfg.members.impl)
