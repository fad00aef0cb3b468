"""Entry point: `python run.py [-m] [overrides...]` (Hydra). See README.md."""

import hydra
from omegaconf import DictConfig

from dalle_ablate import config as _config  # noqa: F401  (registers the structured configs)
from dalle_ablate.cli import run_hydra


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from dalle_ablate.train import run

    return run(cfg)


if __name__ == "__main__":
    run_hydra(main)
