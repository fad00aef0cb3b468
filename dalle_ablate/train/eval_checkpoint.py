"""`dalle-ablate eval <run dir or checkpoint> [overrides]`: the evaluation of a saved checkpoint,
with the run's own config (recomposed from the overrides it recorded) plus new `eval.*`
overrides. Results go to `<run store>/evals/<eval.name>_step<step>/` (a run store of their own:
the training run's files are never rewritten) and, with W&B, to an `eval` job in the run's group."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

import jax

from dalle_ablate.validate import compose
from dalle_ablate.evaluate.runner import evaluation_or_none
from dalle_ablate.registry import ConfigError, first_line
from dalle_ablate.track import build_tracker
from dalle_ablate.train import checkpoint
from dalle_ablate.train.assembly import assemble
from dalle_ablate.validate import to_run_config


def restore(ckpt_dir: Path, step: Optional[int], target):
    """checkpoint.restore, with a checkpoint that cannot be read (a file of it truncated or corrupt)
    named in one line: its step's folder and the innermost error orbax or TensorStore gave."""
    # orbax logs its read-only manager's settings through absl, each a warning on stderr.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    if step is None:  # the latest, as orbax finds it: a finished save is a folder named by its step
        steps = [int(c.name) for c in ckpt_dir.iterdir() if c.is_dir() and c.name.isdigit()]
        step = max(steps) if steps else None
    try:
        return checkpoint.restore(ckpt_dir, step, target)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it is the checkpoint's
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ConfigError(f"{ckpt_dir / str(step)}: the checkpoint of step {step} cannot be restored (truncated or "
                          f"corrupt?): {first_line(cause)}") from e


def evaluate_checkpoint(path: str, overrides: list[str]) -> Path:
    ckpt_dir, step = checkpoint.find_checkpoints(path)
    store = ckpt_dir.parent
    meta_file = store / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"{path}: no meta.json next to {ckpt_dir.name}/; give a run made by this tool")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{meta_file}: not valid JSON, half-written or corrupt ({first_line(e)})") from None
    # The run's config, as it was composed, evaluated on this machine's devices in float32, with
    # the vocabulary rows padded as they were saved.
    cfg = to_run_config(compose([*meta.get("overrides", []), "mesh.data=-1", "mesh.fsdp=1", "mesh.model=1", *overrides]))
    run = assemble(cfg, model_axis=int(meta.get("mesh", {}).get("model", 1)), dtype="float32")
    step, state = restore(ckpt_dir, step, run.abstract_state())
    out = store / "evals" / f"{cfg.eval.name}_step{step}"
    run_name = store.parent.name
    # A W&B run of its own in the training run's group: never the training run's id (logging
    # under it would rename that run and overwrite its summary on a sync).
    own = {k: v for k, v in meta.items() if k not in ("wandb_id", "wandb_dir", "wandb_fallback")}
    own["trained_wandb_id"] = meta.get("wandb_id")
    tracker = build_tracker(cfg.tracker, out, dataclasses.asdict(cfg), {**own, "evaluated_step": step, "checkpoint": str(ckpt_dir)},
                            name=f"eval {cfg.eval.name} {run_name} step {step}", group=meta.get("wandb_group"), job_type="eval",
                            is_main_process=jax.process_index() == 0)
    status = "failed"
    try:
        ev = evaluation_or_none(cfg, run.dataset, run.model_cfg, run.graphdef, tracker, run.placement.replicated)
        if ev is None:
            raise ConfigError(f"nothing to evaluate: eval.metrics={list(cfg.eval.metrics)} need scene specs or are empty, and "
                              f"eval.grids={list(cfg.eval.grids)} need an image decoder (data.codebook_path or data.vqgan_path)")
        result = ev.run(state.params, step, run_name)
        tracker.log_summary({"evaluated_step": step, **result["model"]})
        status = "finished"
    finally:
        tracker.finish(status)
    for row in result["pareto"]:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "run"))
    for row in result["rerank"]:
        print("rerank  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "run"))
    for k, v in result["model"].items():
        print(f"{k}={v:.4g}")
    print(f"wrote {out}")
    return out
