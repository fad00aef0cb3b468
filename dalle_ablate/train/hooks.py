"""Periodic work between train steps, as hooks: `hooks.add(name, fn, every=N)` runs `fn(step,
state)` after every N-th step and after the last (N = 0: the last only), in the order added; a
hook that returns a reason (a string) stops the run there. The job's own hooks (`periodic_hooks`,
the same for a plain run and for a job of several members): the validation loss, the checkpoint,
the sampling evaluation and the caller's `should_stop`. A new periodic action is one `add`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx

from dalle_ablate import interrupts
from dalle_ablate.data.base import host_share
from dalle_ablate.model import abstract_model
from dalle_ablate.parallel import Placement


@dataclass
class Hook:
    name: str
    fn: Callable[[int, Any], Optional[str]]  # (step, state) -> None, or why the run stops here
    every: int  # 0: only at the last step


class Hooks:
    def __init__(self, last_step: int):
        self.last_step, self.hooks = last_step, []

    def add(self, name: str, fn: Callable[[int, Any], Optional[str]], every: int) -> None:
        if any(h.name == name for h in self.hooks):
            raise ValueError(f"a hook named {name!r} is already registered")
        self.hooks.append(Hook(name, fn, every))

    def due(self, step: int) -> tuple[str, ...]:
        """The names of the hooks due after `step`, in the order they run."""
        return tuple(h.name for h in self.hooks if step == self.last_step or (h.every and step % h.every == 0))

    def run(self, step: int, state, names: tuple[str, ...]) -> Optional[str]:
        """Run the named hooks at `step`; why the run stops here if one of them says so."""
        stop = None
        for h in self.hooks:
            if h.name in names:
                stop = h.fn(step, state) or stop
        return stop


def evaluate(
    eval_step, params, dataset, batch_size: int, max_batches: Optional[int], placement: Placement
) -> tuple[np.ndarray, np.ndarray]:
    """(weighted mean NLL over the valid split, summed in float64; each example's NLL, in the
    split's order, the padding of the last batch dropped). Every host reads the same eval batches
    and feeds its own rows of each. An eval step over the members of a job (program.py) returns
    one sum and one row of examples per member, and so does this."""
    total, weight, examples = np.float64(0.0), np.float64(0.0), []
    rows = host_share(np.arange(batch_size), *placement.host_rows(batch_size))
    for batch in dataset.eval_batches(batch_size, max_batches):
        interrupts.check("during the validation")
        s, w, nll = jax.device_get(
            eval_step(params, placement.global_batch({k: v[rows] for k, v in batch.items()}, batch_size))
        )
        total, weight = total + np.asarray(s, np.float64), weight + np.asarray(w, np.float64)
        examples.append(np.asarray(nll)[..., batch["weights"] > 0])
    return total / np.maximum(weight, 1.0), np.concatenate(examples, -1)


def log_examples(tracker, values: np.ndarray, step: int) -> None:
    """Each valid example's NLL at this validation, as a table (`eval/valid/examples`): the
    evaluation set's share of a run's noise is read from them (report/noise.py)."""
    tracker.log_table("eval/valid/examples", ["example", "loss"], [[i, float(v)] for i, v in enumerate(values)], step)


def eval_graph(run):
    """The graph evaluation runs: float32 whatever the training compute dtype -- the same
    parameters merged into the float32 variant of the model (the dtype lives in the graph, not
    the weights)."""
    model_cfg = run.model_cfg
    if model_cfg.dtype == "float32":
        return run.graphdef
    return nnx.split(abstract_model(dataclasses.replace(model_cfg, dtype="float32")), nnx.Param)[0]


def periodic_hooks(cfg, program, members: list, caller) -> Hooks:
    """The job's periodic work for each of its running `members` (train/records.py Member; a plain
    run has one): the validation loss every `trainer.eval_every` (one pass for all of them), a
    checkpoint every `trainer.save_every` (each in its own store), the sampling evaluation every
    `eval.every` (0: the last step only; none without evaluation metrics), then the caller's
    `should_stop` (RunHooks) after each validation loss. `program` (train/program.py) computes
    them and gives each member's part."""
    t = cfg.trainer
    hooks = Hooks(t.steps)
    evaluation = program.evaluation([m.tracker for m in members])

    def due(step: int, name: str) -> list:
        """The running members, less those whose earlier process finished `name` at this step."""
        return [m for m in members if m.status == "running" and not m.done_at(step, name)]

    def validation(step, state):
        losses, examples = program.validate(state.params)
        for m in due(step, "validation"):
            m.seen.eval_loss = float(program.member(losses, m.index))
            m.tracker.log(
                {
                    "eval/valid/loss": m.seen.eval_loss,
                    "samples": step * t.batch_size,
                    "tokens": step * program.run.tokens_per_step,
                },
                step,
            )
            log_examples(m.tracker, program.member(examples, m.index), step)

    def save(step, state):  # before the sampling evaluation: a failure there never costs a checkpoint
        for m in due(step, "checkpoint"):
            m.ckpt.save(step, program.saved(state, m.index))
            m.tracker.log_summary({"wall_time": time.perf_counter() - m.t_start, "steps": step})

    def sample(step, state):  # guidance-scale sweep, caption sensitivity, grids (evaluate/runner.py)
        todo = due(step, "evaluation")
        out = evaluation(state.params, step, {m.index: m.name for m in todo})
        for m in todo:
            m.seen.last_eval = out[m.index]
            m.tracker.log_summary({"evaluated_step": step})  # complete: a resume at this step need not redo it

    def should_stop(step, state):
        running = [m for m in members if m.status == "running"]
        eval_loss = float(np.mean([m.seen.eval_loss for m in running]))  # one member: its own
        if step == t.steps or jax.process_index() != 0 or not caller.should_stop(eval_loss, step):
            return None
        for m in running:  # a stopped run can be resumed (nothing is written if this step is saved)
            m.ckpt.save(step, program.saved(state, m.index))
        return f"eval loss {eval_loss:.4f}"

    hooks.add("validation", validation, t.eval_every)
    hooks.add("checkpoint", save, t.save_every)
    if evaluation is not None:
        hooks.add("evaluation", sample, cfg.eval.every or 0)
    hooks.add("should_stop", should_stop, t.eval_every)
    return hooks


def left_at(hooks: Hooks, step: int, done: dict[str, bool]) -> tuple[str, ...]:
    """The hooks due at `step` (the checkpoint a run store continues from) that the process which
    saved it did not finish, e.g. the final evaluation a Ctrl-C cut off; `done`: whether each
    evaluation was (hooks it does not name need no redoing: a checkpoint is never redone)."""
    return tuple(name for name in hooks.due(step) if not done.get(name, True))
