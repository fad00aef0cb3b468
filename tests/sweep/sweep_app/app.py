"""A Hydra app whose job is a known function of its parameters, for the sweeper's tests (the
trainer's own pruning is tested with run.py). `mode` makes a job raise, return NaN or report
intermediate values the way the trainer does; `sleep` lets concurrent sweeps interleave."""

import json
import math
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    time.sleep(cfg.sleep)
    value = (cfg.x - 0.3) ** 2 + (0.5 if cfg.y == "b" else 0.0) + 0.01 * cfg.k
    steps = 0
    if cfg.mode == "raise":
        raise RuntimeError("job failed on purpose")
    if cfg.mode == "nonfinite":
        value = math.nan
    if cfg.mode == "report":  # as the trainer: report at each evaluation, stop when pruned
        from dalle_ablate.sweep.trial import pruning_for

        pruning = pruning_for(cfg.optuna)
        for steps in range(1, cfg.steps + 1):
            if pruning is not None and pruning.report(value + 1.0 / steps, steps):
                import optuna

                Path("steps.json").write_text(json.dumps(steps))
                raise optuna.TrialPruned(f"pruned at {steps}")
    Path("steps.json").write_text(json.dumps(steps))
    return [value, cfg.x] if cfg.two_objectives else value


if __name__ == "__main__":
    main()
