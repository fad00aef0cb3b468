"""Generation: sampling image codes from a trained model and laying them out as grids."""

from dalle_ablate.generate.sample import image_grid, make_sampler

__all__ = ["image_grid", "make_sampler"]
