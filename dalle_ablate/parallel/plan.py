"""`dalle-ablate plan`: per-device memory and FLOPs of a config on a mesh of any size, from
abstract shapes only (nothing allocated, no devices needed: `size=mega` on a 32 x 8 mesh plans
on a laptop).

Parameters, gradients and optimizer state are exact: every leaf's bytes divided by the mesh
axes its PartitionSpec (the same rules the trainer uses) splits it over. Activations are an
estimate, counted from the layers' code by each model family (`activation_elements`,
`logit_elements`, `model_axis_reductions` on its `COSTS` class): the tensors each layer keeps for its
backward pass per example, the tensor-parallel ones divided by `mesh.model` (the accounting of
Korthikanti et al. 2022, arXiv 2205.05198, adapted to this encoder-decoder with GLU and
cross-attention; the single-stream family is one stack of encoder-like layers over T + I - 1):

    encoder layer  T (6d + (4d + 2hT + F) / t)               T text, I image tokens, h heads,
    decoder layer  I (9d + (6d + 2hI + 2hT + F) / t) + 2dT/t  t = mesh.model, F = 4f (GLU) or 2f
    logits         I V / t  (compute dtype) + I V / t (float32 softmax)

`full` rematerialisation keeps only each layer's input (T d or I d) plus one layer's
activations while it is recomputed; `dots_saveable` keeps the matmul outputs (q, k, v, scores,
context, projections, FFN in-projections) and recomputes norms, softmax and activations.

Communication per update and device, by mesh axis, as ring collectives move it (an all-reduce of
S bytes over n devices sends 2 (n-1)/n S, an all-gather or reduce-scatter (n-1)/n S):
- `data`: one all-reduce of the gradients (float32, as this device holds them); with PowerSGD
  (`optim.powersgd.rank`) the all-reduces of its factors and of the uncompressed parameters
  (`optim.powersgd.traffic`);
- `fsdp`: per micro-batch, the fsdp-sharded parameters all-gathered for the forward and again for
  the backward pass, and their gradients reduce-scattered (float32: an upper bound where XLA
  gathers after the cast to the compute dtype);
- `model` (Megatron-style tensor parallelism, Shoeybi et al. 2019, arXiv 1909.08053): per
  micro-batch and example, an all-reduce of the [tokens, d] activations after each attention
  and FFN (2 per encoder layer over T, 3 per decoder layer over I: self, cross, FFN) and after
  the vocabulary-split embeddings (T + I), in the compute dtype; as many again in the backward pass.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dalle_ablate.model import FAMILIES, abstract_model
from dalle_ablate.model.flops import train_flops_per_example
from dalle_ablate.optim import traffic
from dalle_ablate.parallel.devices import device_spec
from dalle_ablate.parallel.mesh import AXES, check_batch, pad_vocab_for_mesh
from dalle_ablate.parallel.rules import layout_specs
from dalle_ablate.registry import ConfigError

REMATS = ("none", "dots_saveable", "full")


def spec_axes(spec: P) -> list[str]:
    """The mesh axes a PartitionSpec splits over."""
    return [a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None]


def shard_factor(spec: P, sizes: dict[str, int]) -> int:
    return math.prod(sizes[a] for a in spec_axes(spec))


def per_device_bytes(tree, specs, sizes: dict[str, int]) -> int:
    leaves = jax.tree.leaves(tree)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return sum(
        math.ceil(x.size / shard_factor(s, sizes)) * np.dtype(x.dtype).itemsize for x, s in zip(leaves, flat_specs)
    )


def full_bytes(tree) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def communication_bytes(cfg, model_cfg, params, pspecs, param_bytes: int, sizes: dict[str, int], examples: int) -> dict:
    """Bytes one device sends per update over each mesh axis (module docstring)."""
    t, (n_d, n_f, n_t) = cfg.trainer, (sizes[a] for a in AXES)
    flat_specs = jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P))
    gathered = sum(
        math.ceil(x.size / shard_factor(s, sizes)) * np.dtype(x.dtype).itemsize * n_f
        for x, s in zip(jax.tree.leaves(params), flat_specs)
        if "fsdp" in spec_axes(s)
    )
    reduced = FAMILIES.get(model_cfg.family).COSTS.model_axis_reductions(model_cfg)
    act_bytes = np.dtype(model_cfg.dtype).itemsize
    floats = traffic(params, cfg.optim.powersgd.rank, cfg.optim.powersgd.exclude)
    return {
        "data": 2 * (n_d - 1) / n_d * param_bytes * floats["sent"] / floats["full"],
        "fsdp": t.grad_accum * 3 * (n_f - 1) / n_f * gathered,
        "model": t.grad_accum * examples * reduced * 2 * (n_t - 1) / n_t * act_bytes,
    }


def memory_plan(cfg, model_cfg, new_state) -> dict:
    """Per-device bytes of parameters, gradients (float32, like the master weights), optimizer
    state and activations by remat policy, for `cfg.mesh` (-1 counts as 1), and FLOPs.
    `new_state`: params -> the run's train state (train/state.py), for its shapes."""
    raw = [int(getattr(cfg.mesh, a)) for a in AXES]
    sizes = dict(zip(AXES, [max(s, 1) for s in raw]))
    t = cfg.trainer
    check_batch(t, tuple(sizes.values()))
    dp = sizes["data"] * sizes["fsdp"]
    micro = t.batch_size // t.grad_accum
    model_cfg = pad_vocab_for_mesh(model_cfg, sizes["model"])
    params, pspecs, state, sspecs = layout_specs(abstract_model(model_cfg), new_state, sizes)
    act_bytes = np.dtype(model_cfg.dtype).itemsize
    costs = FAMILIES.get(model_cfg.family).COSTS
    logits = costs.logit_elements(model_cfg) / sizes["model"] * (act_bytes + 4)  # compute dtype and a float32 copy
    b = micro // dp
    per_example = costs.activation_elements(model_cfg, sizes["model"])
    param_bytes = per_device_bytes(params, pspecs, sizes)
    return {
        "sizes": sizes,
        "devices": math.prod(sizes.values()),
        "micro_batch": micro,
        "per_device_examples": b,
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "param_bytes": param_bytes,
        # everything the train state holds besides the parameters: the optimizer's moments and
        # counters, and the gradient scaler's and PowerSGD's state when on
        "optimizer_bytes": per_device_bytes(state, sspecs, sizes) - param_bytes,
        "activation_bytes": {k: b * (v * act_bytes + logits) for k, v in per_example.items()},
        "flops_per_update": train_flops_per_example(model_cfg) * t.batch_size,
        "checkpoint_bytes": full_bytes(state),  # all shards together, as orbax writes them
        "communication_bytes": communication_bytes(cfg, model_cfg, params, pspecs, param_bytes, sizes, b),
    }


