"""Where each run of a job starts, in one place: a run store that ended before is left as it is
(`settled_before`), else a fresh start (step 0) or a checkpoint (`ResumePoint`) and, when the run
continues its own store (`resume=auto`), what its earlier processes logged and left undone. The
members of a job start at one step (`restore_common_step`)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from dalle_ablate.config import RunConfig
from dalle_ablate.registry import RunFailed
from dalle_ablate.track.runstore import read_metrics, settled
from dalle_ablate.train import checkpoint
from dalle_ablate.train.hooks import Hooks, left_at


def resume_source(cfg: RunConfig, ckpt_dir: Path):
    """(checkpoint folder, step or None for the latest) to start from, or None for a fresh start:
    `resume=auto` continues this run store's own checkpoints, a path restores from there."""
    if cfg.resume == "auto":
        return (ckpt_dir, None) if checkpoint.finished_steps(ckpt_dir) else None
    return checkpoint.find_checkpoints(cfg.resume) if cfg.resume else None


def continues_store(cfg: RunConfig, run_dir: Path) -> bool:
    """With `resume=auto`, whether this run store was started by an earlier process that was
    stopped before its first checkpoint was complete (e.g. killed during it): the run starts
    again from step 0, in the same store and the same W&B run."""
    return cfg.resume == "auto" and (run_dir / "meta.json").exists()


def settled_before(cfg: RunConfig, run_dir: Path) -> Optional[dict]:
    """With `resume=auto`, the summary of this run store if it ended for good before: it finished
    all of `trainer.steps`, or it diverged (retrained from its last checkpoint it would diverge at
    the same step again; a member's would send the others back to that checkpoint too). A rerun
    of a study or multirun then leaves it as it is (nothing retrained, re-evaluated or re-logged).
    None otherwise, including for a run stopped earlier (it continues)."""
    path = run_dir / "summary.json"
    if cfg.resume != "auto" or not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved if settled(saved, cfg.trainer.steps) else None


@dataclass
class ResumePoint:
    """What a run starts from, in one place: a fresh start (step 0), or a checkpoint and, when the
    run continues its own store (`resume=auto`), what its earlier processes logged (the hooks they
    left undone: `undone_at_resume`)."""

    step: int = 0  # the restored checkpoint's step
    state: Any = None  # the restored train state; None: the initial one
    continues_store: bool = False  # the same run store and W&B run go on (resume=auto)
    wall_time: float = 0.0  # the earlier processes' wall time up to `step` (recorded at each save)
    first_loss: float = math.nan  # the run's first train/loss, and its last and last eval loss logged
    last_loss: float = math.nan
    eval_loss: float = math.nan
    done_at_step: dict = field(default_factory=dict)  # hook name -> whether it finished at `step` (left_at)

    @property
    def tracker_step(self) -> Optional[int]:
        """The step the tracker's run continues from, or None for a new tracker run."""
        return self.step if self.state is not None or self.continues_store else None


def resume_point(cfg: RunConfig, run_dir: Path, target) -> ResumePoint:
    """Where this run starts: `resume=auto` continues this run store (a newest checkpoint it cannot
    restore is set aside), a path restores from there, else step 0 -- in the same store and W&B
    run if an earlier process was stopped before its first checkpoint was complete."""
    source = resume_source(cfg, run_dir / "checkpoints")
    if source is None:
        return ResumePoint(continues_store=continues_store(cfg, run_dir))
    on_broken = checkpoint.set_aside if cfg.resume == "auto" and jax.process_index() == 0 else None
    step, state = checkpoint.restore(*source, target=target, on_broken=on_broken)
    return ResumePoint(step, state, continues_store=cfg.resume == "auto" and jax.process_index() == 0)


def restore_common_step(members: list, target) -> None:
    """Resumed members must start at one step: where their newest checkpoints differ (a kill
    between the members' saves of one step), each newer one restarts from the newest step every
    member has; its own newer checkpoint is written again, with the same values, on the way."""
    steps = {m.point.step for m in members}
    if len(steps) == 1:
        return
    common = min(steps)
    moved = [m for m in members if m.point.step > common]
    for m in moved:
        if common == 0:
            m.point = ResumePoint(continues_store=True)
            continue
        if common not in checkpoint.finished_steps(
            m.run_dir / "checkpoints"
        ):  # kept no longer (trainer.keep_checkpoints)
            raise RunFailed(
                f"members resume from step {common}, the newest every member has, but {m.run_dir} no longer "
                f"keeps it; resume seed={m.seed} as a run of its own, or raise trainer.keep_checkpoints"
            )
        step, state = checkpoint.restore(m.run_dir / "checkpoints", common, target)
        m.point = ResumePoint(step, state, continues_store=True)
    print(
        f"members {', '.join(f'seed={m.seed}' for m in moved)} resume from step {common}, the newest step every member "
        "has a checkpoint of",
        file=sys.stderr,
        flush=True,
    )


def with_logged(point: ResumePoint, run_dir: Path) -> ResumePoint:
    """`point` with what the earlier processes of its run store logged up to it (process 0, which
    writes the store). Read after the tracker is built: it repairs a torn last line first."""
    if not (point.continues_store and point.state is not None):
        return point
    rows = read_metrics(run_dir)
    train_losses = [float(r["train/loss"]) for r in rows if "train/loss" in r]
    eval_losses = [float(r["eval/valid/loss"]) for r in rows if "eval/valid/loss" in r]
    saved = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    first, last = (train_losses[0], train_losses[-1]) if train_losses else (math.nan, math.nan)
    done = {
        "validation": any(r["step"] == point.step and "eval/valid/loss" in r for r in rows),
        # evaluated at this step, or later: a process got past this step's hooks (a resume
        # from an earlier checkpoint than the newest, e.g. the members' common step)
        "evaluation": int(saved.get("evaluated_step", -1)) >= point.step,
    }
    return dataclasses.replace(
        point,
        wall_time=float(saved.get("wall_time", 0.0)),
        first_loss=first,
        last_loss=last,
        eval_loss=eval_losses[-1] if eval_losses else math.nan,
        done_at_step=done,
    )


def undone_at_resume(members: list, hooks: Hooks) -> tuple[str, ...]:
    """The hooks due at the resumed step that a member's earlier process did not finish, in the
    order they run (process 0 read the run stores; the evaluations run on every process, so it
    tells the others). A member that finished one is skipped by it (`Member.done_at`)."""
    left = {
        name for m in members if m.point.done_at_step for name in left_at(hooks, m.point.step, m.point.done_at_step)
    }
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.broadcast_one_to_all(np.array([h.name in left for h in hooks.hooks], np.int32))
        left = {h.name for h, f in zip(hooks.hooks, flags) if f}
    return tuple(h.name for h in hooks.hooks if h.name in left)
