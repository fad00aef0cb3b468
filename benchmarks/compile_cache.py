"""JAX's persistent compilation cache (issue 62): the default job's start-up, its whole run, and a
3-seed multirun, each with the cache cold (an empty folder, or `compilation_cache.dir=null`) against
warm (the folder a run before filled). The data cache (rendered data, fitted tokenizer) is filled
first, so only compiling differs. Cold and warm alternate, so that the machine's load falls on
both alike.

    python benchmarks/compile_cache.py                # all three (about 40 minutes on 2 cores)
    python benchmarks/compile_cache.py --skip-full    # without the whole default job twice

Time to first step: from the start of `python run.py` to the first row of its metrics.jsonl (step
1, written as step 2 starts), after which the run is stopped.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["tracker=none", "trainer.progress=false"]
# The multirun: the README's first ablation, one layout, three seeds (100 steps each).
MULTIRUN = ["-m", "seed=0,1,2", "experiment=quick", "eval.num_samples=32", "eval.guidance_scales=[1,3]"]


def run_py(args: list[str], cache: str | None, folder: Path, wait_first_step: bool = False) -> dict:
    """`python run.py args` with the compilation cache at `cache` (None: off); its wall time, or
    with `wait_first_step` the time to its first metrics row (then it is stopped)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    where = [f"hydra.sweep.dir={folder}"] if args[:1] == ["-m"] else [f"hydra.run.dir={folder}"]
    cmd = [sys.executable, "run.py", *args, *QUIET, f"compilation_cache.dir={cache or 'null'}", *where]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if wait_first_step:
        metrics = folder / "run" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            if proc.poll() is not None:
                raise SystemExit(f"{' '.join(cmd)} ended before its first step: {proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        took = time.perf_counter() - t
        # Stopped at once: nothing compiles between the first steps (validation's programs come at step 500),
        # so no cache entry is cut short; SIGINT could be ignored (a background job of a shell).
        proc.kill()
        proc.wait(timeout=120)
        return {"s": took}
    err = proc.communicate()[1]
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    took = time.perf_counter() - t
    stores = sorted(folder.glob("**/run/meta.json"))
    compiled = [json.loads(p.read_text()).get("compilation", {}) for p in stores]
    return {"s": took, "compilation": compiled}


def row(name: str, cold: list[float], warm: list[float]) -> str:
    c, w = statistics.median(cold), statistics.median(warm)
    each = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(cold, warm))
    return f"| {name} | {c:.1f} | {w:.1f} | {w / c:.2f} | {c / w:.2f}x | {each} |"


def compiled_line(label: str, stats: list[dict]) -> str:
    parts = [
        f"compiled {s.get('compiled')} in {s.get('compile_s')} s, loaded {s.get('loaded')} in {s.get('load_s')} s, "
        f"traced {s.get('trace_s')} s"
        for s in stats
    ]
    return f"- {label}: " + "; ".join(parts)


@writes_page("Compile once: JAX's persistent compilation cache")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="pairs of the time to first step (cold, warm)")
    ap.add_argument("--multirun-reps", type=int, default=2, help="pairs of the 3-seed multirun (off, on)")
    ap.add_argument("--skip-full", action="store_true", help="leave out the whole default job, cold and warm")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compile-cache-bench-"))
    print(f"work folder {work}; data cache as the runs find it (filled first)")
    short = ["trainer.steps=2", "schedule.warmup_steps=1", "eval.metrics=[]", "eval.grids=[]"]
    for i, preset in enumerate([[], ["experiment=quick"]]):  # their data and tokenizers, before any timing
        run_py([*preset, *short], None, work / f"fill{i}")

    first = {"cold": [], "warm": []}
    for i in range(args.reps):
        cache = str(work / f"first{i}")
        first["cold"].append(run_py([], cache, work / f"first{i}-cold", wait_first_step=True)["s"])
        first["warm"].append(run_py([], cache, work / f"first{i}-warm", wait_first_step=True)["s"])
    multi = {"off": [], "on": []}
    stats = {}
    for i in range(args.multirun_reps):
        off = run_py(MULTIRUN, None, work / f"multi{i}-off")
        on = run_py(MULTIRUN, str(work / f"multi{i}"), work / f"multi{i}-on")
        multi["off"].append(off["s"])
        multi["on"].append(on["s"])
        stats.setdefault("multirun, cache off (each seed)", off["compilation"])
        stats.setdefault("multirun, cache on from empty (each seed)", on["compilation"])
    full = {"cold": [], "warm": []}
    if not args.skip_full:
        cache = str(work / "full")
        for kind in ("cold", "warm"):
            res = run_py([], cache, work / f"full-{kind}")
            full[kind].append(res["s"])
            stats[f"default job, {kind} cache"] = res["compilation"]

    print()
    print("| what | cold (s) | warm (s) | warm/cold | speed-up | each pair, cold/warm (s) |")
    print("|---|---|---|---|---|---|")
    print(row("default job: time to first step", first["cold"], first["warm"]))
    if full["cold"]:
        print(row("default job: whole run (2000 steps, evaluated)", full["cold"], full["warm"]))
    print(row("3-seed multirun (experiment=quick), cache off / on", multi["off"], multi["on"]))
    print()
    print("Medians; 'cold' is an empty cache folder (the multirun: the cache off). Where each run's start-up went, ")
    print("from its meta.json (`compilation`):")
    print()
    for label, s in stats.items():
        print(compiled_line(label, s))


if __name__ == "__main__":
    main()
