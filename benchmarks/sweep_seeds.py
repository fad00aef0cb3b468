"""Seeds per Optuna trial against one seed per trial (issue 52): a learning-rate sweep of the tiny
model (`sweeps=lr_adam`, Adam over [1e-4, 1e-2] log, median pruning) run as 12 trials of one seed
and as 4 trials of 3 seeds (members of one job) -- 12 training runs each, so about equal CPU time,
measured -- repeated on fresh sampler and training seeds, each sweep's best two re-checked on 3
fresh seeds. A dense reference grid (8 rates x 8 seeds) says which rates are within the seed noise
of the best. Prints, per kind of sweep: how often its pick is within the reference's noise of the
best rate, the pick's regret on the reference curve, and the winner's curse (the sweep's best
value minus its re-checked mean).

    python benchmarks/sweep_seeds.py --train --runs studies/sweep-seeds   # the runs (resumable), then the analysis
    python benchmarks/sweep_seeds.py --runs studies/sweep-seeds           # the analysis only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The plan, declared before any of its runs (2026-11-27). The budget: 60 steps of the tiny model,
# an evaluation every 20 (the median pruner from step 20 on); no sampling evaluation and one
# sample at the end -- the sweep's objective is the eval loss, and the sampling evaluation would
# cost more than the training.
TRAIN = [
    "sweeps=lr_adam",
    "trainer.steps=60",
    "trainer.eval_every=20",
    "tracker=none",
    "eval.metrics=[]",
    "eval.grids=[]",
    "samples.per_caption=1",
    "samples.captions=[a red circle]",
]
SWEEP = ["hydra.sweeper.pruner.kwargs.n_warmup_steps=20", "hydra.sweeper.recheck.top=2"]
GRID = [float(x) for x in 10 ** np.linspace(-4, -2, 8)]  # the reference rates, log-spaced over the sweep's interval
REF_SEEDS = list(range(100, 108))  # 8 seeds each, members of one job per rate
REPS = 3  # repetitions of each kind of sweep, each on its own sampler seed, training seeds and re-check seeds
KINDS = {"1 seed x 12 trials": 12, "3 seeds x 4 trials": 4}
# A pick is "within the seed noise of the best" when its rate's reference mean (interpolated in
# log rate between grid points) is above the best grid mean by at most TOL_SE standard errors of a
# difference of two reference means (sqrt(2) s / sqrt(8), s the pooled one-seed sd).
TOL_SE = 2.0


def seeds_of(kind: str, rep: int) -> list[str]:
    if kind.startswith("1 seed"):
        return [f"seed={200 + rep}"]
    first = 300 + 3 * rep
    return [f"seeds=[{first},{first + 1},{first + 2}]", f"seed={first}"]


def run(cmd: list[str], env: dict) -> float:
    """Run a command; the CPU seconds it and its children used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def train(runs: Path) -> None:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(runs / "jax_cache"), "WANDB_MODE": "offline"}
    cpu_file = runs / "cpu.json"
    cpu = json.loads(cpu_file.read_text()) if cpu_file.exists() else {}
    for i, lr in enumerate(GRID):
        folder = runs / "reference" / f"lr{i}"
        if not (folder / "members.json").exists() or "running" in (folder / "members.json").read_text():
            run(
                [
                    sys.executable,
                    str(ROOT / "run.py"),
                    *TRAIN,
                    f"optim.lr={lr}",
                    f"seeds=[{','.join(map(str, REF_SEEDS))}]",
                    f"seed={REF_SEEDS[0]}",
                    "resume=auto",
                    f"hydra.run.dir={folder}",
                ],
                env,
            )
    for rep in range(REPS):
        for kind, trials in KINDS.items():
            folder = runs / f"{'one' if kind.startswith('1') else 'three'}-rep{rep}"
            if (folder / "optimization_results.yaml").exists() and str(folder) in cpu:
                continue
            cpu[str(folder)] = run(
                [
                    sys.executable,
                    str(ROOT / "run.py"),
                    "-m",
                    *TRAIN,
                    *SWEEP,
                    *seeds_of(kind, rep),
                    f"hydra.sweeper.n_trials={trials}",
                    f"hydra.sweeper.sampler.seed={rep}",
                    f"hydra.sweeper.recheck.seeds=[{1000 + 10 * rep},{1001 + 10 * rep},{1002 + 10 * rep}]",
                    f"hydra.sweep.dir={folder}",
                ],
                env,
            )
            cpu_file.write_text(json.dumps(cpu, indent=2))


