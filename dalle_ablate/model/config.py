"""What every model family's config has (the layout flags and the shape), its checks, and the
FAMILIES registry each family module registers its config and class in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dalle_ablate.model.layers import ACTIVATIONS, NORMS
from dalle_ablate.model.layouts import LAYOUTS, check_layout
from dalle_ablate.registry import ConfigError, OptionConfig, Registry

# name -> the family's nnx.Module class, called as cls(model cfg, rngs)
FAMILIES: Registry = Registry("model family", "model", key="family")


@dataclass
class ModelConfig(OptionConfig):
    """Architecture. `conf/model/<layout>.yaml` sets the layout flags; `conf/size/` the shape (the
    defaults here are size=tiny's). A family (`family`, registered by `FAMILIES.option`) subclasses
    it with its own default."""

    family: str = "seq2seq"  # seq2seq: an encoder-decoder (DALL·E mini / Mega); set by the model preset
    layout: str = "preln"  # where the norms sit: see docs/variants.md "Layouts"
    d_model: int = 128  # width of the residual stream
    heads: int = 4  # attention heads (each d_model / heads wide)
    encoder_layers: int = 2  # layers of the text encoder (single_stream: with decoder_layers, its depth)
    decoder_layers: int = 2  # layers of the image decoder
    ffn_dim: int = 344  # hidden width of the FFN (with GLU, ~2/3 of the dense width)
    text_len: int = 32  # text positions, BOS and EOS included
    image_len: Optional[int] = None  # image tokens per image; null = the data's patch grid (large presets set it)
    image_vocab: Optional[int] = None  # codes of the image tokenizer; null = the data's codebook
    text_vocab: Optional[int] = None  # text tokens; null = the tokenizer's (a larger value leaves rows unused)
    norm: str = "layernorm"  # layernorm | rmsnorm
    ln_eps: float = 1e-5  # epsilon of every norm's variance (LayerNorm, RMSNorm)
    force_ln_scale: bool = False  # learned scale also on norms that feed a Dense layer
    activation: str = "gelu"  # gelu | swish | relu | smelu
    gelu_approximate: bool = False  # tanh approximation of gelu
    smelu_beta: float = 1.0  # SmeLU half-width
    glu: bool = True  # W_o (act(W_g x) * (W_v x))
    head_scale: bool = False  # NormFormer per-head scale
    final_ln_encoder: bool = True  # a norm after the encoder's last layer
    final_ln_decoder: bool = True  # a norm after the decoder's last layer, before the logits
    # A pre-norm decoder without its final norm is refused (the DALL·E mini study found it unstable)
    # unless this is false: the Mega study's arm that tests that finding (conf/arm/no_final_ln_decoder).
    require_final_ln_decoder: bool = True
    swin_ln_every: Optional[int] = None  # swinv2: a norm on the residual stream every k layers
    cosine_attention: bool = False  # Swin v2: cos(q, k) / tau instead of q.k / sqrt(d)
    tau_init: float = 0.05  # cosine attention temperature (fixed, or the init of a learned one)
    learn_tau: bool = False  # learn tau per head and layer, clamped at >= tau_min
    tau_min: float = 0.01  # the floor of a learned tau (Swin v2: 0.01)
    # NormSoftmax (Hoffmann et al. 2024, "Eureka-moments in transformers"): q.k / min(sqrt(d), their std
    # over the keys each query sees) instead of q.k / sqrt(d); a cure for softmax-held loss plateaus
    norm_softmax: bool = False
    position_bias: bool = False  # Swin v2 log-spaced continuous position bias on image self-attention
    cpb_hidden: int = 64  # hidden width of the position-bias MLP
    bias: bool = False  # DALL·E mini study: biases cost time and hurt convergence
    init_std: float = 0.02  # standard deviation of the normal initialisation of every weight (DeepNet scales some)
    dropout: float = 0.0  # on embeddings and on every sublayer output
    attention_dropout: float = 0.0  # on attention weights
    activation_dropout: float = 0.0  # after the FFN activation
    scale_embedding: bool = False  # multiply embeddings by sqrt(d_model)
    dtype: str = "float32"  # compute dtype; norms, softmax and loss stay float32
    remat: str = "none"  # per-layer rematerialisation: none | full | dots_saveable
    scan_layers: bool = False  # compile one layer and scan it over each stack (faster compiles)
    vocab_pad_multiple: int = 8  # embedding / logits rows padded up to a multiple of this

    # The empty caption (blank-caption training, super conditioning's unconditional branch) as
    # the family reads it: the tokenizer's "" (BOS, EOS), or, when True, every text position
    # left empty (the single-stream family's all-padding caption). The data layer reads it.
    blank_is_padding: ClassVar[bool] = False

    def loss_weights(self) -> dict[str, float]:
        """Weight of each predicted stream's mean NLL in the training objective."""
        return {"image": 1.0}

    def validate(self, run=None) -> None:
        """Check before anything is built; messages name the flags."""
        LAYOUTS.get(self.layout)
        NORMS.get(self.norm)
        ACTIVATIONS.get(self.activation)
        for name in (
            "d_model",
            "heads",
            "encoder_layers",
            "decoder_layers",
            "ffn_dim",
            "text_len",
            "vocab_pad_multiple",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be positive")
        if self.d_model % self.heads:
            raise ConfigError(f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be in [0, 1)")
        if self.smelu_beta <= 0:
            raise ConfigError(f"model.smelu_beta={self.smelu_beta} must be positive")
        if self.tau_init <= 0 or self.tau_min <= 0:
            raise ConfigError(f"model.tau_init={self.tau_init} and model.tau_min={self.tau_min} must be positive")
        if self.learn_tau and not self.cosine_attention:
            raise ConfigError(
                "model.learn_tau=true conflicts with model.cosine_attention=false: tau is the cosine attention's temperature"
            )
        if self.norm_softmax and self.cosine_attention:
            raise ConfigError(
                "model.norm_softmax=true conflicts with model.cosine_attention=true: each sets the softmax's temperature"
            )
        if self.position_bias and self.image_len is not None and round(self.image_len**0.5) ** 2 != self.image_len:
            raise ConfigError(
                f"model.position_bias=true needs a square image grid; model.image_len={self.image_len} is not a square"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype={self.dtype!r} is not valid; valid: bfloat16, float16, float32")
        if self.remat not in ("none", "full", "dots_saveable"):
            raise ConfigError(f"model.remat={self.remat!r} is not valid; valid: dots_saveable, full, none")
        if self.scan_layers and self.swin_ln_every:
            raise ConfigError(
                f"model.scan_layers=true conflicts with model.swin_ln_every={self.swin_ln_every}: "
                "a scanned stack has no room for norms between some of its layers"
            )
        check_layout(self)
