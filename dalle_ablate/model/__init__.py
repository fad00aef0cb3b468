"""Model families and their variant flags. `build_model` is the one way to make a model."""

from __future__ import annotations

import dataclasses

import flax
import jax
import optax
from flax import nnx

from dalle_ablate.model.layers import ACTIVATIONS, NORMS
from dalle_ablate.model.layouts import LAYOUTS, check_layout
from dalle_ablate.model.seq2seq import Seq2Seq
from dalle_ablate.registry import ConfigError, Registry

# Parameters carry logical axis names only; `dalle_ablate.parallel` places them on a mesh. Flax
# would otherwise try to shard every annotated variable eagerly, at creation, against a global mesh.
flax.config.update("flax_always_shard_variable", False)

FAMILIES: Registry = Registry("model family", "model.family")
FAMILIES.register("seq2seq", Seq2Seq)


def token_nll(model: nnx.Module, text, text_mask, codes, dropout_key=None) -> jax.Array:
    """Teacher-forced NLL of every image code, float32 [B, I]: the training loss and the
    evaluation's caption scores alike."""
    logits = model(text, text_mask, codes, dropout_key=dropout_key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, codes)


def validate_model(cfg) -> None:
    """Check a ModelConfig before anything is built; messages name the flags."""
    FAMILIES.get(cfg.family)
    LAYOUTS.get(cfg.layout)
    NORMS.get(cfg.norm)
    ACTIVATIONS.get(cfg.activation)
    for name in ("d_model", "heads", "encoder_layers", "decoder_layers", "ffn_dim", "text_len", "vocab_pad_multiple"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(cfg, name)} must be positive")
    if cfg.d_model % cfg.heads:
        raise ConfigError(f"model.d_model={cfg.d_model} is not divisible by model.heads={cfg.heads}")
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"model.{name}={getattr(cfg, name)} must be in [0, 1)")
    if cfg.smelu_beta <= 0:
        raise ConfigError(f"model.smelu_beta={cfg.smelu_beta} must be positive")
    if cfg.tau_init <= 0 or cfg.tau_min <= 0:
        raise ConfigError(f"model.tau_init={cfg.tau_init} and model.tau_min={cfg.tau_min} must be positive")
    if cfg.learn_tau and not cfg.cosine_attention:
        raise ConfigError("model.learn_tau=true conflicts with model.cosine_attention=false: tau is the cosine attention's temperature")
    if cfg.position_bias and cfg.image_len is not None and round(cfg.image_len**0.5) ** 2 != cfg.image_len:
        raise ConfigError(f"model.position_bias=true needs a square image grid; model.image_len={cfg.image_len} is not a square")
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"model.dtype={cfg.dtype!r} is not valid; valid: bfloat16, float16, float32")
    if cfg.remat not in ("none", "full", "dots_saveable"):
        raise ConfigError(f"model.remat={cfg.remat!r} is not valid; valid: dots_saveable, full, none")
    if cfg.scan_layers and cfg.swin_ln_every:
        raise ConfigError(f"model.scan_layers=true conflicts with model.swin_ln_every={cfg.swin_ln_every}: "
                          "a scanned stack has no room for norms between some of its layers")
    check_layout(cfg)


def resolve(cfg, image_len: int, image_vocab: int, text_vocab: int):
    """The model config with the data-dependent sizes filled in; a preset that fixes them must
    agree with the data."""
    for name, value in (("image_len", image_len), ("image_vocab", image_vocab)):
        set_to = getattr(cfg, name)
        if set_to is not None and set_to != value:
            raise ConfigError(f"model.{name}={set_to} but the data gives {value}; set model.{name}=null or change the data")
    # A preset may reserve more text rows than the tokenizer uses, never fewer.
    if cfg.text_vocab is not None and cfg.text_vocab < text_vocab:
        raise ConfigError(f"model.text_vocab={cfg.text_vocab} is smaller than the tokenizer's {text_vocab} tokens")
    return dataclasses.replace(cfg, image_len=image_len, image_vocab=image_vocab, text_vocab=cfg.text_vocab or text_vocab)


def build_model(cfg, seed: int) -> nnx.Module:
    """A model with parameters initialised from the seed (logical axes attached, not yet sharded)."""
    validate_model(cfg)
    for name in ("image_len", "image_vocab", "text_vocab"):
        if getattr(cfg, name) is None:
            raise ConfigError(f"model.{name} is not set and no data gave it")
    return FAMILIES.get(cfg.family)(cfg, nnx.Rngs(params=jax.random.key(seed)))


def abstract_model(cfg) -> nnx.Module:
    """The model's shapes only (nothing allocated): works for size=mega on a laptop."""
    return nnx.eval_shape(lambda: build_model(cfg, 0))


def param_count(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["FAMILIES", "LAYOUTS", "abstract_model", "build_model", "param_count", "resolve", "validate_model"]
