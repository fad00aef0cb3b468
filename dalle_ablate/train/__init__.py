"""Training: the jitted step, the loop, checkpoints, and the Hydra entry `run`."""

from __future__ import annotations


def run(cfg) -> float:
    """Hydra task function: train with the composed config; returns the final validation loss."""
    from dalle_ablate.train.hydra_job import run as _run

    return _run(cfg)
