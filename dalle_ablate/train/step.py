"""The jitted train and eval steps: the batch's gradient (gradients.py), the optax update, the
gradient scaler's skip of a step that overflowed, and what is logged. Pure functions of (state,
batch); the loop owns the state."""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dalle_ablate.model import token_nll
from dalle_ablate.optim import path_str, shampoo_stats
from dalle_ablate.train.grad_scaling import advance
from dalle_ablate.train.gradients import GradientOptions, Gradients, gradient_path
from dalle_ablate.train.state import TrainState


def image_loss(model: nnx.Module, batch: dict, dropout_key=None) -> tuple[jax.Array, jax.Array]:
    """(sum over examples of weight x mean per-token NLL of the image codes, sum of weights): the
    eval loss, the same quantity in every family."""
    s, w, _ = image_nll(model, batch, dropout_key)
    return s, w


def image_nll(model: nnx.Module, batch: dict, dropout_key=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """image_loss's two sums and each example's mean per-token NLL [B]: what the noise report
    needs to tell the evaluation set's share of a run's noise (report/noise.py)."""
    nll = token_nll(model, batch["text"], batch["text_mask"], batch["codes"], dropout_key).mean(axis=-1)
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll * w), jnp.sum(w), nll


def layer_group(path) -> str:
    """Name of the layer a parameter belongs to: `encoder/3`, `decoder/0`, `text_embed`, ..."""
    parts = path_str(path).split("/")
    if len(parts) > 1 and re.fullmatch(r"\d+", parts[1]):
        return f"{parts[0]}/{parts[1]}"
    return parts[0]


def group_norms(tree) -> dict[str, jax.Array]:
    sq: dict[str, jax.Array] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        g = layer_group(path)
        sq[g] = sq.get(g, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return {g: jnp.sqrt(v) for g, v in sq.items()}


def train_step_core(
    graphdef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    options: GradientOptions,
    placement=None,
) -> Callable:
    """core(state, batch, base_key) -> (state, metrics), not compiled: the batch's gradient along
    the run's gradient path (gradients.py: micro-batch accumulation, PowerSGD, float16 scaling, as
    `options` say), then the optax update. A step's dropout keys are derived from (`base_key`, step,
    micro-batch): a resumed run draws the same masks. `make_train_step` closes it over its run's
    key; benchmarks/members.py maps it over a member axis of states, batches and keys (issue 40)."""
    gradients = gradient_path(graphdef, options, placement)

    def core(state: TrainState, batch: dict, base_key: jax.Array):
        g = gradients(state, batch, jax.random.fold_in(base_key, state.step))
        updates, opt_state = optimizer.update(g.grads, state.opt_state, state.params)
        new = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            compression=g.compression,
        )
        extra = g.metrics
        if options.scaling != "none":
            scaler, skip, scale_metrics = advance(
                options.scaling,
                state.scaler,
                g.grads,
                g.counts,
                nnx.merge(graphdef, state.params),
                options.growth_every,
            )
            # a step that overflowed changes nothing but the scales and the step count
            kept = jax.tree.map(
                lambda n, o: jnp.where(skip, o, n),
                (new.params, new.opt_state, new.compression),
                (state.params, state.opt_state, state.compression),
            )
            new = new.replace(params=kept[0], opt_state=kept[1], compression=kept[2], scaler=scaler)
            extra = {**extra, **scale_metrics}
        return new, train_metrics(g, new, schedule(state.step), extra)

    return core


def dropout_key(seed: int) -> jax.Array:
    """The base of a run's dropout keys, from its seed (a step's keys fold in the step and micro-batch)."""
    return jax.random.fold_in(jax.random.key(seed), 2)


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    options: GradientOptions,
    seed: int = 0,
    placement=None,
) -> Callable:
    """step(state, batch) -> (state, metrics): `train_step_core` with the run's dropout key, from
    its `seed`, compiled. With a `dalle_ablate.parallel.Placement` the step is compiled for its
    mesh: state in and out with the placement's shardings, the batch split over data x fsdp."""
    core = train_step_core(graphdef, optimizer, schedule, options, placement)
    base_key = dropout_key(seed)

    def step(state: TrainState, batch: dict):
        return core(state, batch, base_key)

    if placement is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(
        step,
        in_shardings=(placement.state, placement.batch),
        out_shardings=(placement.state, placement.replicated),
        donate_argnums=0,
    )


def train_metrics(g: Gradients, state: TrainState, lr, extra: dict) -> dict:
    """What one step logs: the losses, gradient and parameter norms (global and per layer), the
    learning rate, Shampoo's statistics and the gradient path's own (`extra`)."""
    return {
        "train/loss": g.loss,
        # each stream's NLL (the eval loss is the image one): families with different
        # objectives compare on train/loss/image
        **{f"train/loss/{name}": v for name, v in g.streams.items()},
        "train/grad_norm": optax.global_norm(g.grads),
        "train/param_norm": optax.global_norm(state.params),
        "train/lr": lr,
        # Per-layer norms cost one reduction over the parameters: negligible next to the
        # forward and backward passes, and fetched to the host only every log_every steps.
        **{f"train/grad_norm/{k}": v for k, v in group_norms(g.grads).items()},
        **{f"train/param_norm/{k}": v for k, v in group_norms(state.params).items()},
        **shampoo_stats(state.opt_state),  # empty unless the optimizer is Shampoo
        **extra,  # PowerSGD's and the gradient scaler's, when on
    }


def make_eval_step(graphdef, placement=None) -> Callable:
    """eval(params, batch) -> (weighted NLL sum, weight sum, each example's NLL); the loss is
    computed in float32."""

    def eval_step(params, batch):
        return image_nll(nnx.merge(graphdef, params), batch)

    if placement is None:
        return jax.jit(eval_step)
    return jax.jit(eval_step, in_shardings=(placement.params, placement.batch), out_shardings=placement.replicated)
