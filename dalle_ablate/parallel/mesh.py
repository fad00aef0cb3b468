"""The device mesh: axes `data` (batch split, parameters replicated), `fsdp` (batch split and
parameters sharded, ZeRO-3 style, arXiv 1910.02054) and `model` (tensor parallel over heads, MLP
and vocabulary, Megatron-style, arXiv 1909.08053). DALL·E Mega trained as 32 data x 8 model."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

from dalle_ablate.registry import ConfigError

AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both; parameters only over fsdp and model


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, model) with at most one -1 filled in by the remaining devices; the product
    must be the device count."""
    sizes = [int(getattr(mesh_cfg, a)) for a in AXES]
    for a, s in zip(AXES, sizes):
        if s == 0 or s < -1:
            raise ConfigError(f"mesh.{a}={s} must be a positive size or -1 (the remaining devices)")
    free = [a for a, s in zip(AXES, sizes) if s == -1]
    if len(free) > 1:
        raise ConfigError(
            f"mesh.{free[0]} and mesh.{free[1]} are both -1; at most one axis can take the remaining devices"
        )
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh {dict(zip(AXES, sizes))}: the fixed axes ({fixed} devices) do not divide the {n_devices} devices"
            )
        sizes[sizes.index(-1)] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(
            f"mesh.data x mesh.fsdp x mesh.model = {' x '.join(map(str, sizes))} = {fixed}, but there are "
            f"{n_devices} devices; make the product {n_devices} or set one axis to -1"
        )
    return tuple(sizes)  # type: ignore[return-value]


def build_mesh(mesh_cfg, devices=None) -> Mesh:
    """A Mesh over all devices (of every process), shaped by mesh_shape. Devices are laid out so
    that `model`, the axis with the most traffic, is innermost (neighbouring devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def batch_parallelism(shape: tuple[int, int, int]) -> int:
    return shape[0] * shape[1]


def check_batch(trainer_cfg, shape: tuple[int, int, int]) -> None:
    """The global batch (and each micro-batch) must split evenly over data x fsdp."""
    dp = batch_parallelism(shape)
    micro = trainer_cfg.batch_size // trainer_cfg.grad_accum
    if micro % dp:
        what = "trainer.batch_size" if trainer_cfg.grad_accum == 1 else "trainer.batch_size / trainer.grad_accum"
        raise ConfigError(
            f"{what}={micro} is not divisible by the data-parallel size mesh.data x mesh.fsdp = {shape[0]} x {shape[1]} = {dp}"
        )


def pad_vocab_for_mesh(model_cfg, model_axis: int):
    """Vocabulary rows padded to a multiple of the model axis too, so that the embeddings and
    the logits head split evenly over it."""
    return dataclasses.replace(model_cfg, vocab_pad_multiple=math.lcm(model_cfg.vocab_pad_multiple, model_axis))
