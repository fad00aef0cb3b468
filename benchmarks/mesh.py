"""Compile and step time of the train step on device meshes, remat's effect on memory, and
scanned vs unrolled layers' compile time.

    python benchmarks/mesh.py [--steps 5] [--layers 24] [overrides...]     (default size=tiny)

Runs itself with 8 fake CPU devices (XLA_FLAGS is set before jax starts). On a machine with
fewer cores than devices no speed-up is expected: the numbers show the partitioning overhead
and the compile cost of each mesh. Memory is XLA's own analysis of the compiled step (arguments
+ outputs + temporaries, less donated buffers, per device). One run; nothing here is asserted by
the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_batch, writes_page  # noqa: E402

MESHES = [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]


def measure(overrides: list[str], steps: int) -> dict:
    """Compile time, median step time and per-device memory of one config's train step."""
    import jax
    import numpy as np

    from dalle_ablate.validate import compose
    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.validate import to_run_config

    cfg = to_run_config(compose(overrides))
    devices = jax.devices()[: np.prod([max(int(getattr(cfg.mesh, a)), 1) for a in ("data", "fsdp", "model")])]
    run = assemble(cfg, sizes=abstract_sizes(cfg.data, cfg.model), devices=devices)
    mcfg, placement = run.model_cfg, run.placement
    state, step = run.init_state(), run.train_step()
    b = cfg.trainer.batch_size
    batch = placement.global_batch(random_batch(mcfg, b), b)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    per_device = (
        (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
        if mem is not None
        else float("nan")
    )
    times = []
    state, m = compiled(state, batch)
    jax.block_until_ready(m["train/loss"])
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m["train/loss"])
        times.append(time.perf_counter() - t)
    return {"compile": compile_s, "step": statistics.median(times), "memory": per_device}


@writes_page("The train step on meshes of 8 CPU devices")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24, help="stack depth for the scan-vs-unrolled compile")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import jax

    base = ["size=tiny", "trainer.batch_size=16", "model.heads=8", *args.overrides]
    print(f"{jax.device_count()} fake CPU devices on {os.cpu_count()} cores; {' '.join(base)}\n")
    print(f"{'mesh (d,f,m)':<14}{'optim':<9}{'compile s':>10}{'step ms':>9}{'MiB/device':>12}")
    for mesh in MESHES:
        for optim in ("adam", "shampoo"):
            extra = ["optim.start_preconditioning_step=0"] if optim == "shampoo" else []
            r = measure(
                [
                    *base,
                    f"optim={optim}",
                    *extra,
                    f"mesh.data={mesh[0]}",
                    f"mesh.fsdp={mesh[1]}",
                    f"mesh.model={mesh[2]}",
                ],
                args.steps,
            )
            print(
                f"{str(mesh):<14}{optim:<9}{r['compile']:>10.2f}{r['step'] * 1e3:>9.1f}{r['memory'] / 2**20:>12.2f}",
                flush=True,
            )

    print(f"\n{'remat (1 device)':<24}{'compile s':>10}{'step ms':>9}{'MiB':>10}")
    for policy in ("none", "dots_saveable", "full"):
        r = measure([*base, "trainer.batch_size=64", "mesh.data=1", f"model.remat={policy}"], args.steps)
        print(f"{policy:<24}{r['compile']:>10.2f}{r['step'] * 1e3:>9.1f}{r['memory'] / 2**20:>10.2f}", flush=True)

    n = args.layers
    print(f"\n{'layers ' + str(n) + '+' + str(n) + ' (1 device)':<24}{'compile s':>10}{'step ms':>9}")
    for scan in (False, True):
        r = measure(
            [
                *base,
                "mesh.data=1",
                f"model.encoder_layers={n}",
                f"model.decoder_layers={n}",
                f"model.scan_layers={str(scan).lower()}",
            ],
            args.steps,
        )
        print(f"{'scanned' if scan else 'unrolled':<24}{r['compile']:>10.2f}{r['step'] * 1e3:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
