"""One run put together from its config, in one place: device mesh, dataset, model config with the
data's sizes, graph, optimizer and schedule, placement, and the train state. Training, `dalle-ablate
eval`, the mesh tests and the benchmarks all start here, so they cannot drift apart; `describe`
and `plan`, which count a run on a mesh this machine need not have, start from `abstract_run`."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import optax
from flax import nnx
from jax.sharding import Mesh

from dalle_ablate.config import RunConfig, init_seed
from dalle_ablate.data import Dataset, abstract_sizes, build_dataset
from dalle_ablate.model import abstract_model, init_keys, model_from_keys, resolve
from dalle_ablate.optim import build_optimizer
from dalle_ablate.parallel import (
    Placement,
    abstract_state,
    build_mesh,
    check_batch,
    init_state,
    make_placement,
    pad_vocab_for_mesh,
)
from dalle_ablate.parallel import stack_sharding
from dalle_ablate.train.grad_scaling import block_names, scaler_init
from dalle_ablate.train.gradients import GradientOptions
from dalle_ablate.train.state import TrainState, state_maker
from dalle_ablate.train.step import make_train_step


@dataclass
class Assembly:
    cfg: RunConfig
    mesh: Mesh
    dataset: Optional[Dataset]  # None when the sizes were given instead (nothing read)
    model_cfg: Any  # the ModelConfig with the data's sizes, vocabulary rows padded for the mesh
    abstract: nnx.Module  # the model's shapes, nothing allocated
    optimizer: optax.GradientTransformation
    new_state: Callable[[Any], TrainState]  # params -> the state at step 0 (train/state.py)
    schedule: optax.Schedule
    placement: Placement

    @functools.cached_property
    def graphdef(self):
        return nnx.split(self.abstract, nnx.Param)[0]

    @functools.cached_property
    def gradient_options(self) -> GradientOptions:
        """What the config says about the gradient path (its stages, a caller's own among them)."""
        return GradientOptions.of(self.cfg)

    @property
    def tokens_per_step(self) -> int:
        """Text and image tokens in one global batch."""
        return self.cfg.trainer.batch_size * (self.model_cfg.text_len + self.model_cfg.image_len)

    def init_state(self) -> TrainState:
        """The initial state from the run's init seed, created in its shards."""
        keys = init_keys(self.model_cfg, init_seed(self.cfg))
        return init_state(lambda k: model_from_keys(self.model_cfg, k), self.new_state, self.placement, keys)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state, nothing allocated: a checkpoint's restore target."""
        return abstract_state(lambda: abstract_model(self.model_cfg), self.new_state, self.placement)

    def train_step(self):
        """The jitted step (state, global batch) -> (state, metrics)."""
        return make_train_step(
            self.graphdef, self.optimizer, self.schedule, self.gradient_options, self.cfg.seed, self.placement
        )


def assemble(
    cfg: RunConfig,
    *,
    dataset: Optional[Dataset] = None,
    sizes: Optional[dict] = None,
    devices=None,
    model_axis: Optional[int] = None,
    dtype: Optional[str] = None,
) -> Assembly:
    """The run of `cfg` on `devices` (default: all). Its data: `dataset` if given, else the
    `sizes` (image_len, image_vocab, text_vocab; no data read: `data.abstract_sizes` gives them
    from the config), else the dataset the config names, built here. `model_axis`: pad the
    vocabulary rows for this model axis instead of the mesh's (a checkpoint saved on another
    mesh); `dtype`: the compute dtype instead of the config's (evaluation runs in float32). The
    mesh and batch are checked before any data is read or anything compiles."""
    mesh = build_mesh(cfg.mesh, devices)
    check_batch(cfg.trainer, tuple(mesh.shape.values()))
    if sizes is None:
        dataset = dataset if dataset is not None else build_dataset(cfg.data, cfg.model)
        sizes = {
            "image_len": dataset.image_len,
            "image_vocab": dataset.image_vocab,
            "text_vocab": dataset.text.vocab_size,
        }
    model_cfg = pad_vocab_for_mesh(
        resolve(cfg.model, **sizes), mesh.shape["model"] if model_axis is None else model_axis
    )
    if dtype is not None:
        model_cfg = dataclasses.replace(model_cfg, dtype=dtype)
    abstract = abstract_model(model_cfg)
    optimizer, schedule = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps, stack_sharding(mesh))
    new_state = _state_maker(cfg, optimizer, abstract, mesh.shape["data"])
    placement = make_placement(mesh, abstract, new_state)
    return Assembly(cfg, mesh, dataset, model_cfg, abstract, optimizer, new_state, schedule, placement)


def _state_maker(cfg: RunConfig, optimizer, abstract, workers: int) -> Callable[[Any], TrainState]:
    """params -> the run's state at step 0: the optimizer's, and the gradient scaler's and
    PowerSGD's when the config turns them on."""
    t, psgd = cfg.trainer, cfg.optim.powersgd
    scaler = None if t.grad_scaling == "none" else scaler_init(t.grad_scaling, block_names(abstract), t.grad_scale_init)
    return state_maker(optimizer, scaler, psgd if psgd.rank is not None else None, workers)


def abstract_run(cfg: RunConfig) -> tuple[Any, Callable[[Any], TrainState]]:
    """(model config, params -> its train state) of `cfg` from the config alone: the sizes its
    data implies, nothing read, and no mesh built, so that a run of any size on any mesh can be
    counted here."""
    model_cfg = resolve(cfg.model, **abstract_sizes(cfg.data, cfg.model))
    optimizer, _ = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps)
    return model_cfg, _state_maker(cfg, optimizer, abstract_model(model_cfg), max(cfg.mesh.data, 1))
