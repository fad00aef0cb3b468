"""The jitted train and eval steps: loss, gradients (with micro-batch accumulation), optax update,
and the norms that are logged. Pure functions of (state, batch, rng); the loop owns the state."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from dalle_ablate.model import stream_nll, token_nll
from dalle_ablate.optim import PowerSGDState, path_str, powersgd_mean, shampoo_stats, traffic
from dalle_ablate.parallel import over_data
from dalle_ablate.train.grad_scaling import advance, block_scales, probes, unscale


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # pure dict of float32 master weights
    opt_state: Any


def image_loss(model: nnx.Module, batch: dict, dropout_key=None) -> tuple[jax.Array, jax.Array]:
    """(sum over examples of weight x mean per-token NLL of the image codes, sum of weights): the
    eval loss, the same quantity in every family."""
    nll = token_nll(model, batch["text"], batch["text_mask"], batch["codes"], dropout_key)
    w = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll.mean(axis=-1) * w), jnp.sum(w)


def objective(model: nnx.Module, batch: dict, dropout_key=None, grad_scales=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training objective summed over examples (weight x the family's `loss_weights()` mix
    of each stream's mean per-token NLL; DALL·E normalises text and image separately, arXiv
    2102.12092 section 2.2), and each stream's weighted NLL sum, for logging. `grad_scales`:
    per-resblock gradient scaling ({stack: BlockScale}, model/grad_scale.py)."""
    nll = stream_nll(model, batch["text"], batch["text_mask"], batch["codes"], dropout_key, grad_scales)
    w = batch["weights"].astype(jnp.float32)
    sums = {name: jnp.sum(v.mean(axis=-1) * w) for name, v in nll.items()}
    weights = model.cfg.loss_weights()
    return sum(weights[name] * s for name, s in sums.items()), sums


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


