"""Float16 gradient scaling on a deep, narrow model: float32, float16 unscaled, float16 with one
global loss scale, float16 with DALL·E's per-resblock scales. Trains each on the built-in data
and prints the loss along the way, skipped steps, the final scales and the eval loss; writes the
curves to grad_scaling.csv.

    python benchmarks/grad_scaling.py [--steps 300] [--layers 12] [overrides...]

One run, this machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import offline_workdir  # noqa: E402

ARMS = [("float32", "none"), ("float16", "none"), ("float16", "global"), ("float16", "per_block")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=12, help="encoder and decoder layers each (scanned)")
    ap.add_argument("--out", default="grad_scaling.csv")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    offline_workdir("grad-scaling-bench-")

    import jax
    import numpy as np

    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.step import make_eval_step
    from dalle_ablate.validate import compose, to_run_config

    rows, curves, dataset = [], {}, None
    for dtype, mode in ARMS:
        cfg = to_run_config(compose([f"model.dtype={dtype}", f"trainer.grad_scaling={mode}", f"trainer.steps={args.steps}",
                                     f"model.encoder_layers={args.layers}", f"model.decoder_layers={args.layers}", "model.d_model=64",
                                     "model.heads=4", "model.ffn_dim=128", "model.scan_layers=true", *args.overrides]))
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
        ev, total, weight = make_eval_step(run.graphdef, run.placement), 0.0, 0.0
        for eb in dataset.eval_batches(b):  # evaluated in the training dtype: what that model computes
            s, w = jax.device_get(ev(state.params, run.placement.global_batch(eb, b)))
            total, weight = total + float(s), weight + float(w)
        curves[label] = curve
        print(f"{label}: eval loss {total / weight:.3f}, {wall:.0f} s", flush=True)
        rows.append((label, curve[len(curve) // 4], curve[len(curve) // 2], float(np.mean(curve[-5:])), total / weight,
                     float(m.get("train/skipped_steps", 0.0)), float(m.get("train/grad_scale", float("nan"))),
                     float(m.get("train/grad_underflow", float("nan"))), wall))
    print(f"{args.layers}+{args.layers} layers, d_model 64, {args.steps} steps")
    print("| arm | loss @25% | loss @50% | loss (last 50 steps) | eval loss | skipped steps | final (min) scale | "
          "underflowed entries (last step) | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, q1, q2, last, ev_loss, skipped, scale, under, wall in rows:
        print(f"| {label} | {q1:.3f} | {q2:.3f} | {last:.3f} | {ev_loss:.3f} | {skipped:.0f} | {scale:g} | {under:g} | {wall:.0f} |")
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *curves])
        for i, vals in enumerate(zip(*curves.values())):
            w.writerow([10 * (i + 1), *vals])


if __name__ == "__main__":
    main()
