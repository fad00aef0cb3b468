"""Optimizers (optax GradientTransformations) and learning-rate schedules, by name."""

from __future__ import annotations

import re

import jax
import optax

from dalle_ablate.optim.schedules import SCHEDULES, build_schedule
from dalle_ablate.optim.shampoo import STATISTICS_DTYPES, scale_by_shampoo, shampoo_stats
from dalle_ablate.registry import ConfigError, Registry

OPTIMIZERS: Registry = Registry("optimizer", "optim")


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def decay_mask(exclude: list[str], field: str = "optim.wd_exclude"):
    """A mask function for optax: True where no exclude regex matches the parameter's path."""
    try:
        patterns = [re.compile(p) for p in exclude]
    except re.error as e:
        raise ConfigError(f"{field} has an invalid regex: {e}") from e

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda p, _: not any(r.search(path_str(p)) for r in patterns), params)

    return mask


@OPTIMIZERS.register("adam")
def _adam(cfg, lr, stack_sharding) -> optax.GradientTransformation:
    # AdamW (Loshchilov & Hutter, arXiv 1711.05101): decoupled, masked weight decay.
    return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, eps_root=cfg.eps_root, weight_decay=cfg.weight_decay,
                       mask=decay_mask(cfg.wd_exclude), nesterov=cfg.nesterov)


def root_dtype(name: str) -> str:
    """optim.root_dtype: auto is float64 unless the backend is a TPU, which has no float64."""
    return ("float32" if jax.default_backend() == "tpu" else "float64") if name == "auto" else name


@OPTIMIZERS.register("shampoo")
def _shampoo(cfg, lr, stack_sharding) -> optax.GradientTransformation:
    # The grafted Shampoo direction with momentum, then decoupled weight decay, then the rate.
    if cfg.statistics_dtype not in STATISTICS_DTYPES:
        raise ConfigError(f"optim.statistics_dtype={cfg.statistics_dtype!r} is not valid; valid: {', '.join(STATISTICS_DTYPES)}")
    direction = scale_by_shampoo(
        block_size=cfg.block_size, beta1=cfg.b1, beta2=cfg.b2, graft=cfg.graft, graft_beta2=cfg.graft_b2,
        graft_eps=cfg.graft_eps, graft_scope=cfg.graft_scope, matrix_eps=cfg.matrix_eps, exponent_override=cfg.exponent_override,
        preconditioning_every=cfg.preconditioning_every, start_preconditioning_step=cfg.start_preconditioning_step,
        inverse_failure_threshold=cfg.inverse_failure_threshold,
        skip_preconditioning_dim_size_gt=cfg.skip_preconditioning_dim_size_gt, precondition_1d=cfg.precondition_1d,
        merge_small_dims=cfg.merge_small_dims,
        moving_average_for_momentum=cfg.moving_average_for_momentum, nesterov=cfg.nesterov,
        statistics_dtype=cfg.statistics_dtype, root_dtype=root_dtype(cfg.root_dtype), precondition_mask=decay_mask(cfg.no_precondition, "optim.no_precondition"),
        stack_sharding=stack_sharding,
    )
    return optax.chain(
        direction,
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(cfg.wd_exclude)),
        optax.scale_by_learning_rate(lr),
    )


@OPTIMIZERS.register("adafactor")
def _adafactor(cfg, lr, stack_sharding) -> optax.GradientTransformation:
    # Adafactor (Shazeer & Stern, arXiv 1804.04235).
    return optax.adafactor(
        lr,
        min_dim_size_to_factor=cfg.min_dim_size_to_factor,
        decay_rate=cfg.decay_rate,
        decay_offset=cfg.decay_offset,
        multiply_by_parameter_scale=cfg.multiply_by_parameter_scale,
        clipping_threshold=cfg.clipping_threshold,
        momentum=cfg.momentum,
        eps=cfg.eps,
        factored=cfg.factored,
        weight_decay_rate=cfg.weight_decay or None,
        weight_decay_mask=decay_mask(cfg.wd_exclude),
    )


def build_optimizer(optim_cfg, schedule_cfg, total_steps: int, stack_sharding=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(transformation, schedule): optional global-norm clipping, then the named optimizer.
    `stack_sharding`: where Shampoo's stacked state lives on the mesh (`parallel.stack_sharding`),
    so that each device refreshes its own blocks' roots; None on one device and for abstract
    shapes. This package builds no shardings itself."""
    schedule = build_schedule(schedule_cfg, optim_cfg.lr, total_steps)
    opt = OPTIMIZERS.get(optim_cfg.name)(optim_cfg, schedule, stack_sharding)
    if optim_cfg.clip_grad_norm is not None:
        if optim_cfg.clip_grad_norm <= 0:
            raise ConfigError(f"optim.clip_grad_norm={optim_cfg.clip_grad_norm} must be positive or null")
        opt = optax.chain(optax.clip_by_global_norm(optim_cfg.clip_grad_norm), opt)
    return opt, schedule


__all__ = ["OPTIMIZERS", "SCHEDULES", "build_optimizer", "build_schedule", "decay_mask", "scale_by_shampoo", "shampoo_stats"]
