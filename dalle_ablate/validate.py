"""A run config from the command line's overrides: composed with every option loaded, typed, and
checked before anything is built. The run-level checks are here (numeric ranges in one table,
fields that span sections); each option of a group checks itself (its class's RANGES and
`validate`, through its registry), and so does the `eval` section (`EvalConfig`, with the
settings of each evaluator chosen). Every failure is a ConfigError naming the field and what
would be valid."""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

# Importing these registers every option's schema in Hydra's ConfigStore before anything composes.
from dalle_ablate.config import GRAD_SCALING, OBJECTIVES, RunConfig
from dalle_ablate.data import DATASETS
from dalle_ablate.evaluate import EvalConfig  # noqa: F401 (the eval schema)
from dalle_ablate.model import FAMILIES
from dalle_ablate.optim import OPTIMIZERS, SCHEDULES
from dalle_ablate.registry import ConfigError, check, check_ranges
from dalle_ablate.track import TRACKERS

# Valid ranges of the run's own numeric fields ("or null": the field is optional).
RANGES = {
    "seed": "[0, inf)",
    "data_seed": "[0, inf) or null",
    "init_seed": "[0, inf) or null",
    "trainer.eval_batches": "[1, inf) or null",
    "trainer.keep_checkpoints": "[1, inf)",
    "samples.top_k": "[1, inf) or null",
    "trainer.grad_scale_init": "[5.96e-08, 16777216]",  # 2^-24 .. 2^24, the range a scale moves in
    "trainer.grad_scale_growth_every": "[1, inf)",
}

# (registry, section) of each option group: the section's option validates itself.
OPTION_GROUPS = ((FAMILIES, "model"), (OPTIMIZERS, "optim"), (SCHEDULES, "schedule"), (DATASETS, "data"), (TRACKERS, "tracker"))


def validate(cfg: RunConfig) -> None:
    t = cfg.trainer
    # The trainer's own counts first: the options' checks (a warm-up shorter than the run) read them.
    for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "save_every"):
        check(getattr(t, name) > 0, f"trainer.{name}={getattr(t, name)} must be positive")
    for registry, section in OPTION_GROUPS:
        registry.validate(getattr(cfg, section), cfg)
    check_ranges(cfg, RANGES)
    check(
        t.batch_size % t.grad_accum == 0,
        f"trainer.batch_size={t.batch_size} is not divisible by trainer.grad_accum={t.grad_accum}",
    )
    check(t.grad_scaling in GRAD_SCALING, f"trainer.grad_scaling={t.grad_scaling!r} is not valid; valid: {', '.join(GRAD_SCALING)}")
    # Scaling keeps float16's narrow exponent range from flushing gradients to 0; float32 and
    # bfloat16 have float32's range and need none (a scale would only cost skipped steps).
    check(t.grad_scaling == "none" or cfg.model.dtype == "float16",
          f"trainer.grad_scaling={t.grad_scaling} conflicts with model.dtype={cfg.model.dtype}: gradient scaling is for "
          "float16 (set model.dtype=float16, or trainer.grad_scaling=none)")
    bad = [o for o in cfg.objectives if o not in OBJECTIVES]
    check(bool(cfg.objectives) and not bad, f"objectives={list(cfg.objectives)}: {bad or 'empty'}; valid: {', '.join(OBJECTIVES)}")
    cfg.eval.check_all(cfg, "eval")
    check(cfg.samples.per_caption > 0, f"samples.per_caption={cfg.samples.per_caption} must be positive")
    check(cfg.samples.temperature > 0, f"samples.temperature={cfg.samples.temperature} must be positive")
    check_distributed(cfg.distributed)


def check_distributed(d) -> None:
    """Several processes need a coordinator (or a cluster JAX detects): without one each would run
    alone, and all of them would write one run folder."""
    if d.coordinator_address or d.auto:
        return
    for name in ("num_processes", "process_id"):
        value = getattr(d, name)
        check(value is None or (name == "num_processes" and value == 1),
              f"distributed.{name}={value} needs distributed.coordinator_address (host:port of process 0, or "
              "JAX_COORDINATOR_ADDRESS), or distributed.auto=true on a cluster JAX detects (Cloud TPU, Slurm, Open MPI)")


def check_known_keys(node: DictConfig, path: str = "") -> None:
    """Hydra's `+key=value` adds a key even to a structured config: refuse one its schema (the
    dataclass of its section) has no field for. A `dict` field (a sampler's kwargs) takes any key."""
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key, child in node.items_ex(resolve=False):
        full = f"{path}.{key}" if path else str(key)
        if fields is not None and key not in fields:
            raise ConfigError(f"unknown field {full!r}; valid fields of {path or 'the config'}: {', '.join(sorted(fields))}")
        if isinstance(child, DictConfig):
            check_known_keys(child, full)


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The typed, validated config. Raises ConfigError naming the field and the valid values."""
    if isinstance(cfg, RunConfig):
        run = cfg
    else:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)")
        check_known_keys(cfg)
        run = OmegaConf.to_object(cfg)
    validate(run)
    return run


def compose(overrides: list[str]) -> DictConfig:
    """The config for these overrides, composed as `python run.py` would (from the package's
    `conf/`, so the same from a wheel as from a checkout); `to_run_config` types and checks it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="dalle_ablate.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)
