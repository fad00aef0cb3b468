"""Seeds as members of one program (issue 40), the train step: what N seeds' steps cost as N
separate compiled steps in turn, against one compiled step over a member axis.

    python benchmarks/members.py [--rounds 30] [--members 3 [8 ...]] [-- overrides...]

The step is the study's (`experiment=study_mega +arm=baseline`, the overrides after it), its
core (`train/step.py: train_step_core`) taken three ways on one device: compiled once and called
once per member in turn (what N separate runs do), `jax.vmap` over a leading member axis of the
states, batches and dropout keys, and `jax.lax.map` over that axis (each member's unbatched
program in one compiled loop). Each member starts from its own seed's initial state, on its own
batch of random tokens. The rounds interleave the three, so the machine's load falls on each
alike; the table gives the median time of one step of all members, its ratio to the separate
steps, the compile times, and how far the members' losses are from their separate steps'.

This is the step alone: a run's start-up, data, evaluation and checkpoints are not in it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_batch, writes_page  # noqa: E402


def compiled(fn, *args) -> tuple[object, float]:
    """(fn compiled for args, seconds it took)."""
    t = time.perf_counter()
    exe = fn.lower(*args).compile()
    return exe, time.perf_counter() - t


def loss_of(step, *args) -> object:
    import jax

    return jax.block_until_ready(step(*args)[1]["train/loss"])


def measure(overrides: list[str], members: int, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp

    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.gradients import GradientOptions
    from dalle_ablate.train.step import train_step_core
    from dalle_ablate.validate import compose, to_run_config

    cfgs = [to_run_config(compose([*overrides, f"seed={s}"])) for s in range(members)]
    runs = [assemble(c, sizes=abstract_sizes(c.data, c.model), devices=jax.devices()[:1]) for c in cfgs]
    run = runs[0]
    core = train_step_core(run.graphdef, run.optimizer, run.schedule, GradientOptions.of(run.cfg))
    states = [r.init_state() for r in runs]
    keys = [jax.random.fold_in(jax.random.key(c.seed), 2) for c in cfgs]  # as make_train_step derives them
    batches = [{k: jnp.asarray(v) for k, v in random_batch(run.model_cfg, run.cfg.trainer.batch_size, seed=s).items()}
               for s in range(members)]
    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    stacked = (stack(states), stack(batches), jnp.stack(keys))

    one, c_one = compiled(jax.jit(core), states[0], batches[0], keys[0])
    vmapped, c_vmap = compiled(jax.jit(jax.vmap(core)), *stacked)
    mapped, c_map = compiled(jax.jit(lambda s, b, k: jax.lax.map(lambda a: core(*a), (s, b, k))), *stacked)

    times = {"separate": [], "vmap": [], "lax.map": []}
    for r in range(rounds + 1):  # round 0 warms up
        t = time.perf_counter()
        separate = [loss_of(one, states[i], batches[i], keys[i]) for i in range(members)]
        t1 = time.perf_counter()
        together = loss_of(vmapped, *stacked)
        t2 = time.perf_counter()
        in_turn = loss_of(mapped, *stacked)
        t3 = time.perf_counter()
        if r:
            for name, dt in (("separate", t1 - t), ("vmap", t2 - t1), ("lax.map", t3 - t2)):
                times[name].append(dt)
    ref = jnp.stack(separate)
    diff = {"vmap": float(jnp.max(jnp.abs(together - ref) / jnp.abs(ref))),
            "lax.map": float(jnp.max(jnp.abs(in_turn - ref) / jnp.abs(ref)))}
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "spread": times,
            "compile": {"separate": c_one, "vmap": c_vmap, "lax.map": c_map}, "diff": diff,
            "batch": run.cfg.trainer.batch_size}


@writes_page("Seeds as members of one program: the train step")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, nargs="+", default=[3])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = ["experiment=study_mega", "+arm=baseline", "tracker=none", *args.overrides]

    print("| members | batch per member | program | one step of all members (median ms) | vs separate | "
          "compile (s) | loss vs separate, max relative |")
    print("|---|---|---|---|---|---|---|")
    for m in args.members:
        r = measure(overrides, m, args.rounds)
        base = r["times"]["separate"]
        for name in ("separate", "vmap", "lax.map"):
            compile_s = r["compile"][name] * (m if name == "separate" else 1)  # separate runs compile once each
            diff = "0 (itself)" if name == "separate" else f"{r['diff'][name]:.1e}"
            print(f"| {m} | {r['batch']} | {name} | {1e3 * r['times'][name]:.1f} | {r['times'][name] / base:.2f} | "
                  f"{compile_s:.1f} | {diff} |")
    print(f"\n{args.rounds} interleaved rounds after one warm-up. The compile time of `separate` counts one "
          "compilation per member, as separate runs each compile theirs; a study's persistent compilation cache "
          "(report/study_runs.py) lets the later runs of an arm load it from disk instead.")


if __name__ == "__main__":
    main()
