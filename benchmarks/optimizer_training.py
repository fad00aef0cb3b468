"""Training comparison of Adam, Adafactor and Shampoo on the shapes task (size=small unless
overridden, e.g. `size=tiny`): each optimizer's learning rate is picked from a x3 grid around its
default on the first seed, the best rate is run on the other seeds, and the best runs are compared
by eval loss after the same number of steps and after the same training time, mean over seeds
with a Student's t 95 % interval.

    python benchmarks/optimizer_training.py [--seeds 0 1 2] [--out DIR] [--read] [overrides...]

Runs `python run.py -m experiment=optim_compare optim=<name> optim.lr=<grid> seed=<first>` once per
optimizer (tracker=none) into DIR/<name>/<job>, then `... optim.lr=<best> seed=<rest>` into
DIR/<name>-seeds/<job>, and prints the tables from the run stores; `--read` only prints them from
runs already in DIR. "Training time" is the sum of the logged step times: compile, evaluation and
checkpointing are excluded, so it is what each optimizer costs per unit of progress on this
machine; the equal-time budget is the shortest mean run. Nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import writes_page  # noqa: E402

GRIDS = {"adam": (3e-4, 1e-3, 3e-3), "adafactor": (3e-3, 1e-2, 3e-2), "shampoo": (3e-4, 1e-3, 3e-3)}


def curves(run_dir: Path) -> tuple[list[tuple[int, float, float]], float]:
    """([(step, training seconds so far, eval loss)], final eval loss) of one run store."""
    from dalle_ablate.track.runstore import read_metrics

    elapsed, points = 0.0, []
    for row in read_metrics(run_dir):
        elapsed += row.get("perf/step_time", 0.0)
        if "eval/valid/loss" in row:
            points.append((row["step"], elapsed, row["eval/valid/loss"]))
    return points, points[-1][2] if points else float("nan")


def loss_at_time(points: list[tuple[int, float, float]], budget: float) -> tuple[int, float]:
    """(step, eval loss) of the last evaluation whose training time is within the budget."""
    within = [(s, loss) for s, t, loss in points if t <= budget * (1 + 1e-9)]
    return within[-1] if within else (0, float("nan"))


def runs_in(folder: Path) -> list[tuple[float, int, float, list]]:
    """(lr, seed, final eval loss, curve) of every run store under folder."""
    import yaml

    out = []
    for run_dir in sorted(folder.glob("*/run")):
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        points, final = curves(run_dir)
        out.append((cfg["optim"]["lr"], cfg["seed"], final, points))
    return out


def sweep(out: Path, name: str, lrs: str, seeds: str, overrides: list[str]) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "-m",
        "experiment=optim_compare",
        f"optim={name}",
        f"optim.lr={lrs}",
        f"seed={seeds}",
        "tracker=none",
        "trainer.progress=false",
        f"hydra.sweep.dir={out}",
        *overrides,
    ]
    print("running", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def best_lr(runs) -> float | None:
    finite = [r for r in runs if r[2] == r[2]]
    return min(finite, key=lambda r: r[2])[0] if finite else None


@writes_page("Optimizers trained over a learning-rate grid")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="multirun/optimizer_training")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="the grid runs on the first")
    ap.add_argument("--read", action="store_true", help="only print the tables from runs in --out")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    first, rest = args.seeds[0], args.seeds[1:]
    for name, grid in GRIDS.items():
        if not args.read:
            sweep(out / name, name, ",".join(f"{lr:g}" for lr in grid), str(first), args.overrides)
        lr = best_lr(runs_in(out / name))
        if not args.read and rest and lr is not None:
            sweep(out / f"{name}-seeds", name, f"{lr:g}", ",".join(map(str, rest)), args.overrides)

    from dalle_ablate.stats.basic import mean_ci

    print(f"grid, seed {first}")
    print(f"{'optimizer':<10}{'lr':>8}{'eval loss':>11}{'train s':>9}")
    best = {}
    for name in GRIDS:
        grid = runs_in(out / name)
        for lr, _, final, points in grid:
            print(f"{name:<10}{lr:>8g}{final:>11.4f}{points[-1][1] if points else float('nan'):>9.1f}")
        lr = best_lr(grid)
        if lr is not None:
            best[name] = (lr, [r for r in grid + runs_in(out / f"{name}-seeds") if r[0] == lr and r[3]])
    if not best:
        sys.exit(f"no finished runs under {out}")
    steps = max(r[3][-1][0] for _, runs in best.values() for r in runs)
    budget = min(float(np.mean([r[3][-1][1] for r in runs])) for _, runs in best.values())
    print(
        f"\nbest learning rate per optimizer, mean over seeds [95 % t interval]; equal steps = {steps}, "
        f"equal time = {budget:.1f} s of training (the fastest optimizer's mean run)"
    )
    print(
        f"{'optimizer':<10}{'lr':>8}{'seeds':>6}{'loss @ steps':>26}{'s/step':>8}{'loss @ time':>26}{'step reached':>14}"
    )
    for name, (lr, runs) in best.items():
        at_steps = mean_ci([r[2] for r in runs])
        at_time = [loss_at_time(r[3], budget) for r in runs]
        t_mean = mean_ci([loss for _, loss in at_time])
        per_step = np.mean([r[3][-1][1] / r[3][-1][0] for r in runs])
        reached = "/".join(str(s) for s, _ in at_time)
        print(f"{name:<10}{lr:>8g}{len(runs):>6}{fmt(at_steps):>26}{per_step:>8.2f}{fmt(t_mean):>26}{reached:>14}")


def fmt(ci: tuple[float, float, float]) -> str:
    return f"{ci[0]:.4f} [{ci[1]:.3f}, {ci[2]:.3f}]"


if __name__ == "__main__":
    main()
