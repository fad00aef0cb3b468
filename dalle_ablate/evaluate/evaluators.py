"""The evaluator registry. A `samples` evaluator scores generated images against their prompts
(and scene specs), once per guidance scale; a `model` evaluator needs no sampling and runs once
per evaluation. Each returns named metrics and the number of samples behind them (`<name>/n`).

An evaluator is one module (`shapes_parser.py`, `shapes_features.py`, `fid.py`, `clip.py`,
`caption_sensitivity.py`) that registers its scoring function with `@evaluator(...)`. One with
settings also gives their dataclass (`settings=`): it is the section `eval.<name>`, its RANGES and
`validate(run)` run with the run config's checks (when the evaluator is chosen), before anything is
built, and its `setup(settings, eval_cfg)` builds what it loads once (pretrained networks,
reference statistics) when the Evaluation is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from dalle_ablate.registry import Registry


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


def evaluator(name: str, kind: str, *, needs_specs: bool = False, settings: Optional[type] = None,
              setup: Optional[Callable] = None) -> Callable[[Callable], Callable]:
    """Decorator registering a scoring function as evaluator `name` of `eval.metrics`:
    `fn(images, ctx)` for a `samples` evaluator, `fn(ctx, specs, codes, seed)` for a `model` one."""
    if kind not in ("samples", "model"):
        raise ValueError(f"evaluator {name!r}: kind {kind!r} is not 'samples' or 'model'")

    def add(fn: Callable) -> Callable:
        EVALUATORS.register(name, Evaluator(kind, fn, needs_specs, settings, setup))
        return fn

    return add
