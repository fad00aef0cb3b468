"""A metric, declared once beside the code that computes it (issue 51): its key as logged, its
unit, which way is better, whether it is a headline, its axis on the guidance-scale Pareto plot
and, for one a study can judge, the name a study file gives it and its default margin Δ. An
evaluator declares its metrics with its registration (`@evaluator(..., metrics=[...])`,
evaluate/evaluators.py); a report's own measure (a count of loss spikes, the learning-rate
sensitivity of stress runs) with the report code that computes it. The evaluation's closing lines
and Pareto plot (evaluate/runner.py), the W&B summaries (track/wandb_tracker.py), the report's
tables and figures, a study's findings and the generated configuration reference read these
declarations and nothing else.

A module's declarations are made when it is imported: the trainer imports `evaluate` before it
builds a tracker, and `report` imports it for its pages."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dalle_ablate.registry import ConfigError

SOURCES = ("run", "samples", "model", "report")
BETTER = ("higher", "lower", "")
MARGIN = re.compile(r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?%?")


@dataclass(frozen=True)
class Metric:
    key: str  # as logged by a run (`train/loss`); an evaluator's `<evaluator>/<name>`, logged as below
    what: str  # what it is, in a few words, for pages and the reference
    unit: str  # what its numbers count, printed after them ("nats per image token")
    better: str = ""  # "higher", "lower", or "" where neither is (a gradient norm)
    # who computes it: "run" (the trainer, logged under `key`), "samples" (a sampling evaluator, at
    # each guidance scale: eval/pareto/s<scale>/<key>), "model" (a model evaluator: eval/<key>),
    # "report" (a report's own measure over a run's log, never logged)
    source: str = "run"
    # its place among the headline metrics (1 first), 0 for none: what a run's closing lines, its
    # W&B summary (the best beside the last) and the report lead with
    headline: int = 0
    # on the guidance-scale Pareto plot's x axis (fidelity) against this metric on its y axis
    # (alignment); the first pair a run logs is drawn, in headline order
    pareto_against: str = ""
    study: str = ""  # the name a study file's finding gives it (`metric: eval_loss`); "" for none
    margin: str = ""  # a study's default Δ: "N%" of the baseline arm's mean, or a number in `unit`
    # how a study reads one run's value: "last" (its last logged value; a sampled metric's at the
    # study's guidance scale, findings.STUDY_SCALE, with its course over the evaluations), "median"
    # (over its steps: a time), "given" (measured elsewhere, handed to the verdicts per arm and seed)
    reads: str = "last"
    value: Optional[Callable[[Any], float]] = None  # a report's own measure: report.load.Run -> its value
    covers: str = "initialisation and data order (the seed)"  # the randomness its interval over seeds covers
    # measured once per job, not per seed: seeds trained as members of one job all log the job's
    # value (train/logger.py divides the job's step among them), so they are no replicates of it
    per_job: bool = False

    def logged(self, scale: Optional[float | str] = None) -> str:
        """The key a run logs it under: a sampled metric at guidance scale `scale` (a number, or a
        placeholder such as "<scale>")."""
        if self.source == "samples":
            return f"eval/pareto/s{scale if isinstance(scale, str) else format(scale, 'g')}/{self.key}"
        return f"eval/{self.key}" if self.source == "model" else self.key


METRICS: dict[str, Metric] = {}  # key -> its declaration, in the order declared
STUDY: dict[str, Metric] = {}  # a study's name for it -> its declaration


def declare(*metrics: Metric) -> None:
    """Register declarations; a malformed one or a key or study name declared twice is an error
    naming the field (a programming error, at import)."""
    for m in metrics:
        why = (
            f"source {m.source!r} is not one of {SOURCES}"
            if m.source not in SOURCES
            else f"better {m.better!r} is not one of {BETTER}"
            if m.better not in BETTER
            else f"margin {m.margin!r} is not a number or N%"
            if m.margin and not MARGIN.fullmatch(m.margin)
            else f"reads {m.reads!r} is not last, median or given"
            if m.reads not in ("last", "median", "given")
            else "a report's measure needs value= or reads='given'"
            if m.source == "report" and m.value is None and m.reads != "given"
            else "declared twice"
            if m.key in METRICS
            else f"study name {m.study!r} declared twice"
            if m.study and m.study in STUDY
            else ""
        )
        if why:
            raise ValueError(f"metric {m.key!r}: {why}")
        METRICS[m.key] = m
        if m.study:
            STUDY[m.study] = m


def metric(key: str) -> Metric:
    if key not in METRICS:
        raise ConfigError(f"metric {key!r} is not declared; declared: {', '.join(METRICS)}")
    return METRICS[key]


def study_metric(name: str) -> Metric:
    """The declaration a study file's `metric: <name>` names."""
    if name not in STUDY:
        raise ConfigError(f"metric {name!r} is not one a study can judge; valid: {', '.join(sorted(STUDY))}")
    return STUDY[name]


