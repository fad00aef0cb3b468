"""Adam, Adafactor and Shampoo on one model: compile time, step time amortised over a
preconditioning period, and optimizer-state memory; Shampoo with float64 (the default on CPU) and
float32 roots, and its root refresh idle and beside a competing process.

    python benchmarks/optimizers.py [--periods 3] [--no-load] [overrides...]   (default size=small)

Shampoo recomputes its inverse roots every `optim.preconditioning_every` steps, so step times are
summed over whole periods and the median period is divided by its length. Shampoo is timed with
preconditioning on from the first step (start_preconditioning_step=0). "Loaded" repeats the
Shampoo timing while a second process multiplies 512 x 512 matrices in a loop on every core (as
a second run, or a test suite, would on a shared machine). One run, this machine; nothing here is
asserted by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import COMPETING_LOAD, fresh_train_step, random_batch, refresh_split, timed_steps, writes_page  # noqa: E402


@writes_page("Optimizers: compile time, step time, state memory")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--periods", type=int, default=3)
    ap.add_argument("--no-load", action="store_true", help="skip the timing beside a competing process")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import jax

    from dalle_ablate.validate import compose
    from dalle_ablate.validate import to_run_config

    rows, splits = {}, {}
    shampoo = ["optim.start_preconditioning_step=0"]
    # (label, optimizer, overrides, beside a competing process)
    variants = [
        ("adam", "adam", [], False),
        ("adafactor", "adafactor", [], False),
        ("shampoo", "shampoo", [*shampoo, "optim.root_dtype=float64"], False),
        ("shampoo f32 roots", "shampoo", [*shampoo, "optim.root_dtype=float32"], False),
    ]
    if not args.no_load:
        variants.append(("shampoo, loaded", "shampoo", [*shampoo, "optim.root_dtype=float64"], True))
    for label, name, extra, loaded in variants:
        cfg = to_run_config(compose(["size=small", f"optim={name}", *extra, *args.overrides]))
        period = cfg.optim.preconditioning_every if name == "shampoo" else 1
        step, state, run = fresh_train_step(cfg)
        mcfg = run.model_cfg
        state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
        b = cfg.trainer.batch_size
        batch = random_batch(mcfg, b)
        t = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t
        load = subprocess.Popen([sys.executable, "-c", COMPETING_LOAD]) if loaded else None
        try:
            # The warm-up step is count 0; counts 1..period*k hold exactly one root refresh per period.
            _, times, _ = timed_steps(compiled, state, batch, period * args.periods)
        finally:
            if load is not None:
                load.kill()
        per_period = [sum(times[i : i + period]) / period for i in range(0, len(times), period)]
        rows[label] = (compile_s, statistics.median(per_period), state_bytes)
        if name == "shampoo":  # the refresh is the last step of each period (count % period == 0)
            splits[label] = refresh_split(times, period)
        print(f"measured {label}", file=sys.stderr)

    base = rows["adam"]
    print(f"device: {jax.devices()[0].device_kind}, size=small, batch {b}, median of {args.periods} periods\n")
    print(f"{'optimizer':<18}{'compile s':>10}{'x adam':>8}{'step ms':>9}{'x adam':>8}{'state MiB':>11}{'x adam':>8}")
    for name, (c, s, m) in rows.items():
        print(
            f"{name:<18}{c:>10.2f}{c / base[0]:>8.2f}{s * 1e3:>9.1f}{s / base[1]:>8.2f}{m / 2**20:>11.1f}{m / base[2]:>8.2f}"
        )
    print()
    for label, (plain, extra) in splits.items():
        print(
            f"{label}: {plain * 1e3:.1f} ms per step without a root refresh; a refresh adds {extra * 1e3:.0f} ms "
            f"(every {period} steps)"
        )


if __name__ == "__main__":
    main()
