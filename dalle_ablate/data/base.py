"""What every dataset gives the trainer: batches of (text ids, text mask, image codes, weights);
and what every dataset option's config has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
from omegaconf import MISSING

from dalle_ablate.config import CACHE_ROOT
from dalle_ablate.data.text_tokenizer import TextTokenizer
from dalle_ablate.registry import OptionConfig, Registry, check

# name -> builder(data cfg, model cfg) -> Dataset
DATASETS: Registry = Registry("dataset", "data")


@dataclass
class DataConfig(OptionConfig):
    RANGES = {"text_vocab_size": "[1, inf)"}

    name: str = MISSING  # the dataset, chosen with data=NAME (its preset sets it)
    blank_caption_prob: float = 0.1  # empty captions train the unconditional branch
    tokenizer_path: Optional[str] = None  # a tokenizer.json; null = BPE trained on the captions
    text_vocab_size: int = 512  # BPE vocabulary when trained here
    # rendered data, fitted tokenizers and scorers, reused across runs; or a bucket's (gs://...)
    cache_dir: str = CACHE_ROOT

    def validate(self, run) -> None:
        check(
            0.0 <= self.blank_caption_prob <= 1.0,
            f"data.blank_caption_prob={self.blank_caption_prob} must be in [0, 1]",
        )

    def image_sizes(self) -> dict[str, Optional[int]]:
        """image_len and image_vocab as far as the config alone says (None: only the data knows)."""
        return {"image_len": None, "image_vocab": None}


Batch = dict[str, np.ndarray]  # text [B, T] int32, text_mask [B, T] bool, codes [B, I] int32, weights [B] f32


def unigram_entropy(codes: np.ndarray, vocab: int) -> float:
    """Entropy (nats) of the code frequencies: the loss of a model that ignores position and caption."""
    p = np.bincount(codes.ravel(), minlength=vocab).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def host_share(indices: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This host's contiguous share of a global batch (hosts' shares are disjoint and cover it)."""
    if len(indices) % process_count:
        raise ValueError(f"global batch {len(indices)} is not divisible by {process_count} processes")
    per = len(indices) // process_count
    return indices[process_index * per : (process_index + 1) * per]


def eval_index_batches(n: int, batch_size: int, max_batches: Optional[int] = None):
    """(row indices, weights) of fixed-size batches over n rows; the tail is padded with weight 0
    so that one compiled eval step serves every batch."""
    nb = -(-n // batch_size)
    for b in range(nb if max_batches is None else min(nb, max_batches)):
        idx = np.arange(b * batch_size, (b + 1) * batch_size)
        yield np.minimum(idx, n - 1), (idx < n).astype(np.float32)


class Dataset(ABC):
    """Subclasses set these attributes and define the iterators."""

    name: str
    image_len: int
    image_vocab: int
    text: TextTokenizer
    blank_caption_prob: float
    info: dict
    blank_is_padding: bool = False  # see empty_caption

    @abstractmethod
    def train_batches(
        self, batch_size: int, seed: int, start_step: int = 0, process_index: int = 0, process_count: int = 1
    ) -> Iterator[Batch]:
        """Endless training batches (this host's share of each global batch), in an order that
        the seed fixes, starting at optimizer step start_step (for resuming)."""

    @abstractmethod
    def eval_batches(self, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
        """The valid split once, in a fixed order; the last batch padded with weight 0."""

    @abstractmethod
    def demo_captions(self) -> list[str]:
        """A few fixed captions to sample at the end of a run."""

    def has_image_decoder(self) -> bool:
        return False

    def decode_images(self, codes: np.ndarray) -> Optional[np.ndarray]:
        """[N, image_len] codes -> [N, H, W, 3] uint8, or None when no decoder is available."""
        return None

    @abstractmethod
    def valid_examples(self, n: int) -> tuple[list[str], np.ndarray]:
        """(captions, codes) of the first n examples of the valid split: the eval prompts."""

    def eval_prompts(self, n: int) -> tuple[list[str], Optional[list[dict]]]:
        """(captions, scene specs or None) a sampling evaluation draws: here the first n captions
        of the valid split, without specs; datasets with specs give a stratified set."""
        return self.valid_examples(n)[0], None

    def eval_reference_images(self, n: int) -> Optional[np.ndarray]:
        """The real images of `eval_prompts(n)`."""
        return self.reference_images(n)

    def reference_images(self, n: int) -> Optional[np.ndarray]:
        """The real images of the first n valid examples, for distances to a real set: here the
        decoded true codes (the image tokenizer's reconstructions); exact renders on shapes."""
        return self.decode_images(self.valid_examples(n)[1])

    def make_batch(
        self, ids: np.ndarray, mask: np.ndarray, codes: np.ndarray, weights: np.ndarray | None = None
    ) -> Batch:
        return {
            "text": ids.astype(np.int32),
            "text_mask": mask.astype(bool),
            "codes": codes.astype(np.int32),
            "weights": np.ones(len(codes), np.float32) if weights is None else weights.astype(np.float32),
        }

    def blank_captions(
        self,
        batch: Batch,
        rng: np.random.Generator,
        rows: Optional[np.ndarray] = None,
        global_size: Optional[int] = None,
    ) -> Batch:
        """Replace a blank_caption_prob share of captions by the empty caption (the unconditional
        branch that super conditioning needs; DALL·E mini trained with 10%). With `rows` (this
        host's rows of a global batch of `global_size`) the draw is made for the global batch,
        so that every split over hosts blanks the same examples."""
        if self.blank_caption_prob <= 0:
            return batch
        draw = rng.random(len(batch["text"]) if rows is None else global_size)
        blank = (draw if rows is None else draw[rows]) < self.blank_caption_prob
        if blank.any():
            ids, mask = self._blank
            batch["text"] = np.where(blank[:, None], ids, batch["text"])
            batch["text_mask"] = np.where(blank[:, None], mask, batch["text_mask"])
        return batch

    def empty_caption(self) -> tuple[np.ndarray, np.ndarray]:
        """The empty caption (ids [1, T], mask [1, T]) as the model family reads it: the tokenizer's
        "" (BOS, EOS), or every position empty where the family's `blank_is_padding` (set by
        `build_dataset`; the single-stream family's all-padding caption)."""
        return self._blank

    @property
    def _blank(self) -> tuple[np.ndarray, np.ndarray]:
        if not hasattr(self, "_blank_cache"):
            ids, mask = self.text.encode([""])
            self._blank_cache = (ids, mask & False) if self.blank_is_padding else (ids, mask)
        return self._blank_cache
