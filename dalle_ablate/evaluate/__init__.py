"""Evaluation: evaluators behind one registry, run per guidance scale (the Pareto curve), and
prompt grids. `Evaluation` is what the trainer calls every `eval.every` steps and what
`dalle-ablate eval` runs on a checkpoint."""

from dalle_ablate.evaluate.evaluators import EVALUATORS, Evaluator
from dalle_ablate.evaluate.prompts import PROMPT_LISTS

__all__ = ["EVALUATORS", "Evaluator", "PROMPT_LISTS"]
