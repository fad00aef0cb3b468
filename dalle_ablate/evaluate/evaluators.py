"""The evaluator registry. A `samples` evaluator scores generated images against their prompts
(and scene specs), once per guidance scale; a `model` evaluator needs no sampling and runs once
per evaluation. Each returns named metrics and the number of samples behind them (`<name>/n`).
`setup(eval_cfg)` builds what an evaluator loads once (pretrained networks, reference statistics)
when the Evaluation is made, so a missing weights file fails a run before it trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from dalle_ablate.evaluate import caption_sensitivity, shapes_parser
from dalle_ablate.registry import ConfigError, Registry


@dataclass(frozen=True)
class Evaluator:
    kind: str  # "samples" or "model"
    fn: Callable
    needs_specs: bool = False  # the data must carry scene specs (data=shapes), else it is skipped
    setup: Optional[Callable] = None  # eval config -> what fn finds in ctx.cache[<name>]

    def available(self, dataset) -> bool:
        return not self.needs_specs or getattr(dataset, "specs", None) is not None


EVALUATORS: Registry = Registry("evaluator", "eval.metrics")


def _shapes(images: np.ndarray, ctx) -> dict[str, float]:
    # Exact parse of the images scored against the captions' scene specs (shapes_parser.py).
    return shapes_parser.accuracy(images, ctx.specs)


def _shapes_fd(images: np.ndarray, ctx) -> dict[str, float]:
    # Fréchet distance and KID on the shapes CNN's features (shapes_features.py) against real
    # renders; `floor` is the distance of real renders of these same prompts, the value a
    # perfect model would get at this N (both distances are biased upwards at small N).
    from dalle_ablate.evaluate.frechet import frechet_distance, kid, statistics
    from dalle_ablate.evaluate.shapes_features import shapes_features

    net = shapes_features(str(ctx.cfg.data.cache_dir))
    feats = net.extract(net.resized(images))
    if "shapes_fd/floor" not in ctx.cache:  # the prompts are fixed for the Evaluation's life
        real = net.resized(ctx.reference_images())
        ctx.cache["shapes_fd/floor"] = frechet_distance(*statistics(net.extract(real)), *net.reference_stats)
    return {"fd": frechet_distance(*statistics(feats), *net.reference_stats),
            "kid": kid(feats, net.reference, subset_size=min(100, len(feats))),
            "floor": ctx.cache["shapes_fd/floor"], "n": float(len(feats)), "features": net.hash}


def _fid_setup(e) -> dict:
    from dalle_ablate.evaluate.fid import Reference
    from dalle_ablate.evaluate.inception import InceptionFeatures

    if not e.fid.weights:
        raise ConfigError("eval.metrics has fid but eval.fid.weights is not set: give the FID Inception weights (.npz; "
                          "convert torch-fidelity's weights-inception-2015-12-05-6726825d.pth with `dalle-ablate convert-inception`)")
    net = InceptionFeatures(e.fid.weights, "eval.fid.weights", e.fid.batch_size)
    return {"net": net, "reference": Reference.load(e.reference).check(net) if e.reference else None}


def _fid(images: np.ndarray, ctx) -> dict:
    # FID (Heusel et al. 2017) on pool3 features of the FID Inception, against eval.reference or,
    # without one, the real images of the eval prompts (computed once per Evaluation).
    from dalle_ablate.evaluate.fid import reference_from_images
    from dalle_ablate.evaluate.frechet import frechet_distance, statistics

    state = ctx.cache["fid"]
    if state["reference"] is None:
        state["reference"] = reference_from_images(state["net"], ctx.reference_images(), f"{ctx.dataset.name} eval prompts")
    ref = state["reference"]
    return {"fid": frechet_distance(*statistics(state["net"](images)), ref.mu, ref.sigma), "n": float(len(images)),
            "reference_n": float(ref.n), "weights": ref.weights, "resize": ref.resize}


def _clip_setup(e) -> dict:
    from dalle_ablate.evaluate.clip import CLIPScorer

    if not e.clip.weights:
        raise ConfigError("eval.metrics has clip but eval.clip.weights is not set: give CLIP weights (.npz; convert a "
                          "checkpoint and its bpe_simple_vocab_16e6.txt.gz with `dalle-ablate convert-clip`)")
    return {"scorer": CLIPScorer(e.clip.weights, "eval.clip.weights", e.clip.batch_size)}


def _clip(images: np.ndarray, ctx) -> dict:
    # CLIP score as torchmetrics': 100 * cos of image and caption embeddings, mean over the
    # samples, the mean clamped at 0.
    from dalle_ablate.evaluate.clip import clip_score

    state = ctx.cache["clip"]
    scorer = state["scorer"]
    if "text" not in state:  # the prompts are fixed for the Evaluation's life: encode them once
        state["text"] = scorer.text_embeddings(ctx.prompts)
    return {"score": clip_score(scorer.image_embeddings(images), state["text"][: len(images)]),
            "n": float(len(images)), "weights": scorer.hash}


def _caption_sensitivity(ctx, specs: list[dict], codes: np.ndarray, seed: int) -> dict[str, float]:
    return caption_sensitivity.sensitivity(ctx.per_image_nll, ctx.dataset.text.encode, specs, codes, seed)


EVALUATORS.register("shapes", Evaluator("samples", _shapes, needs_specs=True))
EVALUATORS.register("shapes_fd", Evaluator("samples", _shapes_fd, needs_specs=True))
EVALUATORS.register("fid", Evaluator("samples", _fid, setup=_fid_setup))
EVALUATORS.register("clip", Evaluator("samples", _clip, setup=_clip_setup))
EVALUATORS.register("caption_sensitivity", Evaluator("model", _caption_sensitivity, needs_specs=True))
