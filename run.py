"""Entry point: `python run.py [-m] [overrides...]` (Hydra). See README.md. The same job from an
installed package: `python -m dalle_ablate.job [-m] [overrides...]`."""

from dalle_ablate.cli import run_hydra
from dalle_ablate.job import main

if __name__ == "__main__":
    run_hydra(main)
