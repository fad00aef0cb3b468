"""Best-of-N reranking (DALL·E, Ramesh et al. 2021, arXiv 2102.12092, section 2.5 and figure 9:
N samples per caption, the one a contrastive model ranks highest kept; the paper's curve goes
to N = 512). With `eval.rerank=N` each evaluation draws N samples per eval prompt at every
`eval.rerank_scales` scale, scores each against its prompt with the `eval.rerank_scorer`, and
runs the sample evaluators on the best of the first k draws for k = 1, 2, 4, ... up to N: best-of-1
is plain sampling, so the rows say what reranking buys.

Scorers share one interface, `scores(images, texts) -> [n]` (higher: a better match) and a
`hash` logged with the numbers: `contrastive`, this project's small model of the shapes data
(evaluate/contrastive.py, trained on first use and cached), and `clip`, the CLIP port with the
weights of `eval.clip.weights`.
"""

from __future__ import annotations

import io
from typing import Callable

import numpy as np

from dalle_ablate.registry import Registry

# name -> builder(run config) -> scorer
SCORERS: Registry[Callable] = Registry("scorer", "eval.rerank_scorer")


@SCORERS.register("contrastive")
def _contrastive(cfg):
    from dalle_ablate.evaluate.contrastive import contrastive_scorer

    return contrastive_scorer(str(cfg.data.cache_dir), cfg.eval.scorer)


@SCORERS.register("clip")
def _clip(cfg):
    from dalle_ablate.evaluate.clip import CLIPScorer

    return CLIPScorer(cfg.eval.clip.weights, "eval.clip.weights", cfg.eval.clip.batch_size)


def best_of_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    ks = [1]
    while ks[-1] * 2 < n:
        ks.append(ks[-1] * 2)
    return ks + [n] if n > 1 else ks


def pick_best(scores: np.ndarray, k: int) -> np.ndarray:
    """For scores [prompts, draws]: the index of the highest-scoring of each prompt's first k
    draws (the first of equals)."""
    return np.argmax(scores[:, :k], axis=1)


def rerank_rows(ctx, scale: float, run_name: str, step: int) -> list[dict]:
    """Rows of best-of-k metrics at one guidance scale. `ctx`: the Evaluation (its sampler,
    prompts, dataset and `samples` evaluators)."""
    n, prompts = ctx.e.rerank, ctx.prompts
    codes = ctx.sample(prompts, scale, repeats=n)  # prompt-major: draws of prompt i at i*n .. i*n + n - 1
    images = ctx.dataset.decode_images(codes)
    scorer = ctx.cache["rerank"]
    scores = np.asarray(scorer.scores(images, [p for p in prompts for _ in range(n)]), np.float64).reshape(len(prompts), n)
    images = images.reshape(len(prompts), n, *images.shape[1:])
    rows = []
    for k in best_of_ks(n):
        pick = pick_best(scores, k)
        chosen = images[np.arange(len(prompts)), pick]
        row = {"run": run_name, "step": int(step), "scale": float(scale), "best_of": k, "n": len(prompts),
               "rerank/score": float(scores[np.arange(len(prompts)), pick].mean())}
        for name, ev in ctx.evaluators.items():
            if ev.kind == "samples":
                row.update({f"{name}/{key}": v for key, v in ev.fn(chosen, ctx).items()})
        rows.append(row)
    return rows


def rerank_png(rows: list[dict], metric: str, title: str) -> np.ndarray:
    """The metric against N (log scale), one line per guidance scale: figure 9 of the paper."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots(figsize=(4.5, 3.5), dpi=100)
    for scale in sorted({r["scale"] for r in rows}):
        pts = sorted((r["best_of"], r[metric]) for r in rows if r["scale"] == scale)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=f"s={scale:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("best of N (reranked)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
