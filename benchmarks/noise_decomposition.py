"""Where the study's seed noise comes from (issue 50): the study's baseline and two arms of very
different seed spreads (post-LN, the least spread on the study page; Sandwich-LN, the most) trained
as the study trains them (experiment=study_mega, 1500 steps) on seeds no study page used, crossing
the initialisation (init via each member's seed) with the data order (data_seed), an evaluation
every 100 steps and the last checkpoints kept; then each run's final checkpoint scored example by
example on the valid split and on a larger set of fresh scenes. Prints, per arm and for the
paired differences of the arms, how much of one run's variance each source is: the
initialisation, the data order (two-way ANOVA, their interaction with the residual), the
evaluation set (the runs x examples interaction over N examples), and the checkpoint (the final
evaluation against the mean of the last ones).

    python benchmarks/noise_decomposition.py --train --runs studies/noise-decomposition   # ~1.5 h on 2 cores
    python benchmarks/noise_decomposition.py --runs studies/noise-decomposition           # the analysis only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import writes_page  # noqa: E402

# The plan, declared before any of its runs (2026-11-27): fresh seeds, init x data crossed.
INIT = {"baseline": [1000, 1001, 1002, 1003], "postln": [1000, 1001, 1002], "sandwich": [1000, 1001, 1002]}
DATA = {"baseline": [2000, 2001, 2002, 2003], "postln": [2000, 2001, 2002], "sandwich": [2000, 2001, 2002]}
COMMON = [
    "experiment=study_mega",
    "members.impl=map",
    "trainer.eval_every=100",
    "trainer.save_every=100",
    "trainer.keep_checkpoints=6",
    "tracker=none",
    "resume=auto",
]
FRESH = 8192  # scenes scored example by example (the valid split's 512 are its first)
# Declared after the plan above ran, before its analysis: a 2x budget (3000 steps, the same linear
# decay to 0) for baseline and sandwich at three of the inits and one data order -- does training
# past the late learners' catching up cut the noise more than twice the seeds would (sqrt 2)?
LONG = {"arms": ["baseline", "sandwich"], "inits": [1000, 1001, 1002], "data": 2000, "steps": 3000}


def train(runs: Path) -> None:
    """Every (arm, data order) one job whose members are the initialisations (members of one job,
    each the run `seed=k` with `data_seed` fixed); a finished job is left as it is."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(runs / "jax_cache")}
    for arm, inits in INIT.items():
        for d in DATA[arm]:
            cmd = [
                sys.executable,
                "-m",
                "dalle_ablate.job",
                "-m",
                *COMMON,
                f"+arm={arm}",
                f"seeds=[{','.join(map(str, inits))}]",
                f"seed={inits[0]}",
                f"data_seed={d}",
                f"hydra.sweep.dir={runs / f'{arm}-d{d}'}",
            ]
            subprocess.run(cmd, check=True, env=env)


def train_long(runs: Path) -> None:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(runs / "jax_cache")}
    for arm in LONG["arms"]:
        cmd = [
            sys.executable,
            "-m",
            "dalle_ablate.job",
            "-m",
            "experiment=study_mega",
            "members.impl=map",
            f"trainer.steps={LONG['steps']}",
            "trainer.eval_every=100",
            "trainer.save_every=500",
            "trainer.keep_checkpoints=1",
            "tracker=none",
            "resume=auto",
            f"+arm={arm}",
            f"seeds=[{','.join(map(str, LONG['inits']))}]",
            f"seed={LONG['inits'][0]}",
            f"data_seed={LONG['data']}",
            f"hydra.sweep.dir={runs / long_dir(arm)}",
        ]
        subprocess.run(cmd, check=True, env=env)


def long_dir(arm: str) -> str:
    return f"long-{arm}-d{LONG['data']}"


def long_finals(runs: Path) -> dict[str, dict[int, float]]:
    """arm -> init -> final eval loss of the 3000-step runs that finished."""
    out: dict[str, dict[int, float]] = {}
    for arm in LONG["arms"]:
        for i in LONG["inits"]:
            store = runs / long_dir(arm) / f"{arm}-seed{i}" / "run"
            summary = store / "summary.json"
            if summary.exists() and json.loads(summary.read_text()).get("status") == "finished":
                ev = evaluations(store)
                out.setdefault(arm, {})[i] = ev[max(ev)]
    return out


