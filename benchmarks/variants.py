"""Cost of every layout relative to preln: step time, compile time and peak memory of the train step.

    python benchmarks/variants.py [--steps 10] [overrides...]     (default size=small)

Each layout's preset (conf/model/<layout>.yaml) is composed with the overrides, its train step is
compiled (timed), its memory read from XLA's memory analysis of the compiled step (arguments +
outputs + temporaries, less donated buffers), then run on one fixed random batch (median of
--steps). All numbers come from this one run; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import fresh_train_step, timed_steps  # noqa: E402


def measure(cfg, steps: int) -> dict:
    import numpy as np


    from dalle_ablate.model import param_count

    step, state, run = fresh_train_step(cfg)
    mcfg, n_params = run.model_cfg, param_count(run.abstract)
    rng = np.random.default_rng(0)
    b = cfg.trainer.batch_size
    batch = {
        "text": rng.integers(4, mcfg.text_vocab, (b, mcfg.text_len)).astype(np.int32),
        "text_mask": np.arange(mcfg.text_len)[None].repeat(b, 0) < rng.integers(4, mcfg.text_len, (b, 1)),
        "codes": rng.integers(0, mcfg.image_vocab, (b, mcfg.image_len)).astype(np.int32),
        "weights": np.ones(b, np.float32),
    }
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    peak = None
    if mem is not None:
        peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    _, times, loss = timed_steps(compiled, state, batch, steps)
    return {"params": n_params, "compile": compile_s, "step": statistics.median(times), "peak": peak, "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from dalle_ablate.validate import compose
    from dalle_ablate.model import LAYOUTS
    from dalle_ablate.validate import to_run_config

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