def reference(runs: Path) -> tuple[np.ndarray, float]:
    """Each grid rate's mean eval loss over the reference seeds, and the pooled one-seed sd."""
    table = []
    for i in range(len(GRID)):
        members = json.loads((runs / "reference" / f"lr{i}" / "members.json").read_text())["members"]
        table.append(
            [json.loads((Path(m["job_dir"]) / "run" / "summary.json").read_text())["eval/valid/loss"] for m in members]
        )
    t = np.array(table)
    return t.mean(axis=1), float(np.sqrt(t.var(axis=1, ddof=1).mean()))


def on_curve(means: np.ndarray, lr: float) -> float:
    return float(np.interp(math.log10(lr), np.log10(GRID), means))


@writes_page("Seeds per sweep trial against one seed per trial")
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=Path, required=True, help="the folder of the runs")
    p.add_argument("--train", action="store_true", help="train what is missing first (resumable)")
    a = p.parse_args()
    if a.train:
        train(a.runs)
    meta = json.loads((a.runs / "reference" / "lr0" / f"seed{REF_SEEDS[0]}" / "run" / "meta.json").read_text())
    print(
        f"runs trained at commit {meta['git']['commit'][:7]}{' + uncommitted changes' if meta['git']['dirty'] else ''}"
    )
    means, s = reference(a.runs)
    tol = TOL_SE * math.sqrt(2) * s / math.sqrt(len(REF_SEEDS))
    best = float(means.min())
    print(
        f"reference: {len(GRID)} rates x {len(REF_SEEDS)} seeds, {TRAIN[1:3]}; one-seed sd {s:.4f}; best rate "
        f"{GRID[int(means.argmin())]:.3g} at {best:.4f}; a pick within the seed noise of the best: at most {tol:.4f} "
        f"above it ({TOL_SE:g} se of a difference of two reference means)"
    )
    print("rate      " + " ".join(f"{lr:9.3g}" for lr in GRID))
    print("mean loss " + " ".join(f"{m:9.4f}" for m in means))
    print()
    cpu = json.loads((a.runs / "cpu.json").read_text())
    print(
        f"{'sweep':<20} {'rep':>3} {'pick':>9} {'regret':>8} {'hit':>4} {'sweep value':>11} {'re-checked':>10} "
        f"{'curse':>8} {'CPU s':>7}  best vs runner-up"
    )
    rows = {}
    for kind in KINDS:
        for rep in range(REPS):
            folder = a.runs / f"{'one' if kind.startswith('1') else 'three'}-rep{rep}"
            r = yaml.safe_load((folder / "optimization_results.yaml").read_text())
            lr = float(r["best"]["params"]["optim.lr"])
            regret = on_curve(means, lr) - best
            if "trials" not in r.get("recheck", {}):  # the re-check failed (its reason in the results file)
                print(f"{kind:<20} {rep:>3} {lr:9.3g} re-check failed: {r.get('recheck', {}).get('failed')}")
                continue
            rc = r["recheck"]["trials"][0]
            swept = rc.get("sweep_mean", rc["sweep_value"])  # the mean statistic: the same
            curse = swept - rc["recheck_mean"]
            rows.setdefault(kind, []).append((regret, regret <= tol, curse, cpu[str(folder)]))
            print(
                f"{kind:<20} {rep:>3} {lr:9.3g} {regret:8.4f} {'yes' if regret <= tol else 'no':>4} "
                f"{swept:11.4f} {rc['recheck_mean']:10.4f} {curse:+8.4f} {cpu[str(folder)]:7.0f}  "
                f"{r['recheck']['against'][0]['outcome']}"
            )
    print()
    print(
        f"{'sweep':<20} {'reps':>4} {'within noise':>12} {'mean regret':>11} {'winner curse mean (sd)':>23} {'CPU s':>7}"
    )
    for kind, got in rows.items():
        g = np.array(got, dtype=float)
        print(
            f"{kind:<20} {len(g):>4} {int(g[:, 1].sum()):>7} of {len(g):<2} {g[:, 0].mean():11.4f} "
            f"{g[:, 2].mean():+14.4f} ({g[:, 2].std(ddof=1):.4f}) {g[:, 3].mean():7.0f}"
        )


if __name__ == "__main__":
    main()
