"""Weights & Biases backend. Offline by default (never touches the network); online when
`tracker.wandb.mode=online` and logged in. Conventions (docs/architecture.md): group = the sweep or multirun
folder, job_type = the model layout, name = the overrides; finish() on every exit path."""

from __future__ import annotations

import os

import numpy as np
import wandb

from dalle_ablate.track.base import Tracker
from dalle_ablate.track.runstore import RunStore


class WandbTracker(Tracker):
    def __init__(self, cfg, store: RunStore, config: dict, meta: dict, *, name, group, job_type):
        run_id = store.meta.get("wandb_id")  # set by an earlier run in this store: resume it
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            name=name,
            group=group,
            job_type=job_type,
            tags=list(cfg.tags),
            config={**config, "meta": meta},
            dir=None if os.environ.get("WANDB_DIR") else str(store.root),
            id=run_id,
            resume="allow" if run_id else None,
            reinit="finish_previous",  # a multirun's jobs never share a run
        )
        store.meta["wandb_id"] = self.run.id
        store.meta["wandb_dir"] = self.run.dir
        store.write_meta()
        self._done = False

    def log(self, metrics, step):
        self.run.log(dict(metrics), step=int(step))

    def log_image(self, key, image, step, caption=""):
        self.run.log({key: wandb.Image(np.asarray(image, np.uint8), caption=caption)}, step=int(step))

    def log_table(self, key, columns, rows, step, line=None):
        cell = lambda v: wandb.Image(np.asarray(v, np.uint8)) if isinstance(v, np.ndarray) and v.ndim == 3 else v  # noqa: E731
        table = wandb.Table(columns=list(columns), data=[[cell(v) for v in r] for r in rows])
        logged = {key: table}
        if line is not None:
            logged[f"{key}_chart"] = wandb.plot.line(table, line[0], line[1], title=f"{key}: {line[1]} vs {line[0]}")
        self.run.log(logged, step=int(step))

    def log_summary(self, values):
        for k, v in values.items():
            self.run.summary[k] = v

    def finish(self, status="finished"):
        if not self._done:
            self._done = True
            self.run.summary["status"] = status
            # A trial the sweep's pruner stopped ended as asked: not a crashed run.
            self.run.finish(exit_code=0 if status in ("finished", "pruned") else 1)
