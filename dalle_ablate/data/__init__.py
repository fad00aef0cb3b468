"""Datasets of (caption, image codes): the built-in `shapes` and pre-encoded `parquet`."""

from __future__ import annotations

from dalle_ablate.data.base import Batch, Dataset
from dalle_ablate.registry import ConfigError, Registry

DATASETS: Registry = Registry("dataset", "data")


@DATASETS.register("shapes")
def _shapes(cfg, model_cfg) -> Dataset:
    from dalle_ablate.data.shapes import ShapesDataset

    return ShapesDataset(cfg, model_cfg.text_len)


@DATASETS.register("parquet")
def _parquet(cfg, model_cfg) -> Dataset:
    from dalle_ablate.data.parquet import ParquetDataset

    return ParquetDataset(cfg, model_cfg.text_len, model_cfg.image_len)


def build_dataset(data_cfg, model_cfg) -> Dataset:
    return DATASETS.get(data_cfg.name)(data_cfg, model_cfg)


def abstract_sizes(data_cfg, model_cfg) -> dict[str, int]:
    """image_len, image_vocab and text_vocab without reading or building any data: a size preset's
    own values where it sets them, else what the data config implies (text_vocab: the BPE size,
    an upper bound of the trained vocabulary)."""
    DATASETS.get(data_cfg.name)
    if data_cfg.name == "shapes":
        implied = {"image_len": (data_cfg.image_size // data_cfg.patch_size) ** 2, "image_vocab": data_cfg.codebook_size}
    else:
        implied = {"image_len": data_cfg.image_len, "image_vocab": data_cfg.image_vocab}
    implied["text_vocab"] = data_cfg.text_vocab_size
    sizes = {k: getattr(model_cfg, k) if getattr(model_cfg, k) is not None else v for k, v in implied.items()}
    missing = [k for k, v in sizes.items() if v is None]
    if missing:
        raise ConfigError(f"set model.{missing[0]} (or data.{missing[0]}): it cannot be known without reading the data")
    return sizes


__all__ = ["Batch", "Dataset", "DATASETS", "abstract_sizes", "build_dataset"]
