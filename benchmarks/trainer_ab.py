"""The trainer's step time before and after a change: a plain run and one job of N members under
each `members.impl`, trained by two versions of the code, interleaved.

    python benchmarks/trainer_ab.py --before COMMIT [--after COMMIT] [--pairs 3] [--steps 60] [--members 3]
        [-- overrides...]

Each version is the tree of a commit (`git archive`; `--after` left out: this working tree). A pair
runs every job once with each version, the order alternating from pair to pair (before first,
then after first), so that the machine's load falls on both alike. A job is `python -m
dalle_ablate.job` of the default job (`size=tiny`) for `--steps` steps with `tracker=none`, no
evaluation, no sample grid and no checkpoint before the last step, in a fresh folder, with that
version first on the path: the plain run (`seed=0`), and `seeds=[0..N-1]` under `members.impl=map`
and `vmap`. Its step time is the median of the run store's `perf/step_time` (a members job's:
`perf/job_step_time`, the whole step of all its members) over its steps but the first (compile)
and the last. The table gives each version's median over the pairs and the median of the pairs'
ratios after / before: the change is within noise where that ratio is within the spread of the
pairs' ratios around 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import writes_page  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tree(ref: str | None, into: Path) -> Path:
    """The code of commit `ref` extracted under `into` (None: this working tree)."""
    if ref is None:
        return ROOT
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def step_time(code: Path, job_dir: Path, steps: int, extra: list[str], overrides: list[str]) -> float:
    """The median step time (s) of one job trained by the code under `code`."""
    args = [
        "size=tiny",
        f"trainer.steps={steps}",
        "trainer.progress=false",
        "tracker=none",
        "eval.metrics=[]",
        "eval.grids=[]",
        f"trainer.eval_every={steps}",
        f"trainer.save_every={steps}",
        "trainer.log_every=10",
        "schedule.allow_long_warmup=true",
        *extra,
        *overrides,
        f"hydra.run.dir={job_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(
        [sys.executable, "-m", "dalle_ablate.job", *args],
        cwd=code,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{code}: {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    stores = sorted(p.parent for p in job_dir.rglob("metrics.jsonl"))
    key = "perf/job_step_time" if len(stores) > 1 else "perf/step_time"
    rows = [json.loads(line) for line in (stores[0] / "metrics.jsonl").read_text().splitlines() if line]
    times = [r[key] for r in rows if key in r and r["step"] < steps]
    return statistics.median(times)


@writes_page("The trainer before and after a change")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit before the change")
    ap.add_argument("--after", default=None, help="the commit after it (default: this working tree)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trainer-ab-"))
    codes = {"before": tree(args.before, tmp / "before"), "after": tree(args.after, tmp / "after")}
    seeds = "[" + ",".join(str(k) for k in range(args.members)) + "]"
    jobs = {
        "plain run": ["seed=0"],
        f"{args.members} members, map": [f"seeds={seeds}", "members.impl=map"],
        f"{args.members} members, vmap": [f"seeds={seeds}", "members.impl=vmap"],
    }
    got: dict[tuple[str, str], list[float]] = {}
    runs = 0  # each job in a folder of its own
    for pair in range(args.pairs):
        order = ("before", "after") if pair % 2 == 0 else ("after", "before")
        for job, extra in jobs.items():
            for side in order:
                runs += 1
                t = step_time(codes[side], tmp / f"{side}-{runs}", args.steps, extra, args.overrides)
                got.setdefault((job, side), []).append(t)
                print(f"pair {pair + 1}, {job}, {side}: {t * 1e3:.1f} ms", flush=True)
    print(
        f"\nbefore: {args.before}; after: {args.after or 'this working tree'}; {args.pairs} pairs of {args.steps} steps, "
        f"size=tiny, order alternating\n"
    )
    print(f"{'job':<18} {'before ms':>10} {'after ms':>9} {'after / before':>15} {'pairs':>22}")
    for job in jobs:
        before, after = got[job, "before"], got[job, "after"]
        ratios = [a / b for a, b in zip(after, before)]
        print(
            f"{job:<18} {statistics.median(before) * 1e3:>10.1f} {statistics.median(after) * 1e3:>9.1f} "
            f"{statistics.median(ratios):>15.3f} {' '.join(f'{r:.3f}' for r in ratios):>22}"
        )


if __name__ == "__main__":
    main()
