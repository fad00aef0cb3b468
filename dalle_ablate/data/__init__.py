"""Datasets of (caption, image codes): the built-in `shapes` and pre-encoded `parquet`. Each is
one module holding its config dataclass, its Dataset and its builder, registered together by
`DATASETS.option`; importing this package registers them all."""

from __future__ import annotations

from dalle_ablate.data import parquet, shapes  # noqa: F401 - registers the options
from dalle_ablate.data.base import DATASETS, Batch, DataConfig, Dataset
from dalle_ablate.registry import ConfigError


def build_dataset(data_cfg, model_cfg) -> Dataset:
    dataset = DATASETS.get(data_cfg.name)(data_cfg, model_cfg)
    dataset.blank_is_padding = getattr(model_cfg, "blank_is_padding", False)
    return dataset


def abstract_sizes(data_cfg, model_cfg) -> dict[str, int]:
    """image_len, image_vocab and text_vocab without reading or building any data: a size preset's
    own values where it sets them, else what the data config implies (text_vocab: the BPE size,
    an upper bound of the trained vocabulary)."""
    DATASETS.get(data_cfg.name)
    implied = {**data_cfg.image_sizes(), "text_vocab": data_cfg.text_vocab_size}
    sizes = {k: getattr(model_cfg, k) if getattr(model_cfg, k) is not None else v for k, v in implied.items()}
    missing = [k for k, v in sizes.items() if v is None]
    if missing:
        raise ConfigError(f"set model.{missing[0]} (or data.{missing[0]}): it cannot be known without reading the data")
    return sizes


__all__ = ["Batch", "DATASETS", "DataConfig", "Dataset", "abstract_sizes", "build_dataset"]
