"""The gradient path of one train step, stage by stage, each one function:

1. `differentiate`: the objective's gradient on one micro-batch -- with the loss (global) or each
   residual branch (per_block) scaled for float16 when `trainer.grad_scaling` is on;
2. `accumulate`: summed over `trainer.grad_accum` micro-batches scanned in one compiled step, so
   memory holds one micro-batch of activations;
3. `whole` or `compressed`: the batch's gradient, unscaled -- all-reduced whole by XLA, or, under
   `optim.powersgd.rank`, computed per data-parallel worker and averaged through PowerSGD's low-rank
   factors (optim/powersgd.py).

`gradient_path` composes the stages a run's config turns on (`GradientOptions.of(cfg)`: what the
config says about them); the train step (step.py) sees only its result. A new stage is one
function here, its option's field in `GradientOptions` (read in `of`) and one line in
`gradient_path`; nothing else passes it along. A stage from outside the package (a study's own
measurement, a test) registers itself with `@gradient_stage` and runs after these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from dalle_ablate.model import stream_nll
from dalle_ablate.optim import PowerSGDState, powersgd_mean, traffic
from dalle_ablate.parallel import over_data
from dalle_ablate.registry import Registry
from dalle_ablate.train.grad_scaling import block_scales, probes, unscale


@dataclass(frozen=True)
class GradientOptions:
    """What a run's config says about its gradient path, built from it by `of(cfg)`: no defaults
    of its own."""

    grad_accum: int  # trainer.grad_accum micro-batches
    scaling: str  # trainer.grad_scaling: none | global | per_block
    growth_every: int  # trainer.grad_scale_growth_every
    powersgd: Any  # optim.powersgd when its rank is set, else None
    log_every: int  # trainer.log_every: PowerSGD measures its error on logged steps only
    added: tuple = ()  # ((name, setting), ...): the registered stages (`gradient_stage`) the config turns on

    @classmethod
    def of(cls, cfg) -> "GradientOptions":
        t, powersgd = cfg.trainer, cfg.optim.powersgd
        added = tuple((name, on) for name in STAGES.names() if (on := STAGES.get(name)[0](cfg)) is not None)
        return cls(
            t.grad_accum,
            t.grad_scaling,
            t.grad_scale_growth_every,
            powersgd if powersgd.rank is not None else None,
            t.log_every,
            added,
        )


# Stages registered from outside this module: name -> (setting(cfg) -> the stage's setting for a
# run, or None where its config leaves the stage off; stage(path, setting) -> path).
STAGES: Registry = Registry("gradient stage", "gradient path")


def gradient_stage(name: str, setting: Callable[[Any], Any]) -> Callable:
    """Decorator: `stage(path, setting) -> path`, with path(state, batch, total_weight, key) ->
    Gradients, as the gradient stage `name`: on in a run whose config gives a `setting(cfg)`
    other than None, after the built-in stages, in the order of their names."""

    def register(stage: Callable) -> Callable:
        STAGES.register(name, (setting, stage))
        return stage

    return register


class Gradients(NamedTuple):
    loss: jax.Array  # the objective, as logged (never scaled)
    streams: dict  # each stream's mean NLL
    grads: Any  # the batch's mean gradient, unscaled
    counts: Any  # per_block: the probes' counts of filtered and underflowed entries per block; else None
    compression: Any  # PowerSGD's next state, or None
    metrics: dict  # the stage's own (PowerSGD's error and traffic)


def objective(
    model: nnx.Module, batch: dict, dropout_key=None, grad_scales=None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The training objective summed over examples (weight x the family's `loss_weights()` mix
    of each stream's mean per-token NLL; DALL·E normalises text and image separately, arXiv
    2102.12092 section 2.2), and each stream's weighted NLL sum, for logging. `grad_scales`:
    per-resblock gradient scaling ({stack: BlockScale}, model/grad_scale.py)."""
    nll = stream_nll(model, batch["text"], batch["text_mask"], batch["codes"], dropout_key, grad_scales)
    w = batch["weights"].astype(jnp.float32)
    sums = {name: jnp.sum(v.mean(axis=-1) * w) for name, v in nll.items()}
    weights = model.cfg.loss_weights()
    return sum(weights[name] * s for name, s in sums.items()), sums


def differentiate(graphdef, scaling: str) -> Callable:
    """one(params, scaler, micro, total_weight, key) -> ((loss, streams), gradients as scaled,
    the probes' counts): the objective on one micro-batch, divided by the batch's total weight."""

    def loss_fn(params, probe_values, micro, total_weight, key, scaler):
        scales = block_scales(scaler, probe_values) if scaling == "per_block" else None
        total, streams = objective(nnx.merge(graphdef, params), micro, key, scales)
        loss = total / total_weight
        return loss * (scaler.scale if scaling == "global" else 1.0), (
            loss,
            {n: v / total_weight for n, v in streams.items()},
        )

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def one(params, scaler, micro, total_weight, key):
        (_, aux), (grads, counts) = grad_fn(
            params, probes(scaler) if scaling == "per_block" else None, micro, total_weight, key, scaler
        )
        return aux, grads, counts

    return one


