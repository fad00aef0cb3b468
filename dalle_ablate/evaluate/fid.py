"""FID reference statistics: the mean and covariance of a real image set's pool3 features, saved
as `.npz` with the hash of the Inception weights and the resize that produced them, so a value is
never computed against statistics of other features. `dalle-ablate fid-reference` writes them
from a folder of images or from a run's data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from dalle_ablate.evaluate.evaluators import SamplesContext, evaluator
from dalle_ablate.evaluate.frechet import frechet_of, statistics
from dalle_ablate.evaluate.inception import FEATURES, HINT, RESIZE, InceptionFeatures
from dalle_ablate.fileio import atomic_savez
from dalle_ablate.metrics import Metric
from dalle_ablate.registry import ConfigError, OptionConfig, check
from dalle_ablate.weights import existing

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
REFERENCE_HINT = "write one with `dalle-ablate fid-reference`"


@dataclass
class Reference:
    mu: np.ndarray
    sigma: np.ndarray
    n: int
    weights: str  # hash of the Inception weights file
    resize: str
    source: str

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_savez(
            Path(path),
            mu=self.mu,
            sigma=self.sigma,
            n=self.n,
            weights=self.weights,
            resize=self.resize,
            source=self.source,
        )

    @classmethod
    def load(cls, path: str | Path, field: str = "eval.reference") -> "Reference":
        path = existing(path, field, REFERENCE_HINT)
        d = np.load(path)
        missing = {"mu", "sigma", "n", "weights", "resize"} - set(d.files)
        if missing:
            raise ConfigError(
                f"{field}: {path} is not FID reference statistics (missing {', '.join(sorted(missing))}; "
                f"{REFERENCE_HINT})"
            )
        return cls(d["mu"], d["sigma"], int(d["n"]), str(d["weights"]), str(d["resize"]), str(d.get("source", "")))

    def check(self, net: InceptionFeatures, field: str = "eval.reference") -> "Reference":
        """The statistics must come from these weights and this resize, or the distance is meaningless."""
        if self.weights != net.hash or self.resize != RESIZE:
            raise ConfigError(
                f"{field}: statistics of Inception weights {self.weights} ({self.resize}), but eval.fid.weights "
                f"is {net.hash} ({RESIZE}); recompute them with `dalle-ablate fid-reference`"
            )
        return self


def reference_from_images(net: InceptionFeatures, images, source: str) -> Reference:
    """Statistics of real images (an array, or a list of images of any sizes)."""
    feats = net(images) if isinstance(images, np.ndarray) else features_of_any_size(net, images)
    return Reference(*statistics(feats), n=len(feats), weights=net.hash, resize=RESIZE, source=source)


def read_image_folder(folder: str | Path, limit: int | None = None) -> list[np.ndarray]:
    """RGB uint8 arrays of the images in a folder (recursive, sorted by path)."""
    from PIL import Image

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"--images: {folder} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if len(files) < 2:
        raise ConfigError(
            f"--images: {folder} has {len(files)} images ({', '.join(IMAGE_SUFFIXES)}); statistics need at least 2"
        )
    return [np.asarray(Image.open(p).convert("RGB")) for p in files]


def features_of_any_size(net: InceptionFeatures, images: list[np.ndarray]) -> np.ndarray:
    """Features of images of mixed sizes: each size is one batch shape (the network resizes)."""
    out = np.zeros((len(images), FEATURES), np.float32)
    by_shape: dict[tuple, list[int]] = {}
    for i, im in enumerate(images):
        by_shape.setdefault(im.shape, []).append(i)
    for idx in by_shape.values():
        out[idx] = net(np.stack([images[i] for i in idx]))
    return out


@dataclass
class FidConfig(OptionConfig):
    """eval.fid: the FID Inception network, a local `.npz` of converted weights; nothing is
    downloaded. Its reference statistics are `eval.reference` (null: the real images of the
    eval prompts)."""

    RANGES = {"batch_size": "[1, inf)"}

    weights: Optional[str] = None  # Inception weights (.npz, dalle-ablate convert-inception); needed for fid
    batch_size: int = 32  # images per forward pass

    def validate(self, run: Any) -> None:
        check(
            bool(self.weights),
            f"eval.metrics has fid but eval.fid.weights is not set: give the FID Inception weights (.npz; {HINT})",
        )
        existing(self.weights, "eval.fid.weights", HINT)
        if run.eval.reference:
            existing(run.eval.reference, "eval.reference", REFERENCE_HINT)


def fid_setup(settings: FidConfig, eval_cfg) -> dict:
    net = InceptionFeatures(settings.weights, "eval.fid.weights", settings.batch_size)
    return {"net": net, "reference": Reference.load(eval_cfg.reference).check(net) if eval_cfg.reference else None}


@evaluator(
    "fid",
    "samples",
    settings=FidConfig,
    setup=fid_setup,
    metrics=[
        Metric("fid", "FID against the reference images", "FID", "lower", headline=5, pareto_against="clip/score"),
    ],
)
def fid_evaluator(images: np.ndarray, ctx: SamplesContext) -> dict:
    """eval.metrics=[fid]: FID (Heusel et al. 2017) on pool3 features of the FID Inception, against
    eval.reference or, without one, the real images of the eval prompts (computed once per
    Evaluation)."""
    state = ctx.cache["fid"]
    if state["reference"] is None:
        state["reference"] = reference_from_images(
            state["net"], ctx.reference_images(), f"{ctx.dataset.name} eval prompts"
        )
    ref = state["reference"]
    return {
        "fid": frechet_of(state["net"](images), ref.mu, ref.sigma),
        "n": float(len(images)),
        "reference_n": float(ref.n),
        "weights": ref.weights,
        "resize": ref.resize,
    }
