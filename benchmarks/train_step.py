"""Training speed per size: tokens/s, MFU, and the harness overhead.

    python benchmarks/train_step.py [--sizes tiny small] [--steps 40] [overrides...]

For each size it runs the real training loop (data iterator, per-step metric fetch, run store,
offline W&B, progress bar off) and, on the same batch, the bare jitted step timed alone. The
overhead is the loop's median step time over the bare step's median, minus one. Everything is
measured in this one run, on this machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import fresh_train_step, offline_workdir, timed_steps, writes_page  # noqa: E402


def bare_step_times(cfg, dataset, steps: int) -> list[float]:
    import jax

    step, state, _ = fresh_train_step(cfg, dataset)
    batch = jax.device_put(next(dataset.train_batches(cfg.trainer.batch_size, cfg.seed)))
    return timed_steps(step, state, batch, steps)[1]


@writes_page("Training speed per size")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    tmp = offline_workdir("bench-")

    from dalle_ablate.validate import compose
    from dalle_ablate.data import build_dataset
    from dalle_ablate.track.runstore import read_metrics
    from dalle_ablate.train.loop import JobInfo, train
    from dalle_ablate.validate import to_run_config

    rows = []
    for size in args.sizes:
        steps = args.steps
        cfg = to_run_config(
            compose(
                [
                    f"size={size}",
                    f"trainer.steps={steps}",
                    f"trainer.eval_every={10 * steps}",
                    f"trainer.save_every={10 * steps}",
                    "trainer.log_every=10",
                    "trainer.progress=false",
                    "schedule.allow_long_warmup=true",  # a throughput run: the rate never matters
                    "samples.per_caption=1",
                    *args.overrides,
                ]
            )
        )
        dataset = build_dataset(cfg.data, cfg.model)
        # Bare step timed before and after the loop, so drift in machine load is seen by both.
        bare = bare_step_times(cfg, dataset, steps // 2)
        res = train(cfg, JobInfo(tmp / size))
        bare += bare_step_times(cfg, dataset, steps // 2)
        metrics = [r for r in read_metrics(res.run_dir) if "perf/step_time" in r]
        # The last step also waits for the final eval and checkpoint: leave it out.
        loop = [r["perf/step_time"] for r in metrics[:-1]]
        tokens = metrics[0]["perf/tokens_per_s"] * metrics[0]["perf/step_time"]
        loop_med, bare_med = statistics.median(loop), statistics.median(bare)
        # none where the run found its peak below its step (train/perf.py mfu): its log says why
        mfus = [r["perf/mfu"] for r in metrics[:-1] if "perf/mfu" in r]
        mfu = statistics.median(mfus) if mfus else float("nan")
        rows.append(
            (
                size,
                cfg.trainer.batch_size,
                tokens / loop_med,
                mfu,
                bare_med * 1e3,
                loop_med * 1e3,
                loop_med / bare_med - 1,
            )
        )

    import json

    meta = json.loads((res.run_dir / "meta.json").read_text())
    print(
        f"device: {meta['device']['kind']} x{meta['device']['count']}, peak {meta['device']['peak_flops'] / 1e9:.1f} GFLOP/s "
        f"({meta['device']['peak_flops_source']}), {args.steps} steps per size\n"
    )
    print(
        f"{'size':<6} {'batch':>5} {'tokens/s':>10} {'MFU':>6} {'bare step ms':>13} {'loop step ms':>13} {'overhead':>9}"
    )
    for size, bs, tps, mfu, bare, loop, over in rows:
        print(f"{size:<6} {bs:>5} {tps:>10,.0f} {mfu:>6.1%} {bare:>13.1f} {loop:>13.1f} {over:>+9.1%}")


if __name__ == "__main__":
    main()