def stores(runs: Path) -> list[dict]:
    """(arm, init, data, store) of every finished run under `runs`."""
    out = []
    for arm, inits in INIT.items():
        for d in DATA[arm]:
            for i in inits:
                store = runs / f"{arm}-d{d}" / f"{arm}-seed{i}" / "run"
                summary = store / "summary.json"
                if summary.exists() and json.loads(summary.read_text()).get("status") == "finished":
                    out.append({"arm": arm, "init": i, "data": d, "store": store})
    return out


def evaluations(store: Path) -> dict[int, float]:
    """step -> eval/valid/loss, from the run's metrics."""
    rows = [json.loads(line) for line in (store / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): float(r["eval/valid/loss"]) for r in rows if "eval/valid/loss" in r}


def per_example(store: Path, n: int) -> np.ndarray:
    """The final checkpoint's mean NLL per image token of each of `n` valid scenes (the split's
    scenes are the first of the same stream), float64; cached beside the run store."""
    cache = store.parent / f"examples_{n}.npy"
    if cache.exists():
        return np.load(cache)
    import jax
    from flax import nnx

    from dalle_ablate.data.shapes import generate_split
    from dalle_ablate.model import token_nll
    from dalle_ablate.train import checkpoint
    from dalle_ablate.train.assembly import assemble
    from dalle_ablate.train.eval_checkpoint import restore, run_config_for_eval

    meta = json.loads((store / "meta.json").read_text())
    cfg = run_config_for_eval(store, meta["overrides"], [])
    run = assemble(cfg, dtype="float32")
    ckpt_dir, _ = checkpoint.find_checkpoints(str(store))
    step, state = restore(ckpt_dir, None, run.abstract_state())
    ds = run.dataset
    specs, images = generate_split(dataclass_replace(cfg.data, num_valid=n), "valid")
    captions = [s["caption"] for s in specs]
    assert captions[: len(ds.captions["valid"])] == ds.captions["valid"], "the fresh scenes must extend the valid split"
    codes = ds.tokenizer.encode(images)
    ids, mask = ds.text.encode(captions)
    graphdef = run.graphdef

    @jax.jit
    def nll(params, batch):
        return token_nll(nnx.merge(graphdef, params), batch["text"], batch["text_mask"], batch["codes"]).mean(-1)

    out = []
    for start in range(0, n, 256):
        idx = np.arange(start, min(start + 256, n))
        out.append(np.asarray(nll(state.params, ds.make_batch(ids[idx], mask[idx], codes[idx])), np.float64))
    values = np.concatenate(out)
    np.save(cache, values)
    return values


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def anova(table: np.ndarray) -> dict[str, float]:
    """Variance components of one run's value from a full init x data table (rows: inits,
    columns: data orders), two-way ANOVA without replication: E[MS_init] = s_e^2 + D s_init^2,
    E[MS_data] = s_e^2 + I s_data^2, MS_res = s_e^2 (their interaction and whatever else varies);
    `total` their sum, one run's variance (Searle, Casella & McCulloch 1992, ch. 4)."""
    i, d = table.shape
    grand = table.mean()
    ms_i = d * ((table.mean(1) - grand) ** 2).sum() / (i - 1)
    ms_d = i * ((table.mean(0) - grand) ** 2).sum() / (d - 1)
    res = table - table.mean(1, keepdims=True) - table.mean(0, keepdims=True) + grand
    ms_e = (res**2).sum() / ((i - 1) * (d - 1))
    c = {"init": max((ms_i - ms_e) / d, 0.0), "data": max((ms_d - ms_e) / i, 0.0), "residual": ms_e}
    return {**c, "total": sum(c.values())}  # one run's variance as the components add it up


def interaction(values: np.ndarray) -> float:
    """The runs x examples interaction variance of per-example values [runs, examples] (two-way,
    no replication): what a run's mean over N examples carries of the evaluation set, / N."""
    r, n = values.shape
    res = values - values.mean(1, keepdims=True) - values.mean(0, keepdims=True) + values.mean()
    return float((res**2).sum() / ((r - 1) * (n - 1)))


def table_of(runs: list[dict], arm: str, value) -> np.ndarray:
    return np.array(
        [
            [value(next(r for r in runs if r["arm"] == arm and r["init"] == i and r["data"] == d)) for d in DATA[arm]]
            for i in INIT[arm]
        ]
    )


def fmt(v: float) -> str:
    return f"{v:.3g}" if np.isfinite(v) else "–"


