"""Training comparison of Adam, Adafactor and Shampoo on the shapes task at size=small: each
optimizer's learning rate is picked from a x3 grid around its default, then the best runs are
compared by eval loss after the same number of steps and after the same training time.

    python benchmarks/optimizer_training.py [--out DIR] [--read] [overrides...]

Runs `python run.py -m experiment=optim_compare optim=<name> optim.lr=<grid>` once per optimizer
(tracker=none) into DIR/<name>/<job>, then prints the table from the run stores; `--read` only
prints it from runs already in DIR. "Training time" is the sum of the logged step times: compile,
evaluation and checkpointing are excluded, so it is what each optimizer costs per unit of progress
on this machine. Nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="multirun/optimizer_training")
    ap.add_argument("--read", action="store_true", help="only print the table from runs in --out")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    if not args.read:
        for name, grid in GRIDS.items():
            lrs = ",".join(f"{lr:g}" for lr in grid)
            cmd = [sys.executable, str(ROOT / "run.py"), "-m", "experiment=optim_compare", f"optim={name}",
                   f"optim.lr={lrs}", "tracker=none", "trainer.progress=false", f"hydra.sweep.dir={out / name}",
                   *args.overrides]
            print("running", " ".join(cmd[2:]), file=sys.stderr, flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)

    import yaml

    best = {}
    print(f"{'optimizer':<10}{'lr':>8}{'eval loss':>11}{'train s':>9}")
    for name in GRIDS:
        runs = []
        for run_dir in sorted((out / name).glob("*/run")):
            lr = yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"]
            points, final = curves(run_dir)
            runs.append((final, lr, points))
            print(f"{name:<10}{lr:>8g}{final:>11.4f}{points[-1][1] if points else float('nan'):>9.1f}")
        finite = [r for r in runs if r[0] == r[0]]
        if finite:
            best[name] = min(finite, key=lambda r: r[0])
    if not best:
        sys.exit(f"no finished runs under {out}")
    steps = {name: points[-1][0] for name, (_, _, points) in best.items()}
    budget = min(points[-1][1] for _, _, points in best.values())
    print(f"\nbest learning rate per optimizer; equal steps = {max(steps.values())}, equal time = {budget:.1f} s "
          "of training (the fastest optimizer's whole run)")
    print(f"{'optimizer':<10}{'lr':>8}{'loss @ steps':>14}{'s/step':>8}{'loss @ time':>13}{'step reached':>14}")
    for name, (final, lr, points) in best.items():
        step_t, loss_t = loss_at_time(points, budget)
        print(f"{name:<10}{lr:>8g}{final:>14.4f}{points[-1][1] / points[-1][0]:>8.2f}{loss_t:>13.4f}{step_t:>14}")


if __name__ == "__main__":
    main()
