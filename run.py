"""Entry point: `python run.py [-m] [overrides...]` (Hydra). See README.md. The same job from an
installed package: `python -m dalle_ablate.job [-m] [overrides...]`."""

from dalle_ablate import interrupts

interrupts.install()  # before the imports below (seconds): a Ctrl-C while they load is taken once they have

from dalle_ablate.cli import run_hydra  # noqa: E402
from dalle_ablate.job import main  # noqa: E402

if __name__ == "__main__":
    run_hydra(main)
