"""`dalle-ablate describe`: parameters per module, FLOPs per image token, and the memory of
parameters, gradients and optimizer state, from abstract shapes only (works for size=mega)."""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from flax import nnx

from dalle_ablate.model import FAMILIES, abstract_model
from dalle_ablate.model.flops import forward_flops_per_example
from dalle_ablate.optim import path_str


def module_counts(params) -> dict[str, int]:
    """Parameter counts by module: top-level modules, and one layer's sublayers for the stacks
    (`encoder.layer/attn`, ...) with the stack total (`encoder`)."""
    counts: dict[str, int] = defaultdict(int)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = path_str(path).split("/")
        counts[parts[0]] += int(np.prod(x.shape))
        if len(parts) > 2 and parts[1] == "0":  # a stack (encoder, decoder): its first layer
            counts[f"{parts[0]}.layer/{parts[2]}"] += int(np.prod(x.shape))
    return dict(counts)


def describe(model_cfg, new_state) -> str:
    """The table `dalle-ablate describe` prints; `new_state`: params -> the run's train state,
    whose floating-point arrays besides the parameters count as optimizer state."""
    model = abstract_model(model_cfg)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    state = jax.eval_shape(new_state, params)
    opt_count = (
        sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.floating)) - total
    )
    fwd = forward_flops_per_example(model_cfg)
    c = model_cfg
    costs = FAMILIES.get(c.family).COSTS
    layers = c.depth if hasattr(c, "depth") else f"{c.encoder_layers}+{c.decoder_layers}"
    lines = [
        f"{c.family} layout={c.layout} d_model={c.d_model} heads={c.heads} layers={layers} "
        f"ffn_dim={c.ffn_dim} glu={c.glu} norm={c.norm} activation={c.activation}",
        f"text {c.text_len} tokens of {c.text_vocab}; image {c.image_len} tokens of {c.image_vocab}",
        "",
        f"{'module':<28}{'parameters':>16}{'share':>8}",
    ]
    for name, n in module_counts(params).items():
        lines.append(f"{name:<28}{n:>16,}{n / total:>8.1%}")
    lines.append(f"{'total':<28}{total:>16,}")
    lines += [
        "",
        f"FLOPs per image token: forward {fwd / c.image_len:,.0f}, training step {3 * fwd / c.image_len:,.0f}",
    ]
    if hasattr(costs, "attention_pairs"):  # sparse masks: what a kernel that skipped masked pairs would save
        pairs = costs.attention_pairs(c)
        per_pair = 4 * c.d_model  # scores and weighted values, 2 FLOPs per multiply-add each
        lines.append(
            f"attention FLOPs per example (forward): {per_pair * pairs['square']:,} as computed (full square), "
            f"{per_pair * pairs['causal']:,} causal, {per_pair * pairs['pattern']:,} with "
            f"attention_pattern={c.attention_pattern} ({pairs['pattern'] / pairs['causal']:.1%} of causal)"
        )
    lines += [
        "",
        f"{'memory':<28}{'fp32':>12}{'fp16/bf16':>12}",
    ]
    for name, n in (("parameters", total), ("gradients", total), ("optimizer state", opt_count)):
        lines.append(f"{name:<28}{_gb(4 * n):>12}{_gb(2 * n):>12}")
    return "\n".join(lines)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"