@writes_page("Where the study's seed noise comes from")
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="studies/noise-decomposition", help="the folder of the decomposition's runs")
    p.add_argument("--train", action="store_true", help="train the runs first (a finished one is left as it is)")
    p.add_argument("--examples", type=int, default=FRESH, help="scenes scored example by example")
    args = p.parse_args()
    runs_dir = Path(args.runs)
    t0 = time.perf_counter()
    if args.train:
        train(runs_dir)
        train_long(runs_dir)
    runs = stores(runs_dir)
    for r in runs:
        r["evals"] = evaluations(r["store"])
        r["ex"] = per_example(r["store"], args.examples)
    from collections import Counter

    metas = [json.loads((r["store"] / "meta.json").read_text()) for r in runs]
    commits = Counter(m.get("git", {}).get("commit", "unknown")[:12] for m in metas)
    jobs: dict[Path, float] = {}  # a member's wall time is its job's
    for r in runs:
        wall = json.loads((r["store"] / "summary.json").read_text()).get("wall_time", 0.0)
        jobs[r["store"].parents[1]] = max(jobs.get(r["store"].parents[1], 0.0), wall)
    print(
        f"{len(runs)} runs in {runs_dir}, trained at {', '.join(f'{c} ({n} runs)' for c, n in commits.items())} as members "
        f"of {len(jobs)} jobs ({sum(jobs.values()) / 60:.0f} min of jobs on the shared machine; per-example scoring and "
        f"analysis {time.perf_counter() - t0:.0f} s)."
    )
    paired = report(runs, args.examples)
    report_long(runs, long_finals(runs_dir))
    conclude(paired)


def conclude(paired: list[tuple]) -> None:
    """What each protocol could cut the paired noise by, from the numbers above."""
    if not paired:
        return
    print("\n## What would cut the paired noise\n")
    for arm, sd, ev_share, last5, big in paired:
        print(
            f"{arm} − baseline: sd of a seed's difference {fmt(sd)}; the evaluation set is {fmt(ev_share * 100)} % of its "
            f"variance, so an evaluation set 16x larger cuts the sd at most {1 / math.sqrt(1 - ev_share * 15 / 16):.4f}x "
            f"(measured over {FRESH} scenes: {fmt(big)}); the mean of the last 5 evaluations gives {fmt(last5)} "
            f"({fmt(sd / last5)}x); the rest is training (initialisation, data order and how they meet), which n times "
            "the seeds cut by sqrt(n): 3x takes 9x the seeds."
        )


def report_long(runs: list[dict], long: dict[str, dict[int, float]]) -> None:
    """The 3000-step runs beside the same inits and data order at 1500 steps: each arm's sd and the
    paired difference's."""
    if not all(len(long.get(a, {})) == len(LONG["inits"]) for a in LONG["arms"]):
        return
    key = {(r["arm"], r["init"], r["data"]): r for r in runs}
    short = {
        a: {i: key[(a, i, LONG["data"])]["evals"][max(key[(a, i, LONG["data"])]["evals"])] for i in LONG["inits"]}
        for a in LONG["arms"]
    }
    print(
        f"\n## Twice the budget: {LONG['steps']} steps against 1500 (inits {', '.join(map(str, LONG['inits']))}, data order "
        f"{LONG['data']})\n"
    )
    print(
        "| | steps | "
        + " | ".join(f"{a}: {i}" for a in LONG["arms"] for i in LONG["inits"])
        + " | sd: "
        + " | sd: ".join(LONG["arms"])
        + " | sd of the difference |"
    )
    print("|---|---|" + "---|" * (len(LONG["arms"]) * len(LONG["inits"]) + len(LONG["arms"]) + 1))
    a, b = LONG["arms"]
    for name, table, steps in (("1500 steps", short, 1500), (f"{LONG['steps']} steps", long, LONG["steps"])):
        vals = [table[x][i] for x in LONG["arms"] for i in LONG["inits"]]
        sds = [np.std([table[x][i] for i in LONG["inits"]], ddof=1) for x in LONG["arms"]]
        diff = np.std([table[a][i] - table[b][i] for i in LONG["inits"]], ddof=1)
        print(
            f"| {name} | {steps} | "
            + " | ".join(fmt(v) for v in vals)
            + " | "
            + " | ".join(fmt(v) for v in sds)
            + f" | {fmt(diff)} |"
        )


