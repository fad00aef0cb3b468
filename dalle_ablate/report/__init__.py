"""Ablation reports (`dalle-ablate report`): curves with seed spread, final metrics with
Student-t intervals and Welch differences from a baseline, stability, equal-compute views,
Pareto overlays, grids, config diff and Optuna plots, as HTML, Markdown, CSV and a W&B report."""

from dalle_ablate.report.build import build_report

__all__ = ["build_report"]