def accumulate(one: Callable, grad_accum: int, micro_sharding=None, varying: Optional[str] = None) -> Callable:
    """`one` summed over the batch's `grad_accum` micro-batches; micro-batch i draws its dropout
    from fold_in(key, i). `micro_sharding`: each micro-batch split over data x fsdp (not the scan
    axis); `varying`: the shard_map axis the results vary over, if any."""
    if grad_accum == 1:
        return one

    def summed(params, scaler, batch, total_weight, key):
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, -1, *x.shape[1:]), batch)
        if micro_sharding is not None:
            micro = jax.lax.with_sharding_constraint(micro, micro_sharding)

        def body(carry, xs):
            i, mb = xs
            return jax.tree.map(jnp.add, carry, one(params, scaler, mb, total_weight, jax.random.fold_in(key, i))), None

        first = jax.tree.map(lambda x: x[0], micro)
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(lambda: one(params, scaler, first, total_weight, key))
        )
        if varying is not None:  # the carry has the per-worker type of what is added to it
            zeros = jax.lax.pcast(zeros, varying, to="varying")
        return jax.lax.scan(body, zeros, (jnp.arange(grad_accum), micro))[0]

    return summed


def whole(graphdef, batch_grads: Callable, scaling: str) -> Callable:
    """path(state, batch, total_weight, key) -> Gradients: XLA all-reduces the gradient whole."""

    def path(state, batch, total_weight, key) -> Gradients:
        (loss, streams), grads, counts = batch_grads(state.params, state.scaler, batch, total_weight, key)
        if scaling != "none":
            grads = unscale(scaling, grads, state.scaler, nnx.merge(graphdef, state.params))
        return Gradients(loss, streams, grads, counts, None, {})

    return path


def compressed(graphdef, batch_grads: Callable, scaling: str, powersgd, placement, log_every: int) -> Callable:
    """path(state, batch, total_weight, key) -> Gradients: each data-parallel worker computes its
    own rows' gradient under `shard_map` and the workers exchange only PowerSGD's factors. Its
    exact relative error, which costs a full all-reduce, is measured on the steps the logger
    fetches (every `log_every`; train/loop.py)."""
    if placement is None:
        raise ValueError("PowerSGD needs the run's mesh: pass its placement")
    workers = placement.mesh.shape["data"]

    def local(params, batch, psgd, total_weight, step_key, measure, scaler):
        key = jax.random.fold_in(step_key, jax.lax.axis_index("data"))  # this worker's own dropout masks
        # Parameters (and the scales, whose probes count per worker) marked device-varying: the
        # gradient of a replicated input would be summed over `data` by shard_map's transpose,
        # the full all-reduce PowerSGD replaces.
        params, scaler = jax.lax.pcast((params, scaler), "data", to="varying")
        (loss, streams), grads, counts = batch_grads(params, scaler, batch, total_weight, key)
        if scaling != "none":
            grads = unscale(scaling, grads, scaler, nnx.merge(graphdef, params))
        grads, psgd, stats = powersgd_mean(grads, psgd, powersgd.exclude, "data", workers, measure)
        return jax.lax.psum((loss, streams, counts), "data"), grads, psgd, stats

    # replicated: parameters, weight, key, scaler, losses, the mean gradient, Q, stats; split:
    # the batch and each worker's residuals
    split = PowerSGDState(q=False, error=True)
    run = over_data(
        local,
        placement.mesh,
        in_split=(False, True, split, False, False, False, False),
        out_split=(False, False, split, False),
    )

    def path(state, batch, total_weight, key) -> Gradients:
        logged = (state.step + 1) % log_every == 0  # the step the logger fetches in full
        (loss, streams, counts), grads, psgd, stats = run(
            state.params, batch, state.compression, total_weight, key, logged, state.scaler
        )
        floats = traffic(state.params, powersgd.rank, powersgd.exclude)
        return Gradients(
            loss,
            streams,
            grads,
            counts,
            psgd,
            {
                "comm/powersgd_rel_error": stats["rel_error"],
                "comm/compression": jnp.float32(floats["full"] / floats["sent"]),
                "comm/bytes_per_step": jnp.float32(4 * floats["sent"]),
            },
        )

    return path


def gradient_path(graphdef, o: GradientOptions, placement=None) -> Callable:
    """path(state, batch, key) -> Gradients: the stages the options turn on."""
    one = differentiate(graphdef, o.scaling)
    if o.powersgd is None:
        micro = None if placement is None else placement.micro_batch
        path = whole(graphdef, accumulate(one, o.grad_accum, micro), o.scaling)
    else:
        path = compressed(
            graphdef, accumulate(one, o.grad_accum, varying="data"), o.scaling, o.powersgd, placement, o.log_every
        )
    for name, on in o.added:
        path = STAGES.get(name)[1](path, on)

    def gradients(state, batch, key) -> Gradients:
        return path(state, batch, jnp.maximum(jnp.sum(batch["weights"]), 1.0), key)

    return gradients