def report(runs: list[dict], n_big: int) -> None:
    small = 512
    dominant: list[tuple] = []
    paired: list[tuple] = []
    print("\n## One run's variance by source (final eval loss, nats/image token)\n")
    print(
        "| arm | runs | mean | sd of one run | init | data order | residual (init x data) | eval set, 512 scenes | "
        f"eval set, {n_big} scenes | sd over {n_big} scenes | last 5 evaluations' mean: sd |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in INIT:
        mine = [r for r in runs if r["arm"] == arm]
        if len(mine) < len(INIT[arm]) * len(DATA[arm]):
            print(f"| {arm} | {len(mine)} | (incomplete) |")
            continue
        final = table_of(runs, arm, lambda r: r["evals"][max(r["evals"])])
        big = table_of(runs, arm, lambda r: r["ex"].mean())
        last5 = table_of(runs, arm, lambda r: np.mean([r["evals"][s] for s in sorted(r["evals"])[-5:]]))
        c = anova(final)
        ex = np.stack([r["ex"] for r in mine])
        ab = interaction(ex[:, :small])
        tot = c["total"]
        share = lambda v: f"{fmt(v / tot * 100)} %"  # noqa: E731
        dominant.append(
            (
                arm,
                max(
                    ("initialisation", c["init"]),
                    ("data order", c["data"]),
                    ("their interaction", c["residual"]),
                    key=lambda kv: kv[1],
                ),
                tot,
                ab / small,
            )
        )
        print(
            f"| {arm} | {len(mine)} | {fmt(final.mean())} | {fmt(math.sqrt(tot))} | {share(c['init'])} | {share(c['data'])} | "
            f"{share(c['residual'])} | {share(ab / small)} | {share(interaction(ex) / n_big)} | {fmt(big.std(ddof=1))} | "
            f"{fmt(last5.std(ddof=1))} |"
        )
    print()
    for arm, (source, var), tot, ev in dominant:
        print(
            f"{arm}: the largest source of one run's variance is its {source} ({fmt(var / tot * 100)} %); the "
            f"evaluation set's 512 scenes {fmt(ev / tot * 100)} %."
        )
    print("\n## Paired differences against the baseline (the same init and data order)\n")
    print(
        "| arm − baseline | pairs | mean | sd of one pair's difference | rho | init | data order | residual | "
        f"eval set, 512 scenes | sd over {n_big} scenes | last 5 evaluations: sd |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in ("postln", "sandwich"):
        shared_i = [i for i in INIT[arm] if i in INIT["baseline"]]
        shared_d = [d for d in DATA[arm] if d in DATA["baseline"]]
        key = {(r["arm"], r["init"], r["data"]): r for r in runs}
        if not all((a, i, d) in key for a in (arm, "baseline") for i in shared_i for d in shared_d):
            continue

        def diff(value):
            return np.array(
                [[value(key[(arm, i, d)]) - value(key[("baseline", i, d)]) for d in shared_d] for i in shared_i]
            )

        final = lambda r: r["evals"][max(r["evals"])]  # noqa: E731
        d = diff(final)
        a = np.array([final(key[(arm, i, dd)]) for i in shared_i for dd in shared_d])
        b = np.array([final(key[("baseline", i, dd)]) for i in shared_i for dd in shared_d])
        c = anova(d)
        ex = np.stack(
            [key[(arm, i, dd)]["ex"][:512] - key[("baseline", i, dd)]["ex"][:512] for i in shared_i for dd in shared_d]
        )
        big = diff(lambda r: r["ex"].mean())
        last5 = diff(lambda r: np.mean([r["evals"][s] for s in sorted(r["evals"])[-5:]]))
        tot = c["total"]
        share = lambda v: f"{fmt(v / tot * 100)} %"  # noqa: E731
        paired.append(
            (arm, math.sqrt(tot), interaction(ex) / 512 / tot, float(last5.std(ddof=1)), float(big.std(ddof=1)))
        )
        print(
            f"| {arm} | {d.size} | {fmt(d.mean())} | {fmt(math.sqrt(tot))} | {fmt(np.corrcoef(a, b)[0, 1])} | {share(c['init'])} | "
            f"{share(c['data'])} | {share(c['residual'])} | {share(interaction(ex) / 512)} | {fmt(big.std(ddof=1))} | "
            f"{fmt(last5.std(ddof=1))} |"
        )
    return paired


if __name__ == "__main__":
    main()
