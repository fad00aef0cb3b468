"""Seeds as members of one program (issue 40): what N seeds cost as N separate runs in turn,
against one job that trains them as members of one compiled program (`seeds=[...]`).

    python benchmarks/members.py [--step] [--wall] [--accelerator] [options] [-- overrides...]

One invocation runs the sections asked for (`--step` alone when none is) and writes them all to
one page, docs/results/benchmarks/members.md, so a section's numbers on the page were measured in
the same invocation as the others'.

`--step` (`--members 3 [8 ...]`, `--rounds 30`): the train step alone. The step is the study's
(`experiment=study_mega +arm=baseline`, the overrides after it), its core (`train/step.py:
train_step_core`) taken three ways on one device: compiled once and called once per member in turn
(what N separate runs do), `jax.vmap` over a leading member axis of the states, batches and
dropout keys, and `jax.lax.map` over that axis (each member's unbatched program in one compiled
loop). Each member starts from its own seed's initial state, on its own batch of random tokens.
The rounds interleave the three, so the machine's load falls on each alike; the table gives the
median time of one step of all members, its ratio to the separate steps, the compile times, and
how far the members' losses are from their separate steps'. A run's start-up, data, evaluation
and checkpoints are not in it.

`--wall` (`--steps 800 [2000 ...]`, `--reps 1`, `--impls vmap [map]`, `--seeds 3`, `--cache
study|fresh`): whole jobs as a user runs them, process start to exit: the N separate runs
`python -m dalle_ablate.job experiment=study_mega +arm=baseline seed=k trainer.steps=S` one after
the other, against one job `... seeds=[0,...,N-1] seed=0 members.impl=<impl>`; each with
`tracker=none`, `resume=null` and its folders in a fresh temp folder. `--cache study` (the
default) gives each arm of each repetition one empty JAX persistent compilation cache that its
processes share, as a study's runs share theirs (report/study_runs.py): the separate run seed=0
compiles, seeds 1.. load its programs from disk. `--cache fresh`: an empty cache per process.
Repetitions interleave the arms (separate, members, separate, members ...).

`--accelerator` (`--members-list 1 4 16 64`, `--accel-rounds 20`, `--dtype bfloat16`): the train
step of M members (vmap of the core, as `--step`) of the study's model (size=tiny) in bfloat16
against one run's step: tokens/s and MFU (model/flops.py train_flops_per_example over
train/perf.py device_peak_flops, as the trainer computes them). It runs unchanged on a GPU; on a
CPU pass a shorter `--members-list`.
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


def step_section(overrides: list[str], members: list[int], rounds: int) -> None:
    print("## The train step (--step)\n")
    print("| members | batch per member | program | one step of all members (median ms) | vs separate | "
          "compile (s) | loss vs separate, max relative |")
    print("|---|---|---|---|---|---|---|")
    for m in members:
        r = measure(overrides, m, rounds)
        base = r["times"]["separate"]
        for name in ("separate", "vmap", "lax.map"):
            compile_s = r["compile"][name] * (m if name == "separate" else 1)  # separate runs compile once each
            diff = "0 (itself)" if name == "separate" else f"{r['diff'][name]:.1e}"
            print(f"| {m} | {r['batch']} | {name} | {1e3 * r['times'][name]:.1f} | {r['times'][name] / base:.2f} | "
                  f"{compile_s:.1f} | {diff} |")
    print(f"\n{rounds} interleaved rounds after one warm-up. The compile time of `separate` counts one "
          "compilation per member, as separate runs each compile theirs; a study's persistent compilation cache "
          "(report/study_runs.py) lets the later runs of an arm load it from disk instead.\n")


# --- whole jobs (--wall) ---------------------------------------------------------------------

JOB = [sys.executable, "-m", "dalle_ablate.job", "experiment=study_mega", "+arm=baseline"]


def run_job(args: list[str], folder: Path, cache: Path) -> float:
    """Run one job process (its output appended to <folder>/job.log); its wall seconds, start to exit."""
    import os
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    command = [*JOB, *args, "tracker=none", "resume=null", f"hydra.run.dir={folder}/baseline-seed${{seed}}",
               f"hydra.sweep.dir={folder}/multirun"]
    with open(folder / "job.log", "a") as log:  # the separate runs of an arm share the folder
        t = time.perf_counter()
        code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        dt = time.perf_counter() - t
    if code:
        raise SystemExit(f"{' '.join(command)} exited with {code}; see {folder / 'job.log'}")
    return dt


def run_store_numbers(job_dir: Path) -> dict:
    """A run's own numbers from its run store: its summary's wall_time, its first step's time
    (compilation in it), the median step time (of the run; of the whole program for members)."""
    import json

    run = job_dir / "run"
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next((r["perf/compile_time"] for r in rows if "perf/compile_time" in r), float("nan"))
    steps = [r.get("perf/job_step_time", r.get("perf/step_time")) for r in rows if "perf/step_time" in r]
    if summary.get("status") != "finished":
        raise SystemExit(f"{run}: status {summary.get('status')!r}, not finished")
    return {"wall_time": summary["wall_time"], "first": first,
            "step": statistics.median(steps) if steps else float("nan")}


def wall_section(overrides: list[str], steps_list: list[int], reps: int, impls: list[str], n_seeds: int,
                 cache_mode: str) -> None:
    from common import offline_workdir

    tmp = offline_workdir("members-wall-")
    seeds = list(range(n_seeds))
    print(f"## Whole jobs (--wall): {n_seeds} separate runs in turn against one members job\n")
    print("| steps | arm | processes | wall (s), start to exit | vs separate | runs' own wall_time (s) | "
          "first step, compile in it (s) | median step (ms) | steps x median (s) | the rest (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = {}
    for steps in steps_list:
        args = [f"trainer.steps={steps}", *overrides]
        arms = ["separate", *[f"members {impl}" for impl in impls]]
        walls: dict[str, list[float]] = {a: [] for a in arms}
        detail: dict[str, list[dict]] = {a: [] for a in arms}
        for rep in range(reps):
            for arm in arms:  # interleaved: separate, members, separate, members ...
                folder = tmp / f"s{steps}-r{rep}-{arm.replace(' ', '-')}"
                cache = folder / "jax_cache"
                if arm == "separate":
                    dts = [run_job([f"seed={k}", *args], folder, cache if cache_mode == "study" else folder / f"jax_cache{k}")
                           for k in seeds]
                    walls[arm].append(sum(dts))
                else:
                    impl = arm.split()[1]
                    walls[arm].append(run_job([f"seeds=[{','.join(map(str, seeds))}]", f"seed={seeds[0]}",
                                               f"members.impl={impl}", *args], folder, cache))
                detail[arm].append({"dirs": [folder / f"baseline-seed{k}" for k in seeds]})
        base = statistics.median(walls["separate"])
        for arm in arms:
            wall = statistics.median(walls[arm])
            runs = [run_store_numbers(d) for d in detail[arm][-1]["dirs"]]  # the last repetition's run stores
            if arm == "separate":
                own = sum(r["wall_time"] for r in runs)
                first = sum(r["first"] for r in runs)
                step_ms = "; ".join(f"{1e3 * r['step']:.0f}" for r in runs)
                stepping = sum(r["step"] for r in runs) * steps
                own_s = " + ".join(f"{r['wall_time']:.0f}" for r in runs) + f" = {own:.0f}"
                first_s = " + ".join(f"{r['first']:.1f}" for r in runs)
            else:  # the members' stores hold the job's times, one job
                own, first, stepping = runs[0]["wall_time"], runs[0]["first"], runs[0]["step"] * steps
                step_ms = f"{1e3 * runs[0]['step']:.0f} (all {n_seeds})"
                own_s, first_s = f"{own:.0f}", f"{first:.1f}"
            results[(steps, arm)] = wall / base
            print(f"| {steps} | {arm} | {n_seeds if arm == 'separate' else 1} | "
                  f"{' / '.join(f'{w:.0f}' for w in walls[arm])} | {wall / base:.2f} | {own_s} | {first_s} | {step_ms} | "
                  f"{stepping:.0f} | {wall - stepping - first:.0f} |")
    cache_text = ("one empty JAX compilation cache per arm and repetition, shared by its processes (the study's own "
                  "setting, report/study_runs.py: the separate seed=0 compiles, seeds 1.. load from disk)"
                  if cache_mode == "study" else "an empty JAX compilation cache per process")
    print(f"\n{reps} repetition(s), the arms interleaved; wall is each repetition's (separate: the sum of its "
          f"{n_seeds} processes), `vs separate` the median's ratio. Each job: `experiment=study_mega +arm=baseline "
          f"trainer.steps=S tracker=none resume=null`, its folders fresh under a temp folder ({tmp}); {cache_text}. "
          "`runs' own wall_time` is each run store's summary (from the job's start inside the process, so the "
          "process's imports are not in it); `first step` the time to the first logged step, its compilation in it; "
          "`median step` the run's median logged step (members: the whole program's step, all members); "
          "`the rest` = wall - steps x median - first step: start-up, validation, the sampling evaluation, "
          "checkpoints, the slower steps. The dataset cache (data.cache_dir) was warm for every job.")
    if 1500 not in steps_list and len(steps_list):
        near = min(steps_list, key=lambda s: abs(s - 1500))
        for arm in [a for a in results if a[0] == near and a[1] != "separate"]:
            r = results[arm]
            # study_mega.yaml's budget: its 48 runs 123 min in turn, then the stress runs about 46 min.
            print(f"\nDerived, not measured ({arm[1]} at {near} steps): if every arm's seeds took {r:.2f}x of their "
                  f"separate runs' wall, the study's 48 runs of 1500 steps (123 min in turn, study_mega.yaml) would "
                  f"take {123 * r:.0f} min and the whole study with its stress runs (about 46 min, not members) "
                  f"{123 * r + 46:.0f} min against 169: {169 / (123 * r + 46):.2f}x faster. Other arms (shampoo, "
                  "adafactor) and 1500 steps were not measured here.")
    print()


# --- the train step on an accelerator (--accelerator) -------------------------------------------

def accelerator_section(overrides: list[str], members_list: list[int], rounds: int, dtype: str) -> None:
    import jax
    import jax.numpy as jnp

    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.model.flops import train_flops_per_example
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.gradients import GradientOptions
    from dalle_ablate.train.perf import device_peak_flops
    from dalle_ablate.train.step import train_step_core
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose([*overrides, f"model.dtype={dtype}", "seed=0"]))
    run = assemble(cfg, sizes=abstract_sizes(cfg.data, cfg.model), devices=jax.devices()[:1])
    core = train_step_core(run.graphdef, run.optimizer, run.schedule, GradientOptions.of(run.cfg))
    batch_size = cfg.trainer.batch_size
    flops = train_flops_per_example(run.model_cfg) * batch_size  # one member's step
    tokens = run.tokens_per_step
    peak, source = device_peak_flops(cache_dir=cfg.data.cache_dir)
    device = jax.devices()[0]
    print("## The train step on one device, M members against one run (--accelerator)\n")
    print(f"Device: {device.device_kind} ({jax.default_backend()}); peak {peak / 1e12:.3g} TFLOP/s ({source}); "
          f"model {cfg.model.dtype}, batch {batch_size} per member, {tokens} tokens and {flops / 1e9:.2f} GFLOP "
          "per member step.\n")
    print("| members | program | step of all members (median ms) | tokens/s | vs one run | MFU | compile (s) |")
    print("|---|---|---|---|---|---|---|")
    state = run.init_state()
    key = jax.random.fold_in(jax.random.key(cfg.seed), 2)
    one_batch = {k: jnp.asarray(v) for k, v in random_batch(run.model_cfg, batch_size, seed=0).items()}
    one, c_one = compiled(jax.jit(core), state, one_batch, key)

    def timed(fn, *args) -> float:
        t = time.perf_counter()
        loss_of(fn, *args)
        return time.perf_counter() - t

    rows, ones = [], []
    for m in members_list:
        stack = lambda x: jax.tree.map(lambda a: jnp.stack([a] * m), x)  # noqa: E731  same start: the cost is alike
        batches = {k: jnp.asarray(v) for k, v in random_batch(run.model_cfg, batch_size * m, seed=m).items()}
        batches = jax.tree.map(lambda a: a.reshape(m, batch_size, *a.shape[1:]), batches)
        args = (stack(state), batches, jax.random.split(key, m))
        vmapped, c = compiled(jax.jit(jax.vmap(core)), *args)
        pairs = [(timed(one, state, one_batch, key), timed(vmapped, *args)) for _ in range(rounds + 1)][1:]  # interleaved
        t1, dt = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        ones += [p[0] for p in pairs]
        rows.append(f"| {m} | vmap(core) | {1e3 * dt:.1f} | {m * tokens / dt:,.0f} | {m * tokens / dt / (tokens / t1):.2f} | "
                    f"{m * flops / (dt * peak):.2%} | {c:.1f} |")
        del args, batches, vmapped
    t_one = statistics.median(ones)
    print(f"| 1 run | jit(core) | {1e3 * t_one:.1f} | {tokens / t_one:,.0f} | 1.00 | {flops / (t_one * peak):.2%} | {c_one:.1f} |")
    print("\n".join(rows))
    print(f"\nMedian of {rounds} steps after a warm-up, each waited for, the one run's step and the members' "
          "interleaved; `vs one run` is tokens/s against the one run's steps interleaved with that row's. Every member starts from the same state on its own random batch (the "
          "cost does not depend on the values).")
    if jax.default_backend() == "cpu":
        print("Measured on the CPU: no GPU was lent to this task, so the accelerator numbers (1, 4, 16, 64 "
              "members on a GPU) were not measured here; the section runs unchanged on one: "
              "`python benchmarks/members.py --accelerator`.")
    print()


@writes_page("Seeds as members of one program")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", action="store_true", help="the train step: separate vs vmap vs lax.map (the default)")
    ap.add_argument("--members", type=int, nargs="+", default=[3])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--wall", action="store_true", help="whole jobs: N separate runs against one members job")
    ap.add_argument("--steps", type=int, nargs="+", default=[800])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--impls", nargs="+", default=["vmap"], choices=["vmap", "map"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cache", choices=["study", "fresh"], default="study")
    ap.add_argument("--accelerator", action="store_true", help="tokens/s and MFU of M members against one run")
    ap.add_argument("--members-list", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--accel-rounds", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not (args.step or args.wall or args.accelerator):
        args.step = True
    overrides = ["experiment=study_mega", "+arm=baseline", "tracker=none", *args.overrides]
    if args.step:
        step_section(overrides, args.members, args.rounds)
    if args.accelerator:
        accelerator_section(overrides, args.members_list, args.accel_rounds, args.dtype)
    if args.wall:
        wall_section(args.overrides, args.steps, args.reps, args.impls, args.seeds, args.cache)


if __name__ == "__main__":
    main()
