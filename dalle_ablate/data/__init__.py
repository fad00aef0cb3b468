"""Datasets of (caption, image codes): the built-in `shapes` and pre-encoded `parquet`."""

from __future__ import annotations

from dalle_ablate.data.base import Batch, Dataset
from dalle_ablate.registry import Registry

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


__all__ = ["Batch", "Dataset", "DATASETS", "build_dataset"]
