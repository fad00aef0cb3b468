"""Cost of every layout, and of the single-stream family under each attention pattern, relative to
preln: step time, compile time and peak memory of the train step.

    python benchmarks/variants.py [--steps 10] [--only ROW,ROW] [overrides...]     (default size=small)

Each layout's preset (conf/model/<layout>.yaml) is composed with the overrides, its train step is
compiled (timed), its memory read from XLA's memory analysis of the compiled step (arguments +
outputs + temporaries, less donated buffers), then run on one fixed random batch (median of
--steps). The single-stream rows (`model=dalle`, one row per `model.attention_pattern`) add the
attention FLOPs per example their masks need (forward, scores and values) next to what the dense
kernel computes: the masks are applied to a full score matrix, so a sparse pattern saves FLOPs
only on paper until a block-sparse kernel skips the masked blocks. All numbers come from this
one run; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import fresh_train_step, timed_steps, writes_page  # noqa: E402


def measure(cfg, steps: int) -> dict:
    import numpy as np

    from dalle_ablate.model import param_count
    from dalle_ablate.model.flops import train_flops_per_example
    from dalle_ablate.train.perf import device_peak_flops, mfu

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
    step_s = statistics.median(times)
    utilisation = mfu(train_flops_per_example(mcfg) * b / step_s, *device_peak_flops(cache_dir=cfg.data.cache_dir))
    return {"params": n_params, "compile": compile_s, "step": step_s, "peak": peak, "loss": loss, "mfu": utilisation}


@writes_page("Layouts and attention patterns: step time, compile time, memory, MFU")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--only", help="these rows only (preln always), comma-separated: --only normformer,dalle/dense,dalle/dalle"
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from dalle_ablate.validate import compose
    from dalle_ablate.model import LAYOUTS
    from dalle_ablate.validate import to_run_config

    variants = {n: [f"model={n}"] for n in ["preln"] + [n for n in LAYOUTS.names() if n != "preln"]}
    variants.update(
        {
            f"dalle/{p}": ["model=dalle", f"model.attention_pattern={p}"]
            for p in ("dense", "row", "column", "conv", "dalle")
        }
    )
    if args.only:
        args.only = args.only.split(",")
        unknown = sorted(set(args.only) - set(variants))
        if unknown:
            sys.exit(f"--only: {', '.join(unknown)} not a row; rows: {', '.join(variants)}")
        variants = {n: o for n, o in variants.items() if n == "preln" or n in args.only}
    size_given = any(o.startswith("size=") for o in args.overrides)
    rows = {}
    for name, overrides in variants.items():
        cfg = to_run_config(compose([*overrides, *([] if size_given else ["size=small"]), *args.overrides]))
        rows[name] = measure(cfg, args.steps)
        rows[name]["attention"] = attention_flops(cfg)
        print(f"measured {name}", file=sys.stderr)
    base = rows["preln"]
    import jax

    print(
        f"device: {jax.devices()[0].device_kind}, {'' if size_given else 'size=small '}(overrides: {' '.join(args.overrides) or 'none'}), "
        f"median of {args.steps} steps\n"
    )
    print(
        f"{'variant':<14}{'params':>11}{'step ms':>9}{'x preln':>8}{'compile s':>10}{'x preln':>8}{'peak MiB':>10}{'x preln':>8}"
        f"{'MFU':>7}{'attn MFLOP':>12}{'needed':>8}"
    )
    for name, r in rows.items():
        peak = f"{r['peak'] / 2**20:>10.1f}{r['peak'] / base['peak']:>8.2f}" if r["peak"] else f"{'n/a':>10}{'':>8}"
        attn = (
            f"{r['attention'][0] / 1e6:>12.1f}{r['attention'][1] / r['attention'][0]:>8.0%}" if r["attention"] else ""
        )
        print(
            f"{name:<14}{r['params']:>11,}{r['step'] * 1e3:>9.1f}{r['step'] / base['step']:>8.2f}"
            f"{r['compile']:>10.2f}{r['compile'] / base['compile']:>8.2f}{peak}{r['mfu']:>7.1%}{attn}"
        )
    print(
        "\nMFU: training FLOPs per step (model/flops.py, attention counted as computed) over the step time and the "
        "device's bf16 peak; attn MFLOP: attention scores and values per example, forward, as computed (full square); "
        "needed: the share the pattern's masks keep"
    )


def attention_flops(cfg):
    """(computed, needed by the masks) attention FLOPs per example of a single-stream model, or None."""
    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.model import FAMILIES, resolve

    costs = FAMILIES.get(cfg.model.family).COSTS
    if not hasattr(costs, "attention_pairs"):
        return None
    pairs = costs.attention_pairs(resolve(cfg.model, **abstract_sizes(cfg.data, cfg.model)))
    return 4 * cfg.model.d_model * pairs["square"], 4 * cfg.model.d_model * pairs["pattern"]


if __name__ == "__main__":
    main()
