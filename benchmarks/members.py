"""Seeds as members of one program (issue 40): what N seeds cost as N separate runs in turn,
against one job that trains them as members of one compiled program (`seeds=[...]`).

    python benchmarks/members.py [--step] [--wall] [--accelerator] [--shampoo] [--shampoo-hang N] [options]
        [-- overrides...]

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
processes share, as a study's runs share theirs (study/runner.py): the separate run seed=0
compiles, seeds 1.. load its programs from disk. `--cache fresh`: an empty cache per process.
Repetitions interleave the arms (separate, members, separate, members ...).

`--accelerator` (`--members-list 1 4 16 64`, `--accel-rounds 20`, `--dtype bfloat16`): the train
step of M members (vmap of the core, as `--step`) of the study's model (size=tiny) in bfloat16
against one run's step: tokens/s and MFU (model/flops.py train_flops_per_example over the
datasheet's peak on an accelerator; on a CPU over a matmul probe taken between the steps,
train/perf.py PeakMeter). It runs unchanged on a GPU; on a
CPU pass a shorter `--members-list`.

`--shampoo` (`--shampoo-members 3`, `--rounds 30`): Shampoo's train step as members, on the study's
`experiment=study_mega +arm=shampoo` with `optim.preconditioning_every=2
optim.start_preconditioning_step=4` (the overrides after `--` are not applied to it): whether `jax.vmap` of
the step compiles with the default roots (optim.root_dtype=auto: float64 on a CPU), and, in
interleaved rounds, the step of all members as separate steps and as vmap (float32 roots) against
separate steps with float32 roots, and as lax.map (default roots) against separate steps with the
default roots: median times of refresh steps and of the others, the eigendecompositions and
conditionals in each compiled program, and the largest relative difference of train/loss and
train/grad_norm from the separate steps. `--shampoo-hang N` (`--shampoo-hang-steps 100`,
`--shampoo-timeout 180`): N processes each of vmap (float32 roots) and lax.map (default roots),
interleaved, each stopped at the timeout; the timeouts are counted as hangs. These two sections' page
is kept as docs/results/benchmarks/members-shampoo.md (written under $DALLE_ABLATE_RESULTS and copied
there, so that it does not replace members.md): what ShampooConfig.validate (optim/shampoo.py) refuses
under members.impl=vmap rests on it.
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


def members_of(overrides: list[str], members: int) -> tuple:
    """(run of seed 0, the train step's core, each member's initial state, batch and dropout key)
    for seeds 0..members-1 of the config: each member from its own seed's state, on its own batch
    of random tokens."""
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
    batches = [
        {k: jnp.asarray(v) for k, v in random_batch(run.model_cfg, run.cfg.trainer.batch_size, seed=s).items()}
        for s in range(members)
    ]
    return run, core, states, batches, keys


def stacked(states, batches, keys) -> tuple:
    """The members' states, batches and keys with a leading member axis."""
    import jax
    import jax.numpy as jnp

    stack = lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)  # noqa: E731
    return stack(states), stack(batches), jnp.stack(keys)


def programs(core) -> dict:
    """The core three ways: jitted alone (one member), vmapped and lax.mapped over the member axis."""
    import jax

    return {
        "separate": jax.jit(core),
        "vmap": jax.jit(jax.vmap(core)),
        "lax.map": jax.jit(lambda s, b, k: jax.lax.map(lambda a: core(*a), (s, b, k))),
    }


def measure(overrides: list[str], members: int, rounds: int) -> dict:
    import jax.numpy as jnp

    run, core, states, batches, keys = members_of(overrides, members)
    stacked_ = stacked(states, batches, keys)
    fns = programs(core)
    one, c_one = compiled(fns["separate"], states[0], batches[0], keys[0])
    vmapped, c_vmap = compiled(fns["vmap"], *stacked_)
    mapped, c_map = compiled(fns["lax.map"], *stacked_)

    times = {"separate": [], "vmap": [], "lax.map": []}
    for r in range(rounds + 1):  # round 0 warms up
        t = time.perf_counter()
        separate = [loss_of(one, states[i], batches[i], keys[i]) for i in range(members)]
        t1 = time.perf_counter()
        together = loss_of(vmapped, *stacked_)
        t2 = time.perf_counter()
        in_turn = loss_of(mapped, *stacked_)
        t3 = time.perf_counter()
        if r:
            for name, dt in (("separate", t1 - t), ("vmap", t2 - t1), ("lax.map", t3 - t2)):
                times[name].append(dt)
    ref = jnp.stack(separate)
    diff = {
        "vmap": float(jnp.max(jnp.abs(together - ref) / jnp.abs(ref))),
        "lax.map": float(jnp.max(jnp.abs(in_turn - ref) / jnp.abs(ref))),
    }
    return {
        "times": {k: statistics.median(v) for k, v in times.items()},
        "spread": times,
        "compile": {"separate": c_one, "vmap": c_vmap, "lax.map": c_map},
        "diff": diff,
        "batch": run.cfg.trainer.batch_size,
    }


