"""Checks of a composed RunConfig before anything is built: numeric ranges (one table), choices
from the registries (layouts, optimizers, datasets, evaluators, ...) and combinations of fields.
Every failure is a ConfigError naming the field and what would be valid."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from dalle_ablate.config import OBJECTIVES, RunConfig
from dalle_ablate.registry import ConfigError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# Valid ranges of numeric fields, checked wherever the chosen option has the field (decay_rate is
# Adafactor's and the exponential schedule's, ...); "@name": only for that option. "or null": the
# field is optional.
RANGES = {
    "seed": "[0, inf)",
    "trainer.eval_batches": "[1, inf) or null",
    "trainer.keep_checkpoints": "[1, inf)",
    "optim.weight_decay": "[0, inf)",
    "optim.b1": "[0, 1)",
    "optim.b2@adam": "[0, 1)",  # b2 = 1: the bias correction divides by 0
    "optim.b2@shampoo": "[0, 1]",  # b2 = 1: Adagrad-style sums
    "optim.eps": "[0, inf)",
    "optim.eps_root": "[0, inf)",
    "optim.block_size": "[1, inf)",
    "optim.graft_b2": "[0, 1] or null",
    "optim.graft_eps": "[0, inf)",
    "optim.matrix_eps": "[0, inf)",
    "optim.exponent_override": "[0, inf)",
    "optim.preconditioning_every": "[1, inf)",
    "optim.start_preconditioning_step": "[0, inf)",
    "optim.inverse_failure_threshold": "(0, inf)",
    "optim.skip_preconditioning_dim_size_gt": "[1, inf)",
    "optim.merge_small_dims": "[0, inf)",
    "optim.decay_rate": "(0, 1]",
    "optim.decay_offset": "[0, inf)",
    "optim.clipping_threshold": "(0, inf) or null",
    "optim.momentum": "[0, 1) or null",
    "optim.min_dim_size_to_factor": "[1, inf)",
    "schedule.lr_offset": "[0, inf)",
    "schedule.end_factor": "[0, 1]",
    "schedule.decay_steps": "[1, inf) or null",
    "schedule.transition_steps": "[1, inf)",
    "data.text_vocab_size": "[1, inf)",
    "data.image_size": "[1, inf)",
    "data.patch_size": "[1, inf)",
    "data.codebook_size": "[2, inf)",
    "data.num_train": "[1, inf)",
    "data.num_valid": "[1, inf)",
    "data.num_test": "[1, inf)",
    "data.min_objects": "[1, 9]",  # the scene grid has 9 cells
    "data.max_objects": "[1, 9]",
    "data.kmeans_patches": "[1, inf)",
    "data.kmeans_iters": "[1, inf)",
    "data.valid_fraction": "[0, 1)",
    "data.image_vocab": "[1, inf)",
    "data.image_len": "[1, inf) or null",
    "data.shuffle_buffer": "[1, inf)",
    "data.valid_max_rows": "[1, inf)",
    "samples.top_k": "[1, inf) or null",
}


def check_ranges(cfg, ranges: dict[str, str] = RANGES) -> None:
    """Raise ConfigError for the first field of `ranges` outside its interval, naming both."""
    for key, spec in ranges.items():
        path, _, option = key.partition("@")
        *parents, leaf = path.split(".")
        section = cfg
        for part in parents:
            section = getattr(section, part)
        node = getattr(section, leaf, _ABSENT)
        if node is _ABSENT or (option and section.name != option):
            continue  # not a field of the chosen option
        interval, optional = spec.removesuffix(" or null"), spec.endswith(" or null")
        if node is None and optional:
            continue
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        ok = node is not None and (lo <= node if interval[0] == "[" else lo < node)
        ok = ok and (node <= hi if interval[-1] == "]" else node < hi)
        _check(ok, f"{path}={node} must be in {spec}")


_ABSENT = object()


def validate(cfg: RunConfig) -> None:
    # Imported here: the registries live with the concepts they name.
    from dalle_ablate.data import DATASETS
    from dalle_ablate.model import validate_model
    from dalle_ablate.optim import OPTIMIZERS, SCHEDULES

    validate_model(cfg.model)
    check_ranges(cfg)
    OPTIMIZERS.get(cfg.optim.name)
    SCHEDULES.get(cfg.schedule.name)
    DATASETS.get(cfg.data.name)
    t = cfg.trainer
    for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "save_every"):
        _check(getattr(t, name) > 0, f"trainer.{name}={getattr(t, name)} must be positive")
    _check(
        t.batch_size % t.grad_accum == 0,
        f"trainer.batch_size={t.batch_size} is not divisible by trainer.grad_accum={t.grad_accum}",
    )
    _check(cfg.optim.lr > 0, f"optim.lr={cfg.optim.lr} must be positive")
    if cfg.optim.name == "shampoo":
        from dalle_ablate.optim.shampoo import GRAFT_SCOPES, GRAFTS, ROOT_DTYPES, STATISTICS_DTYPES

        for name, valid in (("graft", GRAFTS), ("graft_scope", GRAFT_SCOPES), ("statistics_dtype", STATISTICS_DTYPES),
                            ("root_dtype", ("auto", *ROOT_DTYPES))):
            value = getattr(cfg.optim, name)
            _check(value in valid, f"optim.{name}={value!r} is not valid; valid: {', '.join(sorted(valid))}")
    bad = [o for o in cfg.objectives if o not in OBJECTIVES]
    _check(bool(cfg.objectives) and not bad, f"objectives={list(cfg.objectives)}: {bad or 'empty'}; valid: {', '.join(OBJECTIVES)}")
    sc = cfg.schedule
    _check(sc.warmup_steps >= 0, f"schedule.warmup_steps={sc.warmup_steps} must be >= 0")
    _check(
        sc.allow_long_warmup or sc.lr_offset + sc.warmup_steps < t.steps,
        f"schedule.warmup_steps={sc.warmup_steps} (after schedule.lr_offset={sc.lr_offset}) is not shorter than "
        f"trainer.steps={t.steps}: the learning rate would never reach optim.lr; shorten it, or set "
        f"schedule.allow_long_warmup=true",
    )
    _check(
        cfg.data.name != "shapes" or cfg.data.min_objects <= cfg.data.max_objects,
        f"data.min_objects={getattr(cfg.data, 'min_objects', None)} exceeds data.max_objects={getattr(cfg.data, 'max_objects', None)}",
    )
    _check(0.0 <= cfg.data.blank_caption_prob <= 1.0, f"data.blank_caption_prob={cfg.data.blank_caption_prob} must be in [0, 1]")
    _check(
        cfg.tracker.backend in ("wandb", "none"),
        f"tracker.backend={cfg.tracker.backend!r} is not a known tracker; valid: none, wandb",
    )
    _check(
        cfg.tracker.wandb.mode in ("offline", "online", "disabled"),
        f"tracker.wandb.mode={cfg.tracker.wandb.mode!r} is not valid; valid: disabled, offline, online",
    )
    _check(
        cfg.tracker.wandb.fallback in (None, "offline"),
        f"tracker.wandb.fallback={cfg.tracker.wandb.fallback!r} is not valid; valid: offline, null",
    )
    from dalle_ablate.evaluate import EVALUATORS, PROMPT_LISTS
    from dalle_ablate.generate import check_sampling

    e = cfg.eval
    for name in e.metrics:
        EVALUATORS.get(name)
    for name in e.grids:
        PROMPT_LISTS.get(name)
    _check(e.every >= 0, f"eval.every={e.every} must be >= 0 (0 = only at the end of the run)")
    for name in ("num_samples", "batch_size", "sensitivity_examples", "grid_samples"):
        _check(getattr(e, name) > 0, f"eval.{name}={getattr(e, name)} must be positive")
    _check(e.grid_prompts is None or e.grid_prompts > 0, f"eval.grid_prompts={e.grid_prompts} must be positive or null")
    _check(bool(e.guidance_scales), "eval.guidance_scales is empty; give at least one scale, e.g. [1]")
    for name in ("guidance_scales", "grid_scales"):
        bad = [s for s in getattr(e, name) if not s >= 0]
        _check(not bad, f"eval.{name} has {bad}; scales must be >= 0 (1 = unguided)")
    check_sampling(e.temperature, e.top_k, e.top_p, "eval")
    _check(cfg.samples.per_caption > 0, f"samples.per_caption={cfg.samples.per_caption} must be positive")
    _check(cfg.samples.temperature > 0, f"samples.temperature={cfg.samples.temperature} must be positive")


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The typed, validated config. Raises ConfigError naming the field and the valid values."""
    if isinstance(cfg, RunConfig):
        run = cfg
    else:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(f"missing value for {', '.join(missing)} (set it on the command line, e.g. {missing[0]}=...)")
        run = OmegaConf.to_object(cfg)
    validate(run)
    return run
