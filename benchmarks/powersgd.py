"""PowerSGD ranks against uncompressed data parallelism on 8 fake CPU devices: floats all-reduced
per step (read from the compiled HLO, and from shapes), step time, and the loss after training
the default tiny model on the built-in data.

    python benchmarks/powersgd.py [--ranks null,1,4,16] [--steps 300] [overrides...]

The devices are fake: 8 XLA host devices sharing this machine's cores, so an all-reduce costs a
memory copy, not a network transfer; the step time shows PowerSGD's extra compute (two matmuls
and a QR per matrix), not the bandwidth it saves. The bytes column is what a real interconnect
would carry. One run, this machine; nothing here is asserted by the tests.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import offline_workdir, writes_page  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "f64": 8, "s64": 8}


def all_reduce_bytes(hlo: str) -> tuple[int, int]:
    """(bytes every device all-reduces on every step, bytes all-reduced only inside conditional
    branches): the result shapes of each all-reduce (or all-reduce-start) of the compiled module.
    The conditional one is PowerSGD's exact-error measurement, taken on logging steps only."""
    computations, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if head:
            current = head.group(1)
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    called = {
        c: set(
            re.findall(
                r"%[\w.\-]+",
                " ".join(
                    re.findall(
                        r"(?:calls|to_apply|branch_computations|body|condition)=(\{[^}]*\}|%[\w.\-]+)", "\n".join(lines)
                    )
                ),
            )
        )
        & computations.keys()
        for c, lines in computations.items()
    }
    branch = set()
    todo = [
        c
        for lines in computations.values()
        for line in lines
        if "conditional(" in line
        for c in re.findall(r"%[\w.\-]+", re.search(r"branch_computations=\{([^}]*)\}", line).group(1))
    ]
    while todo:
        c = todo.pop()
        if c not in branch:
            branch.add(c)
            todo.extend(called.get(c, ()))
    every, conditional = 0, 0
    for name, lines in computations.items():
        for line in lines:
            m = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
            if not m:
                continue
            n_bytes = 0
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                n = 1
                for d in filter(None, dims.split(",")):
                    n *= int(d)
                n_bytes += n * DTYPE_BYTES.get(dtype, 4)
            if name in branch:
                conditional += n_bytes
            else:
                every += n_bytes
    return every, conditional


@writes_page("PowerSGD: compression, error and step time")
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="null,1,4,16")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    offline_workdir("powersgd-bench-")

    import jax
    import numpy as np

    from dalle_ablate.optim import traffic
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.validate import compose, to_run_config

    print(f"{jax.device_count()} devices; {args.steps} steps each")
    rows, dataset = [], None
    for rank in args.ranks.split(","):
        cfg = to_run_config(
            compose(["mesh.data=8", f"optim.powersgd.rank={rank}", f"trainer.steps={args.steps}", *args.overrides])
        )
        run = assemble(cfg, dataset=dataset)
        dataset = run.dataset
        state, step = run.init_state(), run.train_step()
        b = cfg.trainer.batch_size
        batches = dataset.train_batches(b, cfg.seed)
        first = run.placement.global_batch(next(batches), b)
        hlo = step.lower(state, first).compile().as_text()
        floats = traffic(state.params, cfg.optim.powersgd.rank, cfg.optim.powersgd.exclude)
        times, losses, rel_error = [], [], float("nan")
        state, m = step(state, first)
        for i in range(1, args.steps):
            batch = run.placement.global_batch(next(batches), b)
            t = time.perf_counter()
            state, m = step(state, batch)
            losses.append(float(m["train/loss"]))  # waits for the step
            times.append(time.perf_counter() - t)
            if "comm/powersgd_rel_error" in m and i % cfg.trainer.log_every == cfg.trainer.log_every - 1:
                rel_error = float(m["comm/powersgd_rel_error"])  # measured on logging steps only
        from dalle_ablate.train.hooks import evaluate
        from dalle_ablate.train.step import make_eval_step

        eval_loss = float(
            evaluate(make_eval_step(run.graphdef, run.placement), state.params, dataset, b, None, run.placement)[0]
        )
        rows.append(
            (
                rank,
                *all_reduce_bytes(hlo),
                4 * floats["sent"],
                floats["full"] / floats["sent"],
                statistics.median(times),
                float(np.mean(losses[-20:])),
                eval_loss,
                float(rel_error),
            )
        )
    base = rows[0][5]
    print(
        "| rank | all-reduce B/step (HLO) | B/step (shapes) | + on log steps (HLO) | compression | step ms | × first row | "
        "train loss (last 20) | eval loss | rel. error of the mean (last log step) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rank, hlo_b, cond_b, shape_b, comp, t, loss, ev_loss, rel in rows:
        print(
            f"| {rank} | {hlo_b:,} | {shape_b:,} | {cond_b:,} | {comp:.1f}× | {1000 * t:.1f} | {t / base:.2f} | {loss:.3f} | "
            f"{ev_loss:.3f} | {rel:.3f} |"
        )


if __name__ == "__main__":
    main()
