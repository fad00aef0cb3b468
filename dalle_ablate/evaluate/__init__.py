"""Evaluation: evaluators behind one registry, run per guidance scale (the Pareto curve), and
prompt grids. `Evaluation` is what the trainer calls every `eval.every` steps and what
`dalle-ablate eval` runs on a checkpoint. Importing the package registers every evaluator (each
module below registers its own) and the `eval` schema."""

from dalle_ablate.evaluate import caption_sensitivity, shapes_features, shapes_parser  # noqa: F401 (registration)
from dalle_ablate.evaluate.config import EvalConfig
from dalle_ablate.evaluate.evaluators import EVALUATORS, Evaluator, evaluator
from dalle_ablate.evaluate.prompts import PROMPT_LISTS

__all__ = ["EVALUATORS", "EvalConfig", "Evaluator", "PROMPT_LISTS", "evaluator"]
