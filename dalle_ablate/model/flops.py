"""FLOPs of a model, from the config alone (no model built): each family's `COSTS.forward_flops`.

Counts matmul FLOPs (2 per multiply-add) of the forward pass; a training step costs 3x the
forward (backward = 2x forward), the convention of Kaplan et al. 2020 (arXiv 2001.08361) and of
MFU in PaLM (arXiv 2204.02311, appendix B). Attention scores are counted over the full square
(as the dense kernels compute them, masked or not), norms, softmax and embeddings lookups are
not counted.
"""

from __future__ import annotations

from dalle_ablate.model.config import FAMILIES


def forward_flops_per_example(cfg) -> int:
    return FAMILIES.get(cfg.family).COSTS.forward_flops(cfg)


def train_flops_per_example(cfg) -> int:
    return 3 * forward_flops_per_example(cfg)
