"""Tracking: a small Tracker interface (as levanter's) with a local run store, W&B and no-op
backends. The run store is always written; `tracker=` adds a backend (each one module with its
config dataclass and builder, registered by `TRACKERS.option`). Nothing outside this package
imports wandb."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from dalle_ablate.registry import first_line
from dalle_ablate.track import wandb_tracker  # noqa: F401 - registers the option
from dalle_ablate.track.base import TRACKERS, CompositeTracker, NullTracker, Tracker, TrackerConfig
from dalle_ablate.track.runstore import RunStore


def build_tracker(
    tracker_cfg,
    run_dir: Path,
    config: dict,
    meta: dict,
    *,
    name: Optional[str],
    group: Optional[str],
    job_type: str,
    resume_step: Optional[int] = None,
    is_main_process: bool = True,
) -> Tracker:
    """The run store under run_dir, plus the backend tracker.backend names. Only process 0 logs."""
    if not is_main_process:
        return NullTracker()
    store = RunStore(run_dir, config, meta, resume_step=resume_step)
    try:
        backends = TRACKERS.get(tracker_cfg.backend)(
            tracker_cfg, store, config, meta, name=name, group=group, job_type=job_type
        )
    except BaseException as e:  # the run store still says how the run ended
        store.log_summary({"reason": first_line(e)})
        store.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        raise
    return CompositeTracker([store, *backends])


__all__ = ["TRACKERS", "CompositeTracker", "NullTracker", "RunStore", "Tracker", "TrackerConfig", "build_tracker"]
