"""Cost of every layout relative to preln: step time, compile time and peak memory of the train step.

    python benchmarks/variants.py [--steps 10] [overrides...]     (default size=small)

Each layout's preset (conf/model/<layout>.yaml) is composed with the overrides, its train step is
compiled (timed), its memory read from XLA's memory analysis of the compiled step (arguments +
outputs + temporaries, less donated buffers), then run on one fixed random batch (median of
--steps). All numbers come from this one run; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(cfg, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.model import build_model, param_count
    from dalle_ablate.optim import build_optimizer
    from dalle_ablate.train.step import TrainState, make_train_step

    mcfg = dataclasses.replace(cfg.model, **abstract_sizes(cfg.data, cfg.model))
    model = build_model(mcfg, cfg.seed)
    n_params = param_count(model)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    opt, sched = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params))
    rng = np.random.default_rng(0)
    b = cfg.trainer.batch_size
    batch = {
        "text": rng.integers(4, mcfg.text_vocab, (b, mcfg.text_len)).astype(np.int32),
        "text_mask": np.arange(mcfg.text_len)[None].repeat(b, 0) < rng.integers(4, mcfg.text_len, (b, 1)),
        "codes": rng.integers(0, mcfg.image_vocab, (b, mcfg.image_len)).astype(np.int32),
        "weights": np.ones(b, np.float32),
    }
    step = make_train_step(graphdef, opt, sched, cfg.trainer.grad_accum, cfg.seed)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    state, m = compiled(state, batch)
    jax.block_until_ready(m["train/loss"])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m["train/loss"])
        times.append(time.perf_counter() - t)
    return {"params": n_params, "compile": compile_s, "step": statistics.median(times), "peak": peak,
            "loss": float(m["train/loss"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from dalle_ablate.cli import compose
    from dalle_ablate.config import to_run_config
    from dalle_ablate.model import LAYOUTS

    layouts = ["preln"] + [n for n in LAYOUTS.names() if n != "preln"]
    rows = {}
    for layout in layouts:
        cfg = to_run_config(compose([f"model={layout}", "size=small", *args.overrides]))
        rows[layout] = measure(cfg, args.steps)
        print(f"measured {layout}", file=sys.stderr)
    base = rows["preln"]
    import jax

    print(f"device: {jax.devices()[0].device_kind}, size=small (overrides: {' '.join(args.overrides) or 'none'}), "
          f"median of {args.steps} steps\n")
    print(f"{'layout':<11}{'params':>11}{'step ms':>9}{'x preln':>8}{'compile s':>10}{'x preln':>8}{'peak MiB':>10}{'x preln':>8}")
    for name, r in rows.items():
        peak = f"{r['peak'] / 2**20:>10.1f}{r['peak'] / base['peak']:>8.2f}" if r["peak"] else f"{'n/a':>10}{'':>8}"
        print(f"{name:<11}{r['params']:>11,}{r['step'] * 1e3:>9.1f}{r['step'] / base['step']:>8.2f}"
              f"{r['compile']:>10.2f}{r['compile'] / base['compile']:>8.2f}{peak}")


if __name__ == "__main__":
    main()