def step_section(overrides: list[str], members: list[int], rounds: int) -> None:
    print("## The train step (--step)\n")
    print(
        "| members | batch per member | program | one step of all members (median ms) | vs separate | "
        "compile (s) | loss vs separate, max relative |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in members:
        r = measure(overrides, m, rounds)
        base = r["times"]["separate"]
        for name in ("separate", "vmap", "lax.map"):
            compile_s = r["compile"][name] * (m if name == "separate" else 1)  # separate runs compile once each
            diff = "0 (itself)" if name == "separate" else f"{r['diff'][name]:.1e}"
            print(
                f"| {m} | {r['batch']} | {name} | {1e3 * r['times'][name]:.1f} | {r['times'][name] / base:.2f} | "
                f"{compile_s:.1f} | {diff} |"
            )
    print(
        f"\n{rounds} interleaved rounds after one warm-up. The compile time of `separate` counts one "
        "compilation per member, as separate runs each compile theirs; a study's persistent compilation cache "
        "(study/runner.py) lets the later runs of an arm load it from disk instead.\n"
    )


# --- whole jobs (--wall) ---------------------------------------------------------------------

JOB = [sys.executable, "-m", "dalle_ablate.job", "experiment=study_mega", "+arm=baseline"]


def run_job(args: list[str], folder: Path, cache: Path) -> float:
    """Run one job process (its output appended to <folder>/job.log); its wall seconds, start to exit."""
    import os
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    command = [
        *JOB,
        *args,
        "tracker=none",
        "resume=null",
        f"hydra.run.dir={folder}/baseline-seed${{seed}}",
        f"hydra.sweep.dir={folder}/multirun",
    ]
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
    return {
        "wall_time": summary["wall_time"],
        "first": first,
        "step": statistics.median(steps) if steps else float("nan"),
    }


def wall_section(
    overrides: list[str], steps_list: list[int], reps: int, impls: list[str], n_seeds: int, cache_mode: str
) -> None:
    from common import offline_workdir

    tmp = offline_workdir("members-wall-")
    seeds = list(range(n_seeds))
    print(f"## Whole jobs (--wall): {n_seeds} separate runs in turn against one members job\n")
    print(
        "| steps | arm | processes | wall (s), start to exit | vs separate | runs' own wall_time (s) | "
        "first step, compile in it (s) | median step (ms) | steps x median (s) | the rest (s) |"
    )
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
                    dts = [
                        run_job(
                            [f"seed={k}", *args], folder, cache if cache_mode == "study" else folder / f"jax_cache{k}"
                        )
                        for k in seeds
                    ]
                    walls[arm].append(sum(dts))
                else:
                    impl = arm.split()[1]
                    walls[arm].append(
                        run_job(
                            [f"seeds=[{','.join(map(str, seeds))}]", f"seed={seeds[0]}", f"members.impl={impl}", *args],
                            folder,
                            cache,
                        )
                    )
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
            print(
                f"| {steps} | {arm} | {n_seeds if arm == 'separate' else 1} | "
                f"{' / '.join(f'{w:.0f}' for w in walls[arm])} | {wall / base:.2f} | {own_s} | {first_s} | {step_ms} | "
                f"{stepping:.0f} | {wall - stepping - first:.0f} |"
            )
    cache_text = (
        "one empty JAX compilation cache per arm and repetition, shared by its processes (the study's own "
        "setting, study/runner.py: the separate seed=0 compiles, seeds 1.. load from disk)"
        if cache_mode == "study"
        else "an empty JAX compilation cache per process"
    )
    print(
        f"\n{reps} repetition(s), the arms interleaved; wall is each repetition's (separate: the sum of its "
        f"{n_seeds} processes), `vs separate` the median's ratio. Each job: `experiment=study_mega +arm=baseline "
        f"trainer.steps=S tracker=none resume=null`, its folders fresh under a temp folder ({tmp}); {cache_text}. "
        "`runs' own wall_time` is each run store's summary (from the job's start inside the process, so the "
        "process's imports are not in it); `first step` the time to the first logged step, its compilation in it; "
        "`median step` the run's median logged step (members: the whole program's step, all members); "
        "`the rest` = wall - steps x median - first step: start-up, validation, the sampling evaluation, "
        "checkpoints, the slower steps. The dataset cache (data.cache_dir) was warm for every job."
    )
    if 1500 not in steps_list and len(steps_list):
        near = min(steps_list, key=lambda s: abs(s - 1500))
        for arm in [a for a in results if a[0] == near and a[1] != "separate"]:
            r = results[arm]
            # study_mega.yaml's budget: its 48 runs 123 min in turn, then the stress runs about 46 min.
            print(
                f"\nDerived, not measured ({arm[1]} at {near} steps): if every arm's seeds took {r:.2f}x of their "
                f"separate runs' wall, the study's 48 runs of 1500 steps (123 min in turn, study_mega.yaml) would "
                f"take {123 * r:.0f} min and the whole study with its stress runs (about 46 min, not members) "
                f"{123 * r + 46:.0f} min against 169: {169 / (123 * r + 46):.2f}x faster. Other arms (shampoo, "
                "adafactor) and 1500 steps were not measured here."
            )
    print()


# --- the train step on an accelerator (--accelerator) -------------------------------------------


def accelerator_section(overrides: list[str], members_list: list[int], rounds: int, dtype: str) -> None:
    import jax
    import jax.numpy as jnp

    from dalle_ablate.data import abstract_sizes
    from dalle_ablate.model.flops import train_flops_per_example
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.gradients import GradientOptions
    from dalle_ablate.train.perf import PeakMeter, device_peak_flops, mfu
    from dalle_ablate.train.step import train_step_core
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose([*overrides, f"model.dtype={dtype}", "seed=0"]))
    run = assemble(cfg, sizes=abstract_sizes(cfg.data, cfg.model), devices=jax.devices()[:1])
    core = train_step_core(run.graphdef, run.optimizer, run.schedule, GradientOptions.of(run.cfg))
    batch_size = cfg.trainer.batch_size
    flops = train_flops_per_example(run.model_cfg) * batch_size  # one member's step
    tokens = run.tokens_per_step
    # an accelerator's peak is its datasheet's; a CPU's is measured here, between the steps it divides
    peak, source = device_peak_flops()
    meter = PeakMeter(jax.devices()[0].device_kind) if source.startswith("probe:") else None
    state = run.init_state()
    key = jax.random.fold_in(jax.random.key(cfg.seed), 2)
    one_batch = {k: jnp.asarray(v) for k, v in random_batch(run.model_cfg, batch_size, seed=0).items()}
    one, c_one = compiled(jax.jit(core), state, one_batch, key)

    def timed(fn, *args) -> float:
        t = time.perf_counter()
        loss_of(fn, *args)
        return time.perf_counter() - t

    def round_(*args) -> tuple[float, float]:
        times = timed(one, state, one_batch, key), timed(*args)
        if meter is not None:
            meter.sample()
        return times

    measured, ones = [], []
    for m in members_list:
        stack = lambda x: jax.tree.map(lambda a: jnp.stack([a] * m), x)  # noqa: E731  same start: the cost is alike
        batches = {k: jnp.asarray(v) for k, v in random_batch(run.model_cfg, batch_size * m, seed=m).items()}
        batches = jax.tree.map(lambda a: a.reshape(m, batch_size, *a.shape[1:]), batches)
        args = (stack(state), batches, jax.random.split(key, m))
        vmapped, c = compiled(jax.jit(jax.vmap(core)), *args)
        pairs = [round_(vmapped, *args) for _ in range(rounds + 1)][1:]  # interleaved
        t1, dt = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        ones += [p[0] for p in pairs]
        measured.append((m, dt, t1, c))
        del args, batches, vmapped
    if meter is not None:
        peak, source = meter.peak, meter.source
    t_one = statistics.median(ones)
    print("## The train step on one device, M members against one run (--accelerator)\n")
    print(
        f"Device: {jax.devices()[0].device_kind} ({jax.default_backend()}); peak {peak / 1e12:.3g} TFLOP/s ({source}); "
        f"model {cfg.model.dtype}, batch {batch_size} per member, {tokens} tokens and {flops / 1e9:.2f} GFLOP "
        "per member step.\n"
    )
    print("| members | program | step of all members (median ms) | tokens/s | vs one run | MFU | compile (s) |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| 1 run | jit(core) | {1e3 * t_one:.1f} | {tokens / t_one:,.0f} | 1.00 | "
        f"{mfu(flops / t_one, peak, source):.2%} | {c_one:.1f} |"
    )
    for m, dt, t1, c in measured:
        print(
            f"| {m} | vmap(core) | {1e3 * dt:.1f} | {m * tokens / dt:,.0f} | {m * tokens / dt / (tokens / t1):.2f} | "
            f"{mfu(m * flops / dt, peak, source):.2%} | {c:.1f} |"
        )
    print(
        f"\nMedian of {rounds} steps after a warm-up, each waited for, the one run's step and the members' "
        "interleaved; `vs one run` is tokens/s against the one run's steps interleaved with that row's. Every member starts from the same state on its own random batch (the "
        "cost does not depend on the values)."
    )
    if jax.default_backend() == "cpu":
        print(
            "Measured on the CPU: no GPU was lent to this task, so the accelerator numbers (1, 4, 16, 64 "
            "members on a GPU) were not measured here; the section runs unchanged on one: "
            "`python benchmarks/members.py --accelerator`."
        )
    print()


