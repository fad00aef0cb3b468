"""Generation: sampling image codes from a trained model and laying them out as grids."""

from dalle_ablate.generate.sample import (
    check_sampling,
    filter_logits,
    guide_logits,
    image_grid,
    make_sampler,
    top_p_mask,
)

__all__ = ["check_sampling", "filter_logits", "guide_logits", "image_grid", "make_sampler", "top_p_mask"]