def headlines(source: Optional[str] = None) -> list[Metric]:
    """The headline metrics in their order, of one source or all."""
    return sorted((m for m in METRICS.values() if m.headline and source in (None, m.source)), key=lambda m: m.headline)


def of_logged(key: str) -> Optional[Metric]:
    """The declaration of a logged key: the key itself, an evaluator's under eval/ (a sampled one at
    any scale and best-of-N), None for an undeclared one."""
    if key in METRICS and METRICS[key].source == "run":
        return METRICS[key]
    if key.startswith("eval/") and key[5:] in METRICS and METRICS[key[5:]].source == "model":
        return METRICS[key[5:]]
    if key.startswith(("eval/pareto/", "eval/rerank/")):
        return next((m for m in METRICS.values() if m.source == "samples" and key.endswith("/" + m.key)), None)
    return None


def pareto_axes(columns) -> Optional[tuple[str, str]]:
    """(x, y) of the Pareto plot for a table with these columns: the first declared pair (headline
    order, then the order declared) both of whose metrics it has; None if none."""
    ordered = sorted(METRICS.values(), key=lambda m: m.headline or float("inf"))
    return next(
        (
            (m.key, m.pareto_against)
            for m in ordered
            if m.pareto_against and m.key in columns and m.pareto_against in columns
        ),
        None,
    )


def label(key: str) -> str:
    """`key (unit, lower is better)` for an axis; the key alone for an undeclared one."""
    m = METRICS.get(key)
    parts = [m.unit, f"{m.better} is better" if m.better else ""] if m else []
    parts = [p for p in parts if p]
    return f"{key} ({', '.join(parts)})" if parts else key


# The trainer's own metrics (train/loop.py, train/hooks.py log them). The losses are the
# cross-entropy of the image codes (natural log), averaged over the image tokens.
declare(
    Metric(
        "eval/valid/loss",
        "the loss on the valid split's examples",
        "nats per image token",
        "lower",
        headline=1,
        study="eval_loss",
        # Kaplan et al. 2020 (L ~ C^-0.050): 2 % of the loss is what ~1.5x the training compute buys
        # (1.02^20 = 1.49); a variant worth less than half again the compute is no "clearly helps".
        margin="2%",
        covers="initialisation and data order (the seed); not the evaluation set: every run scores the same scenes",
    ),
    Metric(
        "train/loss",
        "the family's objective on the training batch",
        "nats per image token",
        "lower",
        headline=2,
        study="train_loss",
        margin="2%",
    ),
    Metric(
        "perf/step_time",
        "median seconds per training step (this machine, with its load)",
        "s",
        "lower",
        study="step_time",
        reads="median",
        # a cost under 5 % of a step is within what the machine's own load moves step time by
        margin="5%",
        covers="the machine's load while each run trained (runs that trained as jobs of their own)",
        per_job=True,
    ),
    Metric("train/grad_norm", "the global L2 norm of the gradient", "global L2 norm"),
)
