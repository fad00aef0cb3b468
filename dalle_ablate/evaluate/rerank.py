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
    scores = np.asarray(scorer.scores(images, [p for p in prompts for _ in range(n)]), np.float64).reshape(
        len(prompts), n
    )
    images = images.reshape(len(prompts), n, *images.shape[1:])
    rows = []
    for k in best_of_ks(n):
        pick = pick_best(scores, k)
        chosen = images[np.arange(len(prompts)), pick]
        row = {
            "run": run_name,
            "step": int(step),
            "scale": float(scale),
            "best_of": k,
            "n": len(prompts),
            "rerank/score": float(scores[np.arange(len(prompts)), pick].mean()),
        }
        for name, ev in ctx.evaluators.items():
            if ev.kind == "samples":
                row.update({f"{name}/{key}": v for key, v in ev.fn(chosen, ctx).items()})
        rows.append(row)
    return rows
