"""Tracking: a small Tracker interface (as levanter's) with a local run store, W&B and no-op
backends. The run store is always written; nothing outside this package imports wandb."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


from dalle_ablate.registry import first_line
from dalle_ablate.track.base import CompositeTracker, NullTracker, Tracker
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
    """The run store under run_dir, plus W&B unless tracker.backend=none. Only process 0 logs."""
    if not is_main_process:
        return NullTracker()
    store = RunStore(run_dir, config, meta, resume_step=resume_step)
    trackers: list[Tracker] = [store]
    if tracker_cfg.backend == "wandb" and tracker_cfg.wandb.mode != "disabled":
        from dalle_ablate.track.wandb_tracker import WandbTracker

        try:
            trackers.append(WandbTracker(tracker_cfg.wandb, store, config, meta, name=name, group=group, job_type=job_type))
        except BaseException as e:  # the run store still says how the run ended
            store.log_summary({"reason": first_line(e)})
            store.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
            raise
    return CompositeTracker(trackers)


__all__ = ["CompositeTracker", "NullTracker", "RunStore", "Tracker", "build_tracker"]