def make_train_step(
    graphdef, optimizer: optax.GradientTransformation, schedule: optax.Schedule, grad_accum: int, seed: int = 0,
    placement=None, powersgd=None, log_every: int = 1, grad_scaling: str = "none", growth_every: int = 500,
) -> Callable:
    """step(state, batch) -> (state, metrics). The batch is split into grad_accum micro-batches
    scanned in one compiled step, so memory holds one micro-batch of activations. Dropout keys
    are derived from (seed, step, micro-batch): a resumed run draws the same masks. With a
    `dalle_ablate.parallel.Placement` the step is compiled for its mesh: state in and out with
    the placement's shardings, the batch split over data x fsdp. With `powersgd` (an
    optim.powersgd config whose rank is set) each data-parallel worker computes its own gradient
    under `shard_map` and the workers exchange only PowerSGD's factors (optim/powersgd.py); its
    exact relative error, which costs a full all-reduce, is measured on the steps the logger
    fetches (every `log_every`). With `grad_scaling` `global` or `per_block` (grad_scaling.py;
    the optimizer then carries the scaler's state) gradients are scaled for float16 and a step
    that overflows is skipped."""
    base_key = jax.random.fold_in(jax.random.key(seed), 2)
    scaling = grad_scaling != "none"

    def loss_fn(params, probe_values, micro, total_weight, key, scaler):
        scales = block_scales(scaler, probe_values) if grad_scaling == "per_block" else None
        total, streams = objective(nnx.merge(graphdef, params), micro, key, scales)
        loss = total / total_weight
        return loss * (scaler.scale if grad_scaling == "global" else 1.0), (loss, {n: v / total_weight for n, v in streams.items()})

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def gradients(params, batch, total_weight, step_key, micro_sharding, scaler, varying=None):
        """((loss, stream losses), gradients as scaled, the probes' counts) of this batch,
        micro-batches accumulated. `varying`: the shard_map axis the results vary over, if any."""
        zero_probes = probes(scaler) if grad_scaling == "per_block" else None

        def one(mb, key):
            (_, aux), (grads, counts) = grad_fn(params, zero_probes, mb, total_weight, key, scaler)
            return aux, grads, counts

        if grad_accum == 1:
            return one(batch, step_key)
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)
        if micro_sharding is not None:  # each micro-batch split over data x fsdp, not the scan axis
            micro = jax.lax.with_sharding_constraint(micro, micro_sharding)

        def body(carry, xs):
            i, mb = xs
            return jax.tree.map(jnp.add, carry, one(mb, jax.random.fold_in(step_key, i))), None

        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(lambda: one(first, step_key)))
        if varying is not None:  # the carry has the per-worker type of what is added to it
            zeros = jax.lax.pcast(zeros, varying, to="varying")
        return jax.lax.scan(body, zeros, (jnp.arange(grad_accum), micro))[0]

    def unscaled(params, grads, scaler):
        return unscale(grad_scaling, grads, scaler, nnx.merge(graphdef, params)) if scaling else grads

    compressed = None
    if powersgd is not None:
        if placement is None:
            raise ValueError("PowerSGD needs the run's mesh: pass its placement")
        workers = placement.mesh.shape["data"]

        def local(params, batch, psgd, total_weight, step_key, measure, scaler):
            # this worker's rows; its own dropout masks
            key = jax.random.fold_in(step_key, jax.lax.axis_index("data"))
            # Parameters (and the scales, whose probes count per worker) marked device-varying:
            # the gradient of a replicated input would be summed over `data` by shard_map's
            # transpose, the full all-reduce PowerSGD replaces.
            params, scaler = jax.lax.pcast((params, scaler), "data", to="varying")
            (loss, streams), grads, counts = gradients(params, batch, total_weight, key, None, scaler, "data")
            grads, psgd, stats = powersgd_mean(unscaled(params, grads, scaler), psgd, powersgd.exclude, "data", workers, measure)
            return jax.lax.psum((loss, streams, counts), "data"), grads, psgd, stats

        # replicated: parameters, weight, key, scaler, losses, the mean gradient, Q, stats;
        # split: the batch and each worker's residuals
        psgd_split = PowerSGDState(q=False, error=True)
        compressed = over_data(local, placement.mesh, in_split=(False, True, psgd_split, False, False, False, False),
                               out_split=(False, False, psgd_split, False))

    def step(state: TrainState, batch: dict):
        total_weight = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        step_key = jax.random.fold_in(base_key, state.step)
        scaler, opt_state = state.opt_state if scaling else (None, state.opt_state)
        before, extra = opt_state, {}
        if compressed is None:
            (loss, streams), grads, counts = gradients(state.params, batch, total_weight, step_key,
                                                       None if placement is None else placement.micro_batch, scaler)
            grads = unscaled(state.params, grads, scaler)
        else:
            psgd, inner = opt_state
            logged = (state.step + 1) % log_every == 0  # the step the logger fetches in full (train/loop.py)
            (loss, streams, counts), grads, psgd, stats = compressed(state.params, batch, psgd, total_weight, step_key, logged,
                                                                     scaler)
            opt_state = (psgd, inner)
            floats = traffic(state.params, powersgd.rank, powersgd.exclude)
            extra = {"comm/powersgd_rel_error": stats["rel_error"], "comm/compression": jnp.float32(floats["full"] / floats["sent"]),
                    "comm/bytes_per_step": jnp.float32(4 * floats["sent"])}
        if scaling:
            scaler, skip, scale_metrics = advance(grad_scaling, scaler, grads, counts, nnx.merge(graphdef, state.params), growth_every)
            updates, (_, opt_state) = optimizer.update(grads, (scaler, opt_state), state.params)
            # a step that overflowed changes nothing but the scales
            keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(skip, old, new))
            params, opt_state = keep(optax.apply_updates(state.params, updates), state.params), keep(opt_state, before)
            opt_state, extra = (scaler, opt_state), {**extra, **scale_metrics}
        else:
            updates, opt_state = optimizer.update(grads, opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = {
            "train/loss": loss,
            # each stream's NLL (the eval loss is the image one): families with different
            # objectives compare on train/loss/image
            **{f"train/loss/{name}": v for name, v in streams.items()},
            "train/grad_norm": optax.global_norm(grads),
            "train/param_norm": optax.global_norm(params),
            "train/lr": schedule(state.step),
            # Per-layer norms cost one reduction over the parameters: negligible next to the
            # forward and backward passes, and fetched to the host only every log_every steps.
            **{f"train/grad_norm/{g}": v for g, v in group_norms(grads).items()},
            **{f"train/param_norm/{g}": v for g, v in group_norms(params).items()},
            **shampoo_stats(opt_state),  # empty unless the optimizer is Shampoo
            **extra,  # PowerSGD's and the gradient scaler's, when on
        }
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    if placement is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(step, in_shardings=(placement.state, placement.batch), out_shardings=(placement.state, placement.replicated),
                   donate_argnums=0)


def make_eval_step(graphdef, placement=None) -> Callable:
    """eval(params, batch) -> (weighted NLL sum, weight sum); the loss is computed in float32."""

    def eval_step(params, batch):
        return image_loss(nnx.merge(graphdef, params), batch)

    if placement is None:
        return jax.jit(eval_step)
    return jax.jit(eval_step, in_shardings=(placement.params, placement.batch), out_shardings=placement.replicated)
