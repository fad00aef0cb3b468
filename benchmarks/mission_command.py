"""The mission's command, `python run.py -m model=normformer,deepnet optim=<name>`, as a user types
it, for Adam and then Shampoo in one sitting: wall time of each whole command (start-up, data,
compile, training, evaluation, W&B offline), the ratio, and per run the eval loss, the summed step
times, the share of step time spent in root-refresh steps, and Shampoo's root-failure rate.

    python benchmarks/mission_command.py [--out DIR] [--read] [overrides...]

Run it from a separate `git worktree` (Hydra re-reads conf/ for every job). `--read` prints the
table from the runs already in DIR (the wall times are kept in DIR/<optim>/wall_s). One run, this
machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import offline_workdir, writes_page  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adam", "shampoo")


def run_summary(run_dir: Path) -> dict:
    from dalle_ablate.track.runstore import read_metrics

    every = yaml.safe_load((run_dir / "config.yaml").read_text())["optim"].get("preconditioning_every")
    rows = read_metrics(run_dir)
    steps = [(r["step"], r["perf/step_time"]) for r in rows if "perf/step_time" in r]
    total = sum(t for _, t in steps)
    # The step logged as s ran count s - 1; Shampoo refreshes its roots at counts 0, every, 2 every, ...
    refresh = sum(t for s, t in steps if (s - 1) % every == 0) / max(total, 1e-9) if every else None
    evals = [r["eval/valid/loss"] for r in rows if "eval/valid/loss" in r]
    rates = [r["optim/shampoo/failed_root_rate"] for r in rows if "optim/shampoo/failed_root_rate" in r]
    return {
        "step_s": total,
        "refresh_share": refresh,
        "eval": evals[-1] if evals else float("nan"),
        "failed": rates[-1] if rates else None,
    }


@writes_page("The mission command's runs")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="multirun/mission_command")
    ap.add_argument("--read", action="store_true", help="only print the table from runs in --out")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    if not args.read:
        offline_workdir("mission_")
        for name in OPTIMIZERS:
            cmd = [
                sys.executable,
                str(ROOT / "run.py"),
                "-m",
                "model=normformer,deepnet",
                f"optim={name}",
                f"hydra.sweep.dir={out / name}",
                *args.overrides,
            ]
            print("running", " ".join(cmd[2:]), file=sys.stderr, flush=True)
            t = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, check=True)
            (out / name / "wall_s").write_text(f"{time.perf_counter() - t:.1f}\n")

    walls = {name: float((out / name / "wall_s").read_text()) for name in OPTIMIZERS}
    print(
        f"{'optimizer':<10}{'model':<12}{'wall s':>8}{'x adam':>8}{'step s':>8}{'refresh share':>15}"
        f"{'failed roots':>14}{'eval loss':>11}"
    )
    for name in OPTIMIZERS:
        for i, run_dir in enumerate(sorted((out / name).glob("*/run"))):
            layout = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["layout"]
            s = run_summary(run_dir)
            wall = f"{walls[name]:>8.0f}{walls[name] / walls['adam']:>8.2f}" if i == 0 else " " * 16
            failed = "" if s["failed"] is None else f"{100 * s['failed']:.2f} %"
            share = "" if s["refresh_share"] is None else f"{100 * s['refresh_share']:.0f} %"
            print(f"{name:<10}{layout:<12}{wall}{s['step_s']:>8.0f}{share:>15}{failed:>14}{s['eval']:>11.4f}")


if __name__ == "__main__":
    main()
