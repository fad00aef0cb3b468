"""Model families and their variant flags. `build_model` is the one way to make a model."""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dalle_ablate.model import seq2seq, single_stream  # noqa: F401 - registers the families
from dalle_ablate.model.config import FAMILIES, ModelConfig
from dalle_ablate.model.grad_scale import BlockScale
from dalle_ablate.model.init_keys import Draws, keyed_draws
from dalle_ablate.model.layouts import LAYOUTS
from dalle_ablate.registry import ConfigError

# Parameters carry logical axis names only; `dalle_ablate.parallel` places them on a mesh. Flax
# would otherwise try to shard every annotated variable eagerly, at creation, against a global mesh.
flax.config.update("flax_always_shard_variable", False)


def token_nll(model: nnx.Module, text, text_mask, codes, dropout_key=None) -> jax.Array:
    """Teacher-forced NLL of every image code, float32 [B, I]: the training loss and the
    evaluation's caption scores alike."""
    logits = model(text, text_mask, codes, dropout_key=dropout_key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, codes)


def stream_nll(model: nnx.Module, text, text_mask, codes, dropout_key=None, grad_scales=None) -> dict[str, jax.Array]:
    """Per-token NLL, float32, of each stream the family predicts (`image` [B, I], and `text`
    for the single-stream family): what the training objective weighs by `loss_weights()`.
    `grad_scales`: per-resblock gradient scaling ({stack: BlockScale}, model/grad_scale.py)."""
    return model.nll(text, text_mask, codes, dropout_key=dropout_key, grad_scales=grad_scales)


def resolve(cfg, image_len: int, image_vocab: int, text_vocab: int):
    """The model config with the data-dependent sizes filled in; a preset that fixes them must
    agree with the data."""
    for name, value in (("image_len", image_len), ("image_vocab", image_vocab)):
        set_to = getattr(cfg, name)
        if set_to is not None and set_to != value:
            raise ConfigError(
                f"model.{name}={set_to} but the data gives {value}; set model.{name}=null or change the data"
            )
    # A preset may reserve more text rows than the tokenizer uses, never fewer.
    if cfg.text_vocab is not None and cfg.text_vocab < text_vocab:
        raise ConfigError(f"model.text_vocab={cfg.text_vocab} is smaller than the tokenizer's {text_vocab} tokens")
    return dataclasses.replace(
        cfg, image_len=image_len, image_vocab=image_vocab, text_vocab=cfg.text_vocab or text_vocab
    )


def _family(cfg):
    FAMILIES.validate(cfg, None)  # also for a model config that did not come from a run
    for name in ("image_len", "image_vocab", "text_vocab"):
        if getattr(cfg, name) is None:
            raise ConfigError(f"model.{name} is not set and no data gave it")
    return FAMILIES.get(cfg.family)


def build_model(cfg, seed: int) -> nnx.Module:
    """A model with parameters initialised from the seed (the run's init seed; logical axes
    attached, not yet sharded). Each parameter's key is the seed's folded with its path
    (model/init_keys.py): models that share a parameter's path and shape start it alike."""
    return model_from_keys(cfg, init_keys(cfg, seed))


def init_keys(cfg, seed: int) -> np.ndarray:
    """The key of every parameter draw of the model for `seed` (model/init_keys.py), as raw key
    data [draws, ...] computed here, outside any compiled program: a compiled initialiser that
    takes them as its argument (model_from_keys) is one program for every seed, compiled once and
    then loaded from the persistent compilation cache (with the seed inside it, each seed was a
    program of its own: 4-7 s of compiling per run of the tiny model on 2 CPU cores). Numpy, so that
    every process of a multi-process run passes the same host value."""
    family = _family(cfg)
    construct = lambda rngs: family(cfg, rngs)  # noqa: E731
    keys = keyed_draws(construct, jax.random.key(seed)).keys
    return np.stack([np.asarray(jax.random.key_data(k)) for k in keys]) if keys else np.zeros((0, 2), np.uint32)


def model_from_keys(cfg, keys) -> nnx.Module:
    """The model with each parameter drawn from its key in `keys` (init_keys's, traced or not)."""
    family = _family(cfg)
    wrapped = jax.random.wrap_key_data(jnp.asarray(keys))
    return family(cfg, Draws([wrapped[i] for i in range(wrapped.shape[0])]))


def abstract_model(cfg) -> nnx.Module:
    """The model's shapes only (nothing allocated): works for size=mega on a laptop."""
    family = _family(cfg)
    return nnx.eval_shape(lambda: family(cfg, Draws()))


def param_count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = [
    "BlockScale",
    "FAMILIES",
    "LAYOUTS",
    "ModelConfig",
    "abstract_model",
    "build_model",
    "init_keys",
    "model_from_keys",
    "param_count",
    "resolve",
    "stream_nll",
    "token_nll",
]
