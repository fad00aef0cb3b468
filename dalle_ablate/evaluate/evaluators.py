"""The evaluator registry. A `samples` evaluator scores generated images against their prompts
(and scene specs), once per guidance scale; a `model` evaluator needs no sampling and runs once
per evaluation. Each returns named metrics and the number of samples behind them (`<name>/n`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dalle_ablate.evaluate import caption_sensitivity, shapes_parser
from dalle_ablate.registry import Registry


@dataclass(frozen=True)
class Evaluator:
    kind: str  # "samples" or "model"
    fn: Callable
    needs_specs: bool = False  # the data must carry scene specs (data=shapes), else it is skipped

    def available(self, dataset) -> bool:
        return not self.needs_specs or getattr(dataset, "specs", None) is not None


EVALUATORS: Registry = Registry("evaluator", "eval.metrics")


def _shapes(images: np.ndarray, specs: list[dict], ctx) -> dict[str, float]:
    # Exact parse of the images scored against the captions' scene specs (shapes_parser.py).
    return shapes_parser.accuracy(images, specs)


def _shapes_fd(images: np.ndarray, specs: list[dict], ctx) -> dict[str, float]:
    # Fréchet distance and KID on the shapes CNN's features (shapes_features.py) against real
    # renders; `floor` is the distance of real renders of these same prompts, the value a
    # perfect model would get at this N (both distances are biased upwards at small N).
    from dalle_ablate.evaluate.frechet import frechet_distance, kid, statistics
    from dalle_ablate.evaluate.shapes_features import shapes_features

    net = shapes_features(str(ctx.cfg.data.cache_dir))
    feats = net.extract(images)
    if "shapes_fd/floor" not in ctx.cache:  # the prompts are fixed for the Evaluation's life
        from dalle_ablate.data.scenes import Scene, render

        real = np.stack([render(Scene.from_dict(s), images.shape[1]) for s in specs])
        ctx.cache["shapes_fd/floor"] = frechet_distance(*statistics(net.extract(real)), *net.reference_stats)
    return {"fd": frechet_distance(*statistics(feats), *net.reference_stats),
            "kid": kid(feats, net.reference, subset_size=min(100, len(feats))),
            "floor": ctx.cache["shapes_fd/floor"], "n": float(len(feats)), "features": net.hash}


def _caption_sensitivity(ctx, specs: list[dict], codes: np.ndarray, seed: int) -> dict[str, float]:
    return caption_sensitivity.sensitivity(ctx.per_image_nll, ctx.dataset.text.encode, specs, codes, seed)


EVALUATORS.register("shapes", Evaluator("samples", _shapes, needs_specs=True))
EVALUATORS.register("shapes_fd", Evaluator("samples", _shapes_fd, needs_specs=True))
EVALUATORS.register("caption_sensitivity", Evaluator("model", _caption_sensitivity, needs_specs=True))
