"""Float16 gradient scaling on a deep, narrow model: float32, float16 unscaled, float16 with one
global loss scale, float16 with DALL·E's per-resblock scales. Trains each on the built-in data
and prints the loss along the way, skipped steps, the final scales and the eval loss; writes the
curves to grad_scaling.csv.

    python benchmarks/grad_scaling.py [--steps 300] [--layers 12] [overrides...]
    python benchmarks/grad_scaling.py --accuracy [--layers 12] [overrides...]

`--accuracy` trains nothing: on one batch of the same model at its initialisation it lets each
mode's dynamic rule settle (from 2^15, doubling after every clean step, halving on overflow) and
prints every parameter group's gradient error against float32's, the worst block and each group
outside the blocks, at the loss gradient of the batch and of batches 2^7 and 2^14 times larger
(the loss is a mean over tokens).

One run, this machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import offline_workdir, writes_page  # noqa: E402

ARMS = [("float32", "none"), ("float16", "none"), ("float16", "global"), ("float16", "per_block")]


@writes_page("Float16 gradient scaling: global vs per-resblock")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=12, help="encoder and decoder layers each (scanned)")
    ap.add_argument("--out", default="grad_scaling.csv")
    ap.add_argument("--accuracy", action="store_true", help="gradient errors per parameter group instead of training")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    offline_workdir("grad-scaling-bench-")
    if args.accuracy:
        accuracy(args)
        return

    import numpy as np

    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.hooks import evaluate
    from dalle_ablate.train.step import make_eval_step
    from dalle_ablate.validate import compose, to_run_config

    rows, curves, dataset = [], {}, None
    for dtype, mode in ARMS:
        cfg = to_run_config(
            compose(
                [
                    f"model.dtype={dtype}",
                    f"trainer.grad_scaling={mode}",
                    f"trainer.steps={args.steps}",
                    f"model.encoder_layers={args.layers}",
                    f"model.decoder_layers={args.layers}",
                    "model.d_model=64",
                    "model.heads=4",
                    "model.ffn_dim=128",
                    "model.scan_layers=true",
                    *args.overrides,
                ]
            )
        )
        run = assemble(cfg, dataset=dataset)
        dataset = run.dataset
        state, step = run.init_state(), run.train_step()
        b = cfg.trainer.batch_size
        batches = dataset.train_batches(b, cfg.seed)
        label, curve, t0, m = f"{dtype}/{mode}", [], time.perf_counter(), {}
        for i in range(1, args.steps + 1):
            state, m = step(state, run.placement.global_batch(next(batches), b))
            if i % 10 == 0:
                curve.append(float(m["train/loss"]))
        wall = time.perf_counter() - t0
        # evaluated in the training dtype: what that model computes
        eval_loss = float(
            evaluate(make_eval_step(run.graphdef, run.placement), state.params, dataset, b, None, run.placement)[0]
        )
        curves[label] = curve
        print(f"{label}: eval loss {eval_loss:.3f}, {wall:.0f} s", flush=True)
        rows.append(
            (
                label,
                curve[len(curve) // 4],
                curve[len(curve) // 2],
                float(np.mean(curve[-5:])),
                eval_loss,
                float(m.get("train/skipped_steps", 0.0)),
                float(m.get("train/grad_scale", float("nan"))),
                float(m.get("train/grad_underflow", float("nan"))),
                wall,
            )
        )
    print(f"{args.layers}+{args.layers} layers, d_model 64, {args.steps} steps")
    print(
        "| arm | loss @25% | loss @50% | loss (last 50 steps) | eval loss | skipped steps | final (min) scale | "
        "underflowed entries (last step) | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, q1, q2, last, ev_loss, skipped, scale, under, wall in rows:
        print(
            f"| {label} | {q1:.3f} | {q2:.3f} | {last:.3f} | {ev_loss:.3f} | {skipped:.0f} | {scale:g} | {under:g} | {wall:.0f} |"
        )
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *curves])
        for i, vals in enumerate(zip(*curves.values())):
            w.writerow([10 * (i + 1), *vals])


def model_overrides(args, dtype: str, mode: str) -> list[str]:
    return [
        f"model.dtype={dtype}",
        f"trainer.grad_scaling={mode}",
        f"model.encoder_layers={args.layers}",
        f"model.decoder_layers={args.layers}",
        "model.d_model=64",
        "model.heads=4",
        "model.ffn_dim=128",
        "model.scan_layers=true",
        *args.overrides,
    ]


def accuracy(args, steps: int = 16) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from dalle_ablate.optim import path_str
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.grad_scaling import (
        advance,
        block_names,
        block_scales,
        param_block,
        probes,
        scaler_init,
        unscale,
    )
    from dalle_ablate.train.gradients import objective
    from dalle_ablate.train.step import layer_group
    from dalle_ablate.validate import compose, to_run_config

    runs, dataset = {}, None
    for dtype, mode in (("float32", "none"), ("float16", "global"), ("float16", "per_block")):
        run = assemble(to_run_config(compose(model_overrides(args, dtype, mode))), dataset=dataset)
        dataset, runs[mode] = run.dataset, run
    b = runs["none"].cfg.trainer.batch_size
    batch = runs["none"].placement.global_batch(next(dataset.train_batches(b, 0)), b)
    params = runs["none"].init_state().params  # one set of float32 weights for every mode
    model = nnx.merge(runs["per_block"].graphdef, params)

    def grad_fn(mode):
        graphdef = runs[mode].graphdef

        def f(p, pr, state, magnitude):
            scales = block_scales(state, pr) if mode == "per_block" else None
            loss = objective(nnx.merge(graphdef, p), batch, None, scales)[0] / batch["weights"].sum() * magnitude
            return loss * (state.scale if mode == "global" else 1.0)

        @jax.jit
        def grads(state, magnitude):
            pr = probes(state) if mode == "per_block" else None
            g, counts = jax.grad(f, argnums=(0, 1))(params, pr, state, magnitude)
            return (unscale(mode, g, state, model) if mode != "none" else g), counts

        return grads

    def group(path) -> tuple[str, object]:
        """("blocks", the block) or (the group outside every block, None)."""
        where = param_block(path, model)
        if where is not None:
            return "blocks", where
        name = layer_group(path)
        return (name.split("/")[0] + "/res_norm" if "res_norm" in path_str(path) else name), None

    def errors(g, ref) -> dict[str, float]:
        """Relative error of each group's gradient; for "blocks", the worst block's."""
        d2, n2 = {}, {}
        for (path, a), r in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(ref)):
            a, r, key = np.asarray(a, np.float64), np.asarray(r, np.float64), group(path)
            d2[key], n2[key] = d2.get(key, 0.0) + float(np.sum((a - r) ** 2)), n2.get(key, 0.0) + float(np.sum(r**2))
        worst = {}
        for key in d2:
            worst[key[0]] = max(worst.get(key[0], 0.0), (d2[key] / max(n2[key], 1e-300)) ** 0.5)
        return worst

    fns = {mode: grad_fn(mode) for mode in runs}
    blocks = block_names(model)
    table = []
    for magnitude in (1.0, 2.0**-7, 2.0**-14):
        ref = fns["none"](None, magnitude)[0]
        for mode in ("global", "per_block"):
            state, err, scale = scaler_init(mode, blocks, 2.0**15), None, None
            for _ in range(steps):
                g, counts = fns[mode](state, magnitude)
                used = state.scale
                state, skip, _ = advance(mode, state, g, counts, model, growth_every=1)
                if not bool(skip):
                    err, scale = (
                        errors(g, ref),
                        [float(np.min(s)) for s in jax.tree.leaves(used)]
                        + [float(np.max(s)) for s in jax.tree.leaves(used)],
                    )
            table.append((magnitude, mode, err, scale))
    groups = ["blocks"] + sorted({k for _, _, e, _ in table if e for k in e} - {"blocks"})
    print(
        f"{args.layers}+{args.layers} layers, d_model 64, one batch of {b}, float16 vs float32 gradients (relative error; "
        "blocks: the worst block)"
    )
    print("| loss × | mode | settled scales | " + " | ".join(groups) + " |")
    print("|---|---|---|" + "---|" * len(groups))
    for magnitude, mode, err, scale in table:
        m = "1" if magnitude == 1 else f"2^{int(np.log2(magnitude))}"
        if err is None:
            print(f"| {m} | {mode} | every step skipped |" + " |" * len(groups))
            continue
        sc = f"2^{int(np.log2(min(scale)))}" + ("" if min(scale) == max(scale) else f" … 2^{int(np.log2(max(scale)))}")
        print(f"| {m} | {mode} | {sc} | " + " | ".join(f"{err.get(k, float('nan')):.2g}" for k in groups) + " |")


if __name__ == "__main__":
    main()