# --- Shampoo as members (--shampoo) -------------------------------------------------------------

# The study's Shampoo arm, refreshing its roots every other step and preconditioning from step 4, so
# that a few rounds hold refreshes and the preconditioned update alike.
SHAMPOO_EVERY, SHAMPOO_START = 2, 4
SHAMPOO = [
    "experiment=study_mega",
    "+arm=shampoo",
    "tracker=none",
    f"optim.preconditioning_every={SHAMPOO_EVERY}",
    f"optim.start_preconditioning_step={SHAMPOO_START}",
]
ROOTS = {"default": "optim.root_dtype=auto", "float32": "optim.root_dtype=float32"}


def hlo_counts(exe) -> str:
    """'eighs / conditionals' in a compiled program's HLO: the eigendecomposition calls (LAPACK's
    or cuSOLVER's syevd) and the conditionals that can skip them."""
    import re

    text = exe.as_text()
    eighs = sum(1 for line in text.splitlines() if re.search(r'custom_call_target="[^"]*(syev|eigh)', line))
    return f"{eighs} / {text.count(' conditional(')}"


def shampoo_step_section(members: int, rounds: int) -> None:
    import jax
    import numpy as np

    print(f"## Shampoo as members (--shampoo): {members} seeds\n")
    sets = {roots: members_of([*SHAMPOO, override], members) for roots, override in ROOTS.items()}
    _, core, states, batches, keys = sets["default"]
    try:
        programs(core)["vmap"].lower(*stacked(states, batches, keys)).compile()
        traced = "it compiles"
    except Exception as e:  # noqa: BLE001  the error is the measurement
        traced = f"it does not: `{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}`"
    print(f"`jax.vmap` of the train step with the default roots (optim.root_dtype=auto, float64 on a CPU): {traced}\n")

    # Four arms, each threading its own states: separate (3 x jit) and one members program per root dtype.
    arms = {}  # name -> (roots, program, executable, states, compile seconds)
    for roots, program in (
        ("float32", "separate"),
        ("float32", "vmap"),
        ("default", "separate"),
        ("default", "lax.map"),
    ):
        _, core, states, batches, keys = sets[roots]
        fn = programs(core)[program]
        if program == "separate":
            exe, c = compiled(fn, states[0], batches[0], keys[0])
            arms[(program, roots)] = [exe, list(states), c * members]
        else:
            exe, c = compiled(fn, *stacked(states, batches, keys))
            arms[(program, roots)] = [exe, stacked(states, batches, keys)[0], c]
    _, _, _, batches, keys = sets["default"]  # the same batches and keys in both sets
    stacked_bk = stacked(states, batches, keys)[1:]

    times = {arm: {True: [], False: []} for arm in arms}
    metrics = {arm: {"train/loss": [], "train/grad_norm": []} for arm in arms}
    steps = []
    for r in range(SHAMPOO_START + rounds):  # the first SHAMPOO_START rounds (graft only) warm up
        step = int(arms[("separate", "default")][1][0].step)
        refresh = step % SHAMPOO_EVERY == 0  # scale_by_shampoo.refresh_if_due, count before the step
        steps.append(step)
        for arm, entry in arms.items():  # interleaved: each arm's step of all members in turn
            exe, state = entry[0], entry[1]
            t = time.perf_counter()
            if arm[0] == "separate":
                out = [exe(state[i], batches[i], keys[i]) for i in range(members)]
                jax.block_until_ready([m["train/loss"] for _, m in out])
                entry[1] = [s for s, _ in out]
                got = {k: [float(m[k]) for _, m in out] for k in metrics[arm]}
            else:
                state, m = exe(state, *stacked_bk)
                jax.block_until_ready(m["train/loss"])
                entry[1] = state
                got = {k: [float(x) for x in m[k]] for k in metrics[arm]}
            dt = time.perf_counter() - t
            if r >= SHAMPOO_START:
                times[arm][refresh].append(dt)
            for k, v in got.items():
                metrics[arm][k].append(v)
    assert steps == list(range(len(steps))), steps

    def rel(arm, ref, key):
        a, b = np.array(metrics[arm][key]), np.array(metrics[ref][key])
        return float(np.max(np.abs(a - b) / np.abs(b)))

    print(
        "| program | roots | refresh step of all members (median ms) | other step (median ms) | mean of the two | "
        "vs separate, same roots | compile (s) | eighs / conditionals in its HLO | train/loss vs separate, max relative | "
        "train/grad_norm vs separate, max relative |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm, entry in arms.items():
        program, roots = arm
        ref = ("separate", roots)
        med = {k: statistics.median(v) for k, v in times[arm].items()}
        mean = (med[True] + med[False]) / 2
        base = (statistics.median(times[ref][True]) + statistics.median(times[ref][False])) / 2
        diffs = (
            ("0 (itself)", "0 (itself)")
            if program == "separate"
            else tuple(f"{rel(arm, ref, k):.1e}" for k in ("train/loss", "train/grad_norm"))
        )
        print(
            f"| {program}{f' x{members}' if program == 'separate' else ''} | {roots} | {1e3 * med[True]:.1f} | "
            f"{1e3 * med[False]:.1f} | {1e3 * mean:.1f} | {mean / base:.2f} | {entry[2]:.1f} | {hlo_counts(entry[0])} | "
            f"{diffs[0]} | {diffs[1]} |"
        )
    n_refresh, n_other = len(times[("separate", "default")][True]), len(times[("separate", "default")][False])
    print(
        f"\n`experiment=study_mega +arm=shampoo optim.preconditioning_every={SHAMPOO_EVERY} "
        f"optim.start_preconditioning_step={SHAMPOO_START}`; roots `default` is optim.root_dtype=auto (float64 here), "
        f"`float32` optim.root_dtype=float32, the only roots vmap compiles with. {rounds} interleaved rounds of the "
        f"four arms ({n_refresh} refresh steps, {n_other} others: a refresh is a step whose count before it is a "
        f"multiple of {SHAMPOO_EVERY}) after {SHAMPOO_START} warm-up rounds (the graft-only steps); each arm threads "
        f"its own states, each member from its seed's state on its own batch. `mean of the two` is a step's "
        f"average at this period. The compile time of `separate` counts one compilation per member. The relative "
        f"differences are over all {len(steps)} steps and all members, against the separate steps with the "
        f"same roots. `eighs / conditionals`: the eigendecomposition custom calls and the conditionals in the "
        f"compiled program (under vmap the refresh's lax.cond becomes a select, so its eighs run at every step).\n"
    )


def shampoo_hang_child(program: str, members: int, steps: int) -> None:
    """One process's run for --shampoo-hang: the members of the Shampoo arm under `program` (vmap with
    float32 roots, lax.map with the default ones) for `steps` steps; a line per step, flushed, and
    a RESULT line of JSON at the end."""
    import json

    import jax

    roots = "float32" if program == "vmap" else "default"
    _, core, states, batches, keys = members_of([*SHAMPOO, ROOTS[roots]], members)
    state, b, k = stacked(states, batches, keys)
    exe, c = compiled(programs(core)[program], state, b, k)
    print(f"compiled {c:.1f} s", flush=True)
    times = {True: [], False: []}
    for i in range(steps):
        t = time.perf_counter()
        state, m = exe(state, b, k)
        jax.block_until_ready(m["train/loss"])
        times[i % SHAMPOO_EVERY == 0].append(time.perf_counter() - t)
        print(f"step {i} done at {time.time():.3f}", flush=True)
    print(
        "RESULT "
        + json.dumps(
            {
                "compile": c,
                "refresh": statistics.median(times[True][1:] or times[True]),
                "other": statistics.median(times[False]),
                "loss": [float(x) for x in m["train/loss"]],
            }
        ),
        flush=True,
    )


def shampoo_hang_section(members: int, n: int, steps: int, timeout: float) -> None:
    import json
    import os
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="members-shampoo-hang-"))
    print(
        f"## Shampoo members, hangs (--shampoo-hang {n}): {members} seeds, {n} runs of each program, {steps} steps, {timeout:.0f} s each\n"
    )
    print(
        "| program | roots | run | exit | wall (s) | compile (s) | steps done | refresh step (median ms) | "
        "other step (median ms) | seconds since its last step when stopped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    hangs = {"vmap": 0, "lax.map": 0}
    env = {**os.environ, "DALLE_ABLATE_RESULTS": "-"}  # a child writes no page
    for i in range(n):
        for program in ("vmap", "lax.map"):  # interleaved
            log_path = tmp / f"{program}-{i}.log"
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--shampoo-hang-child",
                program,
                "--shampoo-members",
                str(members),
                "--shampoo-hang-steps",
                str(steps),
            ]
            with open(log_path, "w") as log:
                t = time.perf_counter()
                child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                try:
                    code = child.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                    code = None
                stopped, wall = time.time(), time.perf_counter() - t
            lines = log_path.read_text().splitlines()
            done = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
            result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
            if code is None:
                hangs[program] += 1
            elif code:
                raise SystemExit(f"{' '.join(command)} exited with {code}; see {log_path}")
            ms = (lambda key: f"{1e3 * result[key]:.0f}") if result else (lambda key: "-")
            compile_s = next((line.split()[1] for line in lines if line.startswith("compiled ")), "-")
            print(
                f"| {program} | {'float32' if program == 'vmap' else 'default'} | {i + 1} | "
                f"{'timeout' if code is None else code} | {wall:.0f} | {compile_s} | {len(done)} of {steps} | "
                f"{ms('refresh')} | {ms('other')} | {f'{stopped - done[-1]:.0f}' if code is None and done else '-'} |"
            )
    print(
        f"\nHangs (runs stopped at the {timeout:.0f} s timeout): vmap {hangs['vmap']} of {n}, lax.map "
        f"{hangs['lax.map']} of {n}. Each run is its own process (`benchmarks/members.py --shampoo-hang-child "
        f"PROGRAM`): {members} members of `{' '.join(SHAMPOO[:2])}` with the section's period and start, vmap with "
        f"float32 roots (the default ones do not compile under it), lax.map with the default roots; compile "
        f"and {steps} steps, each waited for. A timeout whose last step was long before it was stopped is a hang; "
        f"one still stepping is a slow run. Logs under {tmp}.\n"
    )


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
    ap.add_argument("--shampoo", action="store_true", help="Shampoo's train step as members: vmap, lax.map, separate")
    ap.add_argument("--shampoo-members", type=int, default=3)
    ap.add_argument(
        "--shampoo-hang",
        type=int,
        default=0,
        metavar="N",
        help="N processes each of vmap and lax.map Shampoo members, counting timeouts",
    )
    ap.add_argument("--shampoo-hang-steps", type=int, default=100)
    ap.add_argument("--shampoo-timeout", type=float, default=180)
    ap.add_argument("--shampoo-hang-child", choices=["vmap", "lax.map"], help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.shampoo_hang_child:
        return shampoo_hang_child(args.shampoo_hang_child, args.shampoo_members, args.shampoo_hang_steps)
    if not (args.step or args.wall or args.accelerator or args.shampoo or args.shampoo_hang):
        args.step = True
    overrides = ["experiment=study_mega", "+arm=baseline", "tracker=none", *args.overrides]
    if args.step:
        step_section(overrides, args.members, args.rounds)
    if args.accelerator:
        accelerator_section(overrides, args.members_list, args.accel_rounds, args.dtype)
    if args.wall:
        wall_section(args.overrides, args.steps, args.reps, args.impls, args.seeds, args.cache)
    if args.shampoo:
        shampoo_step_section(args.shampoo_members, args.rounds)
    if args.shampoo_hang:
        shampoo_hang_section(args.shampoo_members, args.shampoo_hang, args.shampoo_hang_steps, args.shampoo_timeout)


if __name__ == "__main__":
    main()
