"""The evaluator registry. A `samples` evaluator scores generated images against their prompts
(and scene specs), once per guidance scale; a `model` evaluator needs no sampling and runs once
per evaluation. Each returns named metrics and the number of samples behind them (`<name>/n`).

An evaluator is one module (`shapes_parser.py`, `shapes_features.py`, `fid.py`, `clip.py`,
`caption_sensitivity.py`) that registers its scoring function with `@evaluator(...)`. One with
settings also gives their dataclass (`settings=`): it is the section `eval.<name>`, its RANGES and
`validate(run)` run with the run config's checks (when the evaluator is chosen), before anything is
built, and its `setup(settings, eval_cfg)` builds what it loads once (pretrained networks,
reference statistics) when the Evaluation is made. Its metrics that pages read (a headline, a Pareto
axis, one a study judges) are declared with it (`metrics=`, dalle_ablate/metrics.py).

What an evaluator is given of the Evaluation is typed by `SamplesContext` and `ModelContext`: the
fixed prompts and scene specs, the data, its cache, and the few methods it may call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from dalle_ablate.metrics import Metric, declare
from dalle_ablate.registry import Registry


class SamplesContext(Protocol):
    """What a `samples` evaluator reads of the Evaluation (evaluate/runner.py) it is called from."""

    prompts: list[str]  # the evaluation prompts, fixed for the Evaluation's life; images[i] drew prompts[i]
    specs: Optional[list[dict]]  # their scene specs (data=shapes), else None
    dataset: Any  # the run's data.base.Dataset: its name, text tokenizer, image decoder
    cache: dict[str, Any]  # what the evaluators compute once per Evaluation: cache[<name>] is its setup's result
    cache_dir: str  # data.cache_dir: where features and statistics computed once are kept

    def reference_images(self) -> np.ndarray:
        """The real images of the prompts, [N, H, W, 3] uint8 (computed once)."""


class ModelContext(Protocol):
    """What a `model` evaluator reads of the Evaluation: the data and the model's per-image NLL."""

    dataset: Any

    def per_image_nll(self, ids: np.ndarray, mask: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """Each image's summed teacher-forced NLL given its caption's ids and mask, [N]."""


@dataclass(frozen=True)
class Evaluator:
    kind: str  # "samples" or "model"
    fn: Callable
    needs_specs: bool = False  # the data must carry scene specs (data=shapes), else it is skipped
    settings: Optional[type] = None  # the OptionConfig dataclass of eval.<name>
    setup: Optional[Callable] = None  # (eval.<name>, eval config) -> what fn finds in ctx.cache[<name>]

    def available(self, dataset) -> bool:
        return not self.needs_specs or getattr(dataset, "specs", None) is not None


EVALUATORS: Registry[Evaluator] = Registry("evaluator", "eval.metrics")


def evaluator(
    name: str,
    kind: str,
    *,
    needs_specs: bool = False,
    settings: Optional[type] = None,
    setup: Optional[Callable] = None,
    metrics: Sequence[Metric] = (),
) -> Callable[[Callable], Callable]:
    """Decorator registering a scoring function as evaluator `name` of `eval.metrics`:
    `fn(images, ctx: SamplesContext)` for a `samples` evaluator, `fn(ctx: ModelContext, specs, codes,
    seed)` for a `model` one. `metrics`: the declarations of those of its metrics pages read, each
    keyed by the name `fn` returns it under (`all`: logged as `<name>/all`)."""
    if kind not in ("samples", "model"):
        raise ValueError(f"evaluator {name!r}: kind {kind!r} is not 'samples' or 'model'")

    def add(fn: Callable) -> Callable:
        EVALUATORS.register(name, Evaluator(kind, fn, needs_specs, settings, setup))
        declare(*(dataclasses.replace(m, key=f"{name}/{m.key}", source=kind) for m in metrics))
        return fn

    return add
