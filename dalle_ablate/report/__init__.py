"""Ablation reports (`dalle-ablate report`: HTML, Markdown, CSV and a W&B report spec) and a study's results page,
from run stores; docs/architecture.md says which module does what."""

from dalle_ablate.report.build import build_report

__all__ = ["build_report"]
