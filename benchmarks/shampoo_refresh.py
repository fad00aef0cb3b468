"""Shampoo's root refresh idle and beside a competing process: inside the train step (its
`lax.cond`), as a separately jitted function, and with one eigendecomposition loop per stack
instead of one per block size; with the BLAS under JAX's eigh capped at one thread (the default,
`optim.lapack_threads=1`) and left at the library's own choice (`optim.lapack_threads=null`).

    python benchmarks/shampoo_refresh.py [--periods 2] [overrides...]   (default size=small)

Each setting runs in its own process (the thread cap is process-wide). In it: the train step with
preconditioning from step 0, over whole preconditioning periods; "in step" is the median
refresh step's time minus the median plain step's. Then the inverse roots of that run's
statistics as one jitted function ("separate jit", what a trainer calling the refresh every k
steps outside the step would pay) and as one jitted function per stack ("per stack"). "Loaded"
repeats it all while a second process multiplies 512 x 512 matrices on every core. One run,
this machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import COMPETING_LOAD, fresh_train_step, random_batch, refresh_split, timed_steps, writes_page  # noqa: E402

COLUMNS = ("plain step", "in step", "separate jit", "per stack")


def measure(periods: int, overrides: list[str]) -> dict:
    """Seconds per setting (COLUMNS), medians over `periods`, in this process."""
    import jax

    from dalle_ablate.optim.inverse_roots import batched_inverse_roots
    from dalle_ablate.optim.scale_by_shampoo import ShampooState
    from dalle_ablate.optim.shampoo import root_dtype
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose(["size=small", "optim=shampoo", "optim.start_preconditioning_step=0", *overrides]))
    period = cfg.optim.preconditioning_every
    step, state, run = fresh_train_step(cfg)
    batch = random_batch(run.model_cfg, cfg.trainer.batch_size)
    compiled = step.lower(state, batch).compile()
    state, times, _ = timed_steps(compiled, state, batch, period * periods)
    plain, refresh_add = refresh_split(times, period)

    (shampoo,) = [
        s
        for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ShampooState))
        if isinstance(s, ShampooState)
    ]
    mats, ps = [], []
    for st in shampoo.stacks:  # a rank-1 stack's right statistic is [n, 1, 1] and never used
        rank = 2 if st.right.shape[-1] > 1 else 1
        mats += [st.left, st.right][:rank]
        ps += [2 * rank] * rank
    eps, dtype = cfg.optim.matrix_eps, root_dtype(cfg.optim.root_dtype)
    together = jax.jit(lambda ms: batched_inverse_roots(ms, ps, eps, dtype))
    apart = [jax.jit(lambda m, p=p: batched_inverse_roots([m], [p], eps, dtype)) for p in ps]

    def timed(fn) -> float:
        fn()  # compile
        out = []
        for _ in range(periods):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    separate = timed(lambda: jax.block_until_ready(together(mats)))
    per_stack = timed(lambda: [jax.block_until_ready(f(m)) for f, m in zip(apart, mats)])
    sizes: dict[int, int] = {}
    for m in mats:
        sizes[m.shape[-1]] = sizes.get(m.shape[-1], 0) + m.shape[0]
    return {
        "plain step": plain,
        "in step": refresh_add,
        "separate jit": separate,
        "per stack": per_stack,
        "statistics": {str(k): v for k, v in sorted(sizes.items())},
    }


@writes_page("Shampoo's root refresh, idle and loaded")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--periods", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.child:  # one setting; the competing process, if any, is the parent's
        print(json.dumps(measure(args.periods, args.overrides)), flush=True)
        return

    rows = {}
    for threads in ("1", "null"):
        for loaded in (False, True):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                "--periods",
                str(args.periods),
                f"optim.lapack_threads={threads}",
                *args.overrides,
            ]
            load = subprocess.Popen([sys.executable, "-c", COMPETING_LOAD]) if loaded else None
            try:
                out = subprocess.run(cmd, capture_output=True, text=True)
            finally:
                if load is not None:
                    load.kill()
            if out.returncode != 0:
                sys.exit(f"lapack_threads={threads} {'loaded' if loaded else 'idle'} failed:\n{out.stderr[-3000:]}")
            rows[(threads, loaded)] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"measured lapack_threads={threads} {'loaded' if loaded else 'idle'}", file=sys.stderr, flush=True)

    first = next(iter(rows.values()))
    print(
        f"size=small Shampoo on {os.cpu_count()} cores; statistics per block size: {first['statistics']}; "
        f"median of {args.periods} periods; seconds\n"
    )
    print(f"{'lapack_threads':<16}{'':<8}" + "".join(f"{c:>14}" for c in COLUMNS))
    for (threads, loaded), r in rows.items():
        print(f"{threads:<16}{'loaded' if loaded else 'idle':<8}" + "".join(f"{r[c]:>14.2f}" for c in COLUMNS))
    print("\nloaded / idle")
    for threads in ("1", "null"):
        idle, busy = rows[(threads, False)], rows[(threads, True)]
        print(f"{threads:<16}{'':<8}" + "".join(f"{busy[c] / idle[c]:>14.2f}" for c in COLUMNS))


if __name__ == "__main__":
    main()
