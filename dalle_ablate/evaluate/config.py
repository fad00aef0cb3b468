"""The `eval` section: when and how a run is evaluated (guidance scales, prompts, sampling, grids),
which evaluators score it (`eval.metrics`) and, at `eval.<name>`, the settings of each evaluator
that has some, typed by the dataclass its own module registers with it. Presets in
`conf/eval/` start from this schema (`/schema/eval@_here_`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from dalle_ablate.evaluate.clip import ClipEvalConfig
from dalle_ablate.evaluate.contrastive import ScorerConfig
from dalle_ablate.evaluate.evaluators import EVALUATORS
from dalle_ablate.evaluate.fid import FidConfig
from dalle_ablate.evaluate.prompts import PROMPT_LISTS
from dalle_ablate.evaluate.rerank import SCORERS
from dalle_ablate.generate import check_sampling
from dalle_ablate.registry import OptionConfig, check


@dataclass
class EvalConfig(OptionConfig):
    """Sampling evaluation: metrics per guidance scale (the Pareto curve) and prompt grids. Runs
    every `every` steps during training, at the end of a run, and with `dalle-ablate eval`."""

    RANGES = {
        "every": "[0, inf)",
        "num_samples": "[1, inf)",
        "batch_size": "[1, inf)",
        "sensitivity_examples": "[1, inf)",
        "grid_prompts": "[1, inf) or null",
        "grid_samples": "[1, inf)",
        "rerank": "[1, inf)",
    }

    name: str = "default"  # which conf/eval preset this came from
    every: int = 0  # steps between evaluations during training; 0 = only at the end of the run
    # Super conditioning's guidance scales the metrics are measured at; 1 = unguided
    guidance_scales: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0, 5.0, 8.0])
    # The evaluators: shapes, shapes_fd, caption_sensitivity (the shapes data), fid, clip (weights needed)
    metrics: list[str] = field(default_factory=lambda: ["shapes", "shapes_fd", "caption_sensitivity"])
    # Stratified prompts (an equal share per difficulty tier), one sample each, the same at every scale
    # and in every run. 400 (100 per tier): McNemar's test then finds a 0.1 difference in all-correct
    # between two runs with power 0.8 even where their verdicts are independent (Connor 1987;
    # benchmarks/time_to_quality.py measures how far below that worst case two runs are).
    num_samples: int = 400
    batch_size: int = 32  # prompts sampled at once
    temperature: float = 1.0  # sampling temperature of the image codes (eval=default: 0.5)
    top_k: Optional[int] = None  # sample among the k likeliest codes only; null = all
    top_p: Optional[float] = None  # nucleus sampling: the likeliest codes holding this much probability; null = all
    sensitivity_examples: int = 64  # valid examples whose captions caption_sensitivity edits
    grids: list[str] = field(
        default_factory=lambda: ["shapesbench"]
    )  # prompt lists: shapesbench, drawbench, partiprompts
    grid_scales: list[float] = field(default_factory=lambda: [3.0])  # guidance scales the grids are drawn at
    grid_prompts: Optional[int] = 6  # prompts per category and grid (null = all)
    grid_samples: int = 4  # samples per prompt
    seed: int = 0  # the sampling noise: fixed across scales, steps and checkpoints
    # FID reference statistics (.npz, `dalle-ablate fid-reference`); null = the real images of the eval prompts
    reference: Optional[str] = None
    # Best-of-N reranking (evaluate/rerank.py): N samples per prompt, the scorer's favourite kept;
    # metrics at best-of-1, 2, 4, ..., N. 1 = off.
    rerank: int = 1
    rerank_scorer: str = "contrastive"  # contrastive (trained here on the shapes data) | clip (eval.clip.weights)
    rerank_scales: list[float] = field(default_factory=lambda: [1.0, 3.0])  # guidance scales reranked at
    scorer: ScorerConfig = field(default_factory=ScorerConfig)  # the contrastive scorer's training
    # Settings of the evaluators that have some (the field is the evaluator's name).
    fid: FidConfig = field(default_factory=FidConfig)  # Inception weights
    clip: ClipEvalConfig = field(default_factory=ClipEvalConfig)  # CLIP weights + BPE

    def settings(self, name: str) -> Optional[OptionConfig]:
        """eval.<name>, the settings of evaluator `name`, or None if it has none."""
        return getattr(self, name) if EVALUATORS.get(name).settings is not None else None

    def validate(self, run: Any) -> None:
        """Checks beyond RANGES (run.eval.check_all runs both), with each chosen evaluator's settings."""
        for name in self.metrics:
            settings = self.settings(name)
            if settings is not None:
                settings.check_all(run, f"eval.{name}")
        for name in self.grids:
            PROMPT_LISTS.get(name)
        check(bool(self.guidance_scales), "eval.guidance_scales is empty; give at least one scale, e.g. [1]")
        for name in ("guidance_scales", "grid_scales"):
            bad = [s for s in getattr(self, name) if not s >= 0]
            check(not bad, f"eval.{name} has {bad}; scales must be >= 0 (1 = unguided)")
        check_sampling(self.temperature, self.top_k, self.top_p, "eval")
        if self.rerank > 1:
            SCORERS.get(self.rerank_scorer)
            check(
                bool(self.rerank_scales), "eval.rerank_scales is empty; give the guidance scales to rerank at, e.g. [1]"
            )
            bad = [s for s in self.rerank_scales if not s >= 0]
            check(not bad, f"eval.rerank_scales has {bad}; scales must be >= 0 (1 = unguided)")
            if self.rerank_scorer == "contrastive":
                check(
                    run.data.name == "shapes",
                    f"eval.rerank_scorer=contrastive is trained on the shapes data's scenes; "
                    f"with data={run.data.name} use eval.rerank_scorer=clip",
                )
                self.scorer.check_all(run, "eval.scorer")
            else:
                check(
                    bool(self.clip.weights),
                    "eval.rerank_scorer=clip but eval.clip.weights is not set: give CLIP weights "
                    "(.npz from dalle-ablate convert-clip)",
                )
                self.clip.check_all(run, "eval.clip")


ConfigStore.instance().store(group="schema", name="eval", node=EvalConfig)
