"""Time to quality: how caption-following grows with training time for the default job.

    python benchmarks/time_to_quality.py [--seeds 0 1 2] [--every 500] [--out time_to_quality] [overrides...]

Trains the default config once per seed (the real loop, `python run.py` with these overrides),
with the sampling evaluation every `--every` steps, and prints for each seed, step and difficulty
tier the all-correct rate with its 95% Wilson interval at every guidance scale against the
training seconds so far (the compile step and the train steps; evaluation, checkpoints and set-up
are excluded and reported separately). Writes `<out>.csv` and `<out>.png` (all-correct of each
tier against training seconds at the best scale of the last evaluation, one line per seed).
Times are this machine's: compare rows of one run, not across machines.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import offline_workdir, writes_page  # noqa: E402

TIERS = ("one", "two", "three", "relation")


def rows_of(run_dir: Path, seed: int) -> tuple[list[dict], float, float]:
    """(one row per evaluation, scale and tier; training seconds; everything else in seconds)."""
    import json

    from dalle_ablate.track.runstore import read_metrics

    metrics = read_metrics(run_dir)
    train_s, at_step, rows = 0.0, {}, []
    for r in metrics:
        train_s += r.get("perf/step_time", 0.0) + r.get("perf/compile_time", 0.0)
        at_step[r["step"]] = train_s
    for r in metrics:
        for key, value in r.items():
            # eval/pareto/s<scale>/shapes/<tier>/all
            parts = key.split("/")
            if len(parts) == 6 and parts[:2] == ["eval", "pareto"] and parts[3] == "shapes" and parts[5] == "all":
                scale, tier = float(parts[2][1:]), parts[4]
                base = f"eval/pareto/s{parts[2][1:]}/shapes/{tier}"
                rows.append(
                    {
                        "seed": seed,
                        "step": r["step"],
                        "train_s": round(at_step[r["step"]], 1),
                        "scale": scale,
                        "tier": tier,
                        "all": value,
                        "lo": r[f"{base}/all_lo"],
                        "hi": r[f"{base}/all_hi"],
                        "n": int(r[f"{base}/n"]),
                    }
                )
    wall = json.loads((run_dir / "summary.json").read_text())["wall_time"]
    return rows, train_s, wall - train_s


@writes_page("Caption-following against training time")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--every", type=int, default=500, help="steps between evaluations")
    ap.add_argument("--out", default="time_to_quality")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    tmp = offline_workdir("ttq-")

    from dalle_ablate.validate import compose
    from dalle_ablate.train.loop import JobInfo, train
    from dalle_ablate.validate import to_run_config

    rows, times, run_dirs = [], [], {}
    for seed in args.seeds:
        cfg = to_run_config(
            compose([f"seed={seed}", f"eval.every={args.every}", "trainer.progress=false", *args.overrides])
        )
        res = train(cfg, JobInfo(tmp / f"seed{seed}"))
        run_dirs[seed] = res.run_dir
        got, train_s, other_s = rows_of(res.run_dir, seed)
        rows += got
        times.append((seed, res.steps, train_s, other_s))

    print(f"{'seed':>4} {'steps':>6} {'train s':>8} {'eval+other s':>13}")
    for seed, steps, train_s, other_s in times:
        print(f"{seed:>4} {steps:>6} {train_s:>8.1f} {other_s:>13.1f}")
    scales = sorted({r["scale"] for r in rows})
    print(
        f"\nall-correct per tier, [95% Wilson interval], by guidance scale (N per tier: {rows[0]['n'] if rows else 0})"
    )
    print(f"{'seed':>4} {'step':>5} {'train s':>8} {'scale':>5} " + " ".join(f"{t:>18}" for t in TIERS))
    for seed in args.seeds:
        for step in sorted({r["step"] for r in rows if r["seed"] == seed}):
            for scale in scales:
                cell = {r["tier"]: r for r in rows if r["seed"] == seed and r["step"] == step and r["scale"] == scale}
                if not cell:
                    continue
                t_s = next(iter(cell.values()))["train_s"]
                print(
                    f"{seed:>4} {step:>5} {t_s:>8.1f} {scale:>5g} "
                    + " ".join(
                        f"{cell[t]['all']:>6.1%} [{cell[t]['lo']:.2f},{cell[t]['hi']:.2f}]"
                        if t in cell
                        else f"{'-':>18}"
                        for t in TIERS
                    )
                )

    resolution(run_dirs)

    out = Path(args.out)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["seed", "step", "train_s", "scale", "tier", "all", "lo", "hi", "n"])
        w.writeheader()
        w.writerows(rows)
    plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")


def power(n: int, psi: float, delta: float = 0.1, z_alpha: float = 1.959964) -> float:
    """Power of McNemar's test (two-sided, alpha 0.05) to find a difference `delta` in a rate
    between two runs over n paired prompts whose verdicts differ on a share `psi` of them
    (Connor 1987, normal approximation)."""
    from scipy.stats import norm

    if psi <= delta**2:
        return 1.0
    return float(norm.cdf((delta * n**0.5 - z_alpha * psi**0.5) / (psi - delta**2) ** 0.5))


def resolution(run_dirs: dict) -> None:
    """The evaluation's resolution, measured: for each pair of seeds, at each scale of the last
    evaluation, the share of prompts whose all-correct verdicts differ (psi) and the power of
    McNemar's test for a 0.1 difference at this N; psi = 0.5 (verdicts independent, rates near
    one half) is the worst case."""
    import itertools
    import json

    last = {}
    for seed, d in run_dirs.items():
        tables = sorted((Path(d) / "tables").glob("eval_pareto_*.json"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        if tables:
            t = json.loads(tables[-1].read_text())
            c = t["columns"]
            if "shapes/verdicts" in c:
                last[seed] = {r[c.index("scale")]: r[c.index("shapes/verdicts")] for r in t["rows"]}
    if len(last) < 2:
        return
    print(
        "\nresolution of the last evaluation: prompts whose all-correct differs between two seeds (psi), and "
        "McNemar's power for a 0.1 difference at this N (psi = 0.5 is the worst case)"
    )
    for a, b in itertools.combinations(sorted(last), 2):
        for scale in sorted(set(last[a]) & set(last[b])):
            x, y = last[a][scale], last[b][scale]
            psi = sum(p != q for p, q in zip(x, y)) / len(x)
            print(
                f"seeds {a}-{b} s{scale:g}: N {len(x)}, rates {x.count('1') / len(x):.3f} / {y.count('1') / len(y):.3f}, "
                f"psi {psi:.3f}, power {power(len(x), psi):.2f} (worst case {power(len(x), 0.5):.2f})"
            )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r["step"] for r in rows)
    # the scale whose last evaluation is best on average over seeds and tiers
    scales = sorted({r["scale"] for r in rows})
    best = max(scales, key=lambda s: sum(r["all"] for r in rows if r["step"] == last and r["scale"] == s))
    fig, axes = plt.subplots(1, len(TIERS), figsize=(4 * len(TIERS), 3.4), sharey=True)
    for ax, tier in zip(axes, TIERS):
        for seed in sorted({r["seed"] for r in rows}):
            pts = sorted(
                (r["train_s"], r["all"], r["lo"], r["hi"])
                for r in rows
                if r["seed"] == seed and r["tier"] == tier and r["scale"] == best
            )
            if pts:
                xs, ys, lo, hi = zip(*pts)
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]],
                    marker="o",
                    capsize=3,
                    label=f"seed {seed}",
                )
        ax.set_title(f"{tier} (scale {best:g})")
        ax.set_xlabel("training seconds (this machine)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("all-correct (95% Wilson)")
    axes[0].set_ylim(0, 1)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
