"""The model-family contract: what a family class registered in FAMILIES provides to the sampler
(generate/), the trainer (train/, the loss and per-resblock gradient scaling) and the cost
accounting (model/flops.py, model/describe.py, parallel/plan.py).

`Family` and `FamilyCosts` declare it; the `family` class decorator checks a class against both
when it is defined, so a family that misses a member fails at import, naming it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol

import jax


class FamilyCosts(Protocol):
    """A family's cost formulas, from its config alone (no model built), in one class: a new
    sublayer adds its terms here. Each is a static method of the config `cfg`."""

    @staticmethod
    def forward_flops(cfg) -> int:
        """Matmul FLOPs of one example's forward pass (conventions in model/flops.py)."""

    @staticmethod
    def activation_elements(cfg, t: int) -> dict[str, float]:
        """Elements of activations kept per example for the backward pass by remat policy
        (`none`, `dots_saveable`, `full`), the model axis of size t splitting heads and FFN."""

    @staticmethod
    def logit_elements(cfg) -> int:
        """Logits of one example (each row over its padded vocabulary)."""

    @staticmethod
    def model_axis_reductions(cfg) -> int:
        """Activation elements all-reduced over the model axis per example, forward and backward."""


class Family(Protocol):
    """A model family: an nnx.Module class built as cls(model cfg, rngs), registered with
    `FAMILIES.option(name, Config)`."""

    # -- what the sampler reads (generate/sample.py) --
    bos_id: int  # the first decoder input
    image_vocab: int  # ids below it are codes; the rest of the logit rows are never sampled
    logit_rows: int  # width of the image logits

    def encode(self, text: jax.Array, text_mask: jax.Array) -> jax.Array:
        """The text [B, T] (mask [B, T]) as what `start_decoding` starts from."""

    def start_decoding(self, encoded: jax.Array) -> Any:
        """The decoding cache after `encode`'s output: the record `decode_step` reads and returns."""

    def decode_step(self, token: jax.Array, pos: jax.Array, cache: Any, text_mask: jax.Array) -> tuple[jax.Array, Any]:
        """Float32 logits [B, logit_rows] of image position `pos` after input `token` [B], and the
        cache with that input added; token by token equal to the teacher-forced logits."""

    # -- what the trainer and the evaluation read --
    def __call__(
        self, text: jax.Array, text_mask: jax.Array, codes: jax.Array, dropout_key: Optional[jax.Array] = None
    ) -> jax.Array:
        """Teacher-forced image logits [B, I, logit_rows] (caption scores, the eval loss)."""

    def nll(
        self,
        text: jax.Array,
        text_mask: jax.Array,
        codes: jax.Array,
        dropout_key: Optional[jax.Array] = None,
        grad_scales: Optional[dict] = None,
    ) -> dict[str, jax.Array]:
        """Per-token NLL of each stream the family predicts ({"image": [B, I], ...}), the
        training objective's input; `grad_scales` ({stack: BlockScale}) scales each block's
        gradients (model/grad_scale.py)."""

    # {stack attribute: its layer class}: the stacks of residual blocks; each layer class has
    # BRANCHES, {branch: the submodules whose parameters it holds}, in the order of its
    # BlockScale rows (train/grad_scaling.py reads both).
    STACKS: ClassVar[dict[str, type]]

    # -- what the cost accounting reads --
    COSTS: ClassVar[type[FamilyCosts]]


def members(protocol: type) -> list[str]:
    """The members a protocol declares: its annotated attributes and its methods (`__call__`
    included, other dunders not)."""
    names: list[str] = []
    for base in reversed(protocol.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        own = vars(base)
        for name in [*own.get("__annotations__", {}), *own]:
            value = own.get(name)
            declared = name in own.get("__annotations__", {}) or callable(value) or isinstance(value, staticmethod)
            if declared and (name == "__call__" or not name.startswith("_")) and name not in names:
                names.append(name)
    return names


def missing(cls: type, protocol: type) -> list[str]:
    """The members of `protocol` that `cls` lacks: a method or class attribute it does not
    define, or an instance attribute it neither defines nor annotates."""
    bases = [base for base in cls.__mro__ if base is not object]  # object gives every class a __call__ etc.
    return [
        n for n in members(protocol) if not any(n in vars(b) or n in vars(b).get("__annotations__", {}) for b in bases)
    ]


def family(cls: type) -> type:
    """Declares `cls` a `Family` (and its COSTS a `FamilyCosts`): a TypeError names what it lacks."""
    gaps = missing(cls, Family)
    if hasattr(cls, "COSTS"):
        gaps += [f"COSTS.{n}" for n in missing(cls.COSTS, FamilyCosts)]
    if gaps:
        raise TypeError(f"model family {cls.__name__} does not provide {', '.join(gaps)} (model/family.py: Family)")
    return cls


__all__ = ["Family", "FamilyCosts", "family", "members", "missing"]
