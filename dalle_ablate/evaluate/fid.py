"""FID reference statistics: the mean and covariance of a real image set's pool3 features, saved
as `.npz` with the hash of the Inception weights and the resize that produced them, so a value is
never computed against statistics of other features. `dalle-ablate fid-reference` writes them
from a folder of images or from a run's data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dalle_ablate.evaluate.frechet import statistics
from dalle_ablate.evaluate.inception import FEATURES, RESIZE, InceptionFeatures
from dalle_ablate.fileio import atomic_savez
from dalle_ablate.registry import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


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
        atomic_savez(Path(path), mu=self.mu, sigma=self.sigma, n=self.n, weights=self.weights, resize=self.resize,
                     source=self.source)

    @classmethod
    def load(cls, path: str | Path, field: str = "eval.reference") -> "Reference":
        path = Path(path).expanduser()
        if not path.exists():
            raise ConfigError(f"{field}: {path} does not exist (write one with `dalle-ablate fid-reference`)")
        d = np.load(path)
        missing = {"mu", "sigma", "n", "weights", "resize"} - set(d.files)
        if missing:
            raise ConfigError(f"{field}: {path} is not FID reference statistics (missing {', '.join(sorted(missing))}; "
                              "write one with `dalle-ablate fid-reference`)")
        return cls(d["mu"], d["sigma"], int(d["n"]), str(d["weights"]), str(d["resize"]), str(d.get("source", "")))

    def check(self, net: InceptionFeatures, field: str = "eval.reference") -> "Reference":
        """The statistics must come from these weights and this resize, or the distance is meaningless."""
        if self.weights != net.hash or self.resize != RESIZE:
            raise ConfigError(f"{field}: statistics of Inception weights {self.weights} ({self.resize}), but eval.fid.weights "
                              f"is {net.hash} ({RESIZE}); recompute them with `dalle-ablate fid-reference`")
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
        raise ConfigError(f"--images: {folder} has {len(files)} images ({', '.join(IMAGE_SUFFIXES)}); statistics need at least 2")
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
