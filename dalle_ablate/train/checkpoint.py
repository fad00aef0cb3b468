"""Orbax checkpoints of the train state under `<run store>/checkpoints/<step>/`.

Orbax writes each step to a temporary folder and renames it when complete, so an interrupted
save never replaces or corrupts an earlier checkpoint. The data order and every random key are
functions of (seed, step), so the step is all a resume needs besides the state itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import jax
import orbax.checkpoint as ocp

from dalle_ablate.registry import ConfigError


class Checkpointer:
    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def save(self, step: int, state) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def find_checkpoints(path: str) -> tuple[Path, Optional[int]]:
    """A checkpoints folder and step from what a user may pass as `resume=`: a job dir, a run
    store, a checkpoints folder, or one step's folder inside it."""
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise ConfigError(f"resume={path}: no such file or folder (give a run dir, its run/ or run/checkpoints/)")
    for cand in (p / "run" / "checkpoints", p / "checkpoints", p):
        if cand.is_dir() and any(c.is_dir() and c.name.isdigit() for c in cand.iterdir()):
            return cand, None
    if p.name.isdigit() and p.parent.is_dir():
        return p.parent, int(p.name)
    raise ConfigError(f"resume={path}: no orbax checkpoint found there")


def restore(directory: Path, step: Optional[int], target):
    """The state saved at `step` (latest if None), shaped and sharded like `target`."""
    mngr = ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"{directory}: holds no finished checkpoint")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return step, mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    finally:
        mngr.close()
