"""The study's train step and the quickstart's against the levers on them (issue 74), interleaved.

    python benchmarks/step_levers.py [--rounds 3] [--steps 10] [--only NAME ...]

Each lever runs in a child process of its own (the device count and XLA_FLAGS are fixed when JAX
starts); every round starts each lever's child in turn, so the levers share the machine's moments
alike. A child builds the trainer's own program (train/program.py `program_for`) for the study's
preset and arm, steps it on the run's own batches, and prints its median step, the members' losses
after the last step (to tell the levers that keep a run's numbers from those that move them) and
the machine's float32 peak measured between its steps (train/perf.py PeakMeter), which its MFU
divides by. The compile is not timed (a shared persistent cache, warmed by round 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import writes_page  # noqa: E402

STUDY = ["experiment=study_mega", "+arm=baseline", "tracker=none"]
MEMBERS = [*STUDY, "seeds=[0,1,2,3]", "members.impl=map"]  # what a study's members job runs (study/jobs.py)
QUICKSTART = ["tracker=none"]  # `python run.py`'s model, batch and optimizer
BF16 = ["model.dtype=bfloat16"]
# name ("kind: lever") -> (overrides, CPU devices, steps per dispatch); each kind's "(today)" its baseline
WARMUP = 5  # steps before the timing, in every child alike (a multiple of every steps per dispatch)
LEVERS = {
    "study: 4 members, lax.map, 1 device (today)": ([*MEMBERS], 1, 1),
    "study: vmap": ([*MEMBERS, "members.impl=vmap"], 1, 1),
    "study: 2 devices, 2 members each (mesh.member=2)": ([*MEMBERS, "mesh.member=2"], 2, 1),
    "study: 5 steps per dispatch (lax.scan)": ([*MEMBERS], 1, 5),
    "study: mesh.member=2 and 5 steps per dispatch": ([*MEMBERS, "mesh.member=2"], 2, 5),
    "study: bfloat16 compute (model.dtype)": ([*MEMBERS, *BF16], 1, 1),
    "study: mesh.member=2 and bfloat16": ([*MEMBERS, "mesh.member=2", *BF16], 2, 1),
    "quickstart: one run, 1 device (today)": ([*QUICKSTART], 1, 1),
    "quickstart: batch split over 2 devices (mesh.data=2)": ([*QUICKSTART, "mesh.data=2"], 2, 1),
    "quickstart: bfloat16 compute (model.dtype)": ([*QUICKSTART, *BF16], 1, 1),
}


def child(overrides: list[str], per_dispatch: int, steps: int) -> dict:
    """One lever's measurement in this process: its program's step, timed between peak probes."""
    import types

    import jax
    import numpy as np

    from dalle_ablate.config import member_config
    from dalle_ablate.model.flops import train_flops_per_example
    from dalle_ablate.train.logger import Chunk
    from dalle_ablate.train.loop import dispatcher
    from dalle_ablate.train.perf import PeakMeter
    from dalle_ablate.train.program import program_for
    from dalle_ablate.validate import compose, to_run_config

    cfg = to_run_config(compose(overrides))
    cfgs = [member_config(cfg, s) for s in cfg.seeds] if cfg.seeds is not None else [cfg]
    program = program_for(cfg, cfgs)
    state = program.init([types.SimpleNamespace(state=None) for _ in cfgs])
    it = program.batches(0)
    batch = lambda: program.placement.global_batch(next(it), cfg.trainer.batch_size)  # noqa: E731
    dispatch = dispatcher(program, per_dispatch)  # the trainer's own: K steps in one lax.scan program
    batches = lambda: [batch() for _ in range(per_dispatch)]  # noqa: E731

    def step(state, got):
        state, dispatched = dispatch(state, got, 0)
        metrics = dispatched[-1][1]
        return state, metrics.metrics if isinstance(metrics, Chunk) else metrics

    def loss(metrics):
        return np.asarray(jax.device_get(metrics["train/loss"])).reshape(-1, len(cfgs))[-1]

    for _ in range(WARMUP // per_dispatch):  # compile (or load), then warm up
        state, metrics = step(state, batches())
        loss(metrics)
    meter, times = PeakMeter(jax.devices()[0].device_kind), []
    for _ in range(3):  # rounds of steps, a peak probe between them
        meter.sample()
        for _ in range(steps // per_dispatch):
            b = batches()
            t = time.perf_counter()
            state, metrics = step(state, b)
            last = loss(metrics)
            times.append((time.perf_counter() - t) / per_dispatch)
    meter.sample()
    step_s = statistics.median(times)
    flops = train_flops_per_example(program.run.model_cfg) * cfg.trainer.batch_size * len(cfgs)
    return {
        "step_ms": 1e3 * step_s,
        "losses": [repr(float(x)) for x in last],
        "steps": int(jax.device_get(state.step).max()),
        "gflops": flops / 1e9,
        "peak": meter.peak,
        "peak_source": meter.source,
        "devices": jax.device_count(),
    }


def run_child(name: str, steps: int, cache: Path) -> dict:
    overrides, devices, per_dispatch = LEVERS[name]
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    spec = json.dumps({"overrides": overrides, "per_dispatch": per_dispatch, "steps": steps})
    proc = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: its child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@writes_page("The study's step and the quickstart's: the levers")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every lever's child, after a warm-up round")
    ap.add_argument("--steps", type=int, default=10, help="steps a child times in each of its 3 stints")
    ap.add_argument("--only", nargs="+", choices=list(LEVERS), help="these levers (and their baselines) only")
    args = ap.parse_args()
    if any(args.steps % k for _, _, k in LEVERS.values()):
        raise SystemExit(f"--steps {args.steps}: must be a multiple of every lever's steps per dispatch (5)")
    names = [n for n in LEVERS if not args.only or n in args.only or n.endswith("(today)")]
    got: dict = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="step-levers-cache-") as cache:
        for r in range(args.rounds + 1):  # round 0 fills the compile cache and the data cache
            for n in names:
                out = run_child(n, args.steps, Path(cache))
                if r:
                    got[n].append(out)
    report(got, args)


def report(got: dict, args) -> None:
    base = {n.split(":")[0]: n for n in got if n.endswith("(today)")}
    print(
        f"{args.rounds} rounds, each lever's child in turn; in each child 3 stints of {args.steps} steps "
        "with the float32 matmul probe between them. `step` is the median over a lever's rounds of each "
        "child's median step (one step of every member; with K steps per dispatch, the dispatch over K); "
        "`vs today` its baseline's median over the lever's, rounds paired. MFU: the step's FLOPs "
        "(model/flops.py, 3x the forward matmuls) over the best probe of the same child.\n"
    )
    print("| lever | devices | step (ms) | vs today | GFLOP per step | GFLOP/s | MFU | same losses as today |")
    print("|---|---|---|---|---|---|---|---|")
    for n, outs in got.items():
        kind = n.split(":")[0]
        ref = got[base[kind]]
        med = statistics.median(o["step_ms"] for o in outs)
        ratio = statistics.median(b["step_ms"] / o["step_ms"] for b, o in zip(ref, outs))
        o = outs[-1]
        rate = o["gflops"] / (med / 1e3)
        same = "(itself)" if n == base[kind] else ("yes, bit for bit" if o["losses"] == ref[-1]["losses"] else "no")
        print(
            f"| {n} | {o['devices']} | {med:.1f} | {ratio:.2f}x | {o['gflops']:.2f} | {rate:.0f} | "
            f"{100 * rate * 1e9 / max(x['peak'] for x in outs):.0f} % | {same} |"
        )
    print("\nThe members' losses after each lever's last child's steps:\n")
    for n, outs in got.items():
        print(f"- {n}: {', '.join(outs[-1]['losses'])}")
    peaks = [o["peak"] / 1e9 for outs in got.values() for o in outs]
    print(
        f"\nThe probes' best per child: {min(peaks):.0f}-{max(peaks):.0f} GFLOP/s ({got[next(iter(got))][-1]['peak_source']})."
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # one lever's process (run_child): no page of its own
        spec = json.loads(sys.argv[2])
        print(json.dumps(child(spec["overrides"], spec["per_dispatch"], spec["steps"])))
    else:
        main()
