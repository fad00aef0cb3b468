"""The Tracker interface and its combinators; what every tracker option's config has, and the
`none` option (the run store alone)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from omegaconf import MISSING

from dalle_ablate import interrupts
from dalle_ablate.registry import OptionConfig, Registry, RunFailed, first_line

# name -> builder(tracker cfg, run store, config, meta, *, name, group, job_type) -> trackers
# beside the run store, which is always written
TRACKERS: Registry = Registry("tracker", "tracker", key="backend")


@dataclass
class TrackerConfig(OptionConfig):
    backend: str = MISSING  # where metrics go besides the run store, chosen with tracker=NAME


@dataclass
class NoTrackerConfig(TrackerConfig):
    backend: str = "none"


@TRACKERS.option("none", NoTrackerConfig)
def no_tracker(cfg: NoTrackerConfig, store, config: dict, meta: dict, **naming) -> list:
    return []


@contextlib.contextmanager
def ends_on_error(tracker: "Tracker"):
    """Around a tracked run's work: Ctrl-C finishes the run `interrupted` (its `reason` what it
    stopped, e.g. "terminated (SIGTERM) while fitting the image tokenizer"), any other exception
    `failed` (`diverged` for a RunFailed that says so) with its first line as the summary's
    `reason`; either is re-raised."""
    try:
        yield tracker
    except KeyboardInterrupt as e:
        with contextlib.suppress(Exception):  # best effort, as below: what it stopped, e.g. the tokenizer's fit
            tracker.log_summary({"reason": f"{interrupts.word()} {interrupts.stage_of(e, 'while it ran')}"})
        tracker.finish("interrupted")
        raise
    except BaseException as e:
        # a failure in a SIGTERM's stop (its bucket gone): the reason names the signal too -- not a
        # divergence, an end of its own whatever came after
        diverged = isinstance(e, RunFailed) and e.exit_code == RunFailed.DIVERGED
        terminated = interrupts.word() == interrupts.TERMINATED and not diverged
        why = f"{interrupts.TERMINATED}: {first_line(e)}" if terminated else first_line(e)
        try:  # best effort: a run store that cannot be written fails here too, and `e` says why
            tracker.log_summary({"reason": why})
        except Exception:  # noqa: BLE001
            pass
        try:
            tracker.finish("diverged" if isinstance(e, RunFailed) and e.exit_code == RunFailed.DIVERGED else "failed")
        except Exception:  # noqa: BLE001
            pass
        raise


class Tracker(ABC):
    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Scalars at an optimizer step (metric names as in docs/architecture.md)."""

    @abstractmethod
    def log_image(self, key: str, image: np.ndarray, step: int, caption: str = "") -> None:
        """An [H, W, 3] uint8 image."""

    @abstractmethod
    def log_table(
        self, key: str, columns: list[str], rows: list[list], step: int, line: Optional[tuple[str, str]] = None
    ) -> None:
        """A table at a step; cells are scalars, strings or [H, W, 3] uint8 images. `line`:
        (x, y) columns to also draw as a line chart, rows joined in order."""

    @abstractmethod
    def log_summary(self, values: dict[str, Any]) -> None:
        """Final values of the run (merged into earlier ones)."""

    @abstractmethod
    def finish(self, status: str = "finished") -> None:
        """Flush and close; status is finished, diverged, pruned, failed or interrupted. Safe to call twice."""

    def log_checkpoint(self, step: int, path: Path) -> None:
        """A checkpoint folder, complete on disk (W&B keeps it as an artifact when asked to)."""

    def log_meta(self, values: dict[str, Any]) -> None:
        """What the run records about itself that is known only later (merged into meta.json)."""


class NullTracker(Tracker):
    """Logs nothing (processes other than 0, and tests)."""

    def log(self, metrics, step):
        return None

    def log_image(self, key, image, step, caption=""):
        return None

    def log_table(self, key, columns, rows, step, line=None):
        return None

    def log_summary(self, values):
        return None

    def finish(self, status="finished"):
        return None


class CompositeTracker(Tracker):
    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, metrics, step):
        for t in self.trackers:
            t.log(metrics, step)

    def log_image(self, key, image, step, caption=""):
        for t in self.trackers:
            t.log_image(key, image, step, caption)

    def log_table(self, key, columns, rows, step, line=None):
        for t in self.trackers:
            t.log_table(key, columns, rows, step, line)

    def log_summary(self, values):
        for t in self.trackers:
            t.log_summary(values)

    def log_checkpoint(self, step, path):
        for t in self.trackers:
            t.log_checkpoint(step, path)

    def log_meta(self, values):
        for t in self.trackers:
            t.log_meta(values)

    def finish(self, status="finished"):
        # Every backend is finished even if one fails: a multirun must never share a W&B run.
        errors = []
        for t in self.trackers:
            try:
                t.finish(status)
            except Exception as e:  # noqa: BLE001 - re-raised below after the others finished
                errors.append(e)
        if errors:
            raise errors[0]