def fit_line(total: float, memory: int) -> str:
    """Whether `total` bytes fit in a device of `memory` bytes, and by how much."""
    if total <= memory:
        return f"fits ({total / memory:.0%} of {_gb(memory)})"
    return f"does not fit ({_gb(total - memory)} over {_gb(memory)})"


def plan(cfg, model_cfg, new_state, device: str | None = None, mfu: float = 0.4) -> str:
    """The table that `dalle-ablate plan` prints; with `device` (a name of DEVICES), whether each
    remat policy fits its memory and the step time at `mfu` of its peak."""
    spec = device_spec(device) if device is not None else None
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu} must be in (0, 1]")
    m = memory_plan(cfg, model_cfg, new_state)
    sizes, t = m["sizes"], cfg.trainer
    fixed = m["param_bytes"] * 2 + m["optimizer_bytes"]
    lines = [
        f"mesh data={sizes['data']} fsdp={sizes['fsdp']} model={sizes['model']} ({m['devices']} devices); batch "
        f"{t.batch_size} = {t.grad_accum} x {m['micro_batch']}, {m['per_device_examples']} examples per device per micro-batch",
        f"parameters {m['params']:,} ({m['params'] * 4 / 1e9:.1f} GB in float32, {m['params'] * 2 / 1e9:.1f} GB in 16 bits); "
        f"FLOPs per update {m['flops_per_update']:.3e} ({m['flops_per_update'] / m['devices']:.3e} per device)",
        f"optimizer {cfg.optim.name}; compute dtype {model_cfg.dtype}, master weights and gradients float32",
        "",
        f"{'per device':<34}{'memory':>12}",
        f"{'parameters':<34}{_gb(m['param_bytes']):>12}",
        f"{'gradients':<34}{_gb(m['param_bytes']):>12}",
        f"{'optimizer state':<34}{_gb(m['optimizer_bytes']):>12}",
    ]
    for policy in REMATS:
        lines.append(f"{'activations, remat=' + policy:<34}{_gb(m['activation_bytes'][policy]):>12}")
    for policy in REMATS:
        total = fixed + m["activation_bytes"][policy]
        fit = f"  {device}: {fit_line(total, spec.memory)}" if spec else ""
        lines.append(f"{'total, remat=' + policy:<34}{_gb(total):>12}{fit}")
    lines += ["", f"{'communication per update and device':<34}{'sent':>12}"]
    for axis in AXES:
        lines.append(f"{'  over ' + axis + f' ({sizes[axis]})':<34}{_gb(m['communication_bytes'][axis]):>12}")
    lines.append(f"checkpoint size (parameters and optimizer state, all shards): {_gb(m['checkpoint_bytes'])}")
    if spec:
        step = m["flops_per_update"] / m["devices"] / (spec.peak * mfu)
        tokens = t.batch_size * (model_cfg.text_len + model_cfg.image_len)
        lines.append(
            f"step time on {m['devices']} x {device} at {mfu:.0%} MFU ({spec.peak / 1e12:g} TFLOP/s bf16 peak each): "
            f"{step:.3g} s, {tokens / step:,.0f} tokens/s"
        )
    lines.append(
        "(activations and communication are estimates, and XLA needs working memory beyond these totals: "
        "see dalle_ablate/parallel/plan.py)"
    )
    return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"
