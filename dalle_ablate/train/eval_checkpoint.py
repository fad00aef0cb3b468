"""`dalle-ablate eval <run dir or checkpoint> [overrides]`: the evaluation of a saved checkpoint,
with the run's own config (recomposed from the overrides it recorded) plus new `eval.*`
overrides. Results go to `<run store>/evals/<eval.name>_step<step>/` (a run store of their own:
the training run's files are never rewritten) and, with W&B, to an `eval` job in the run's group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from dalle_ablate.validate import compose
from dalle_ablate.evaluate.runner import evaluation_or_none
from dalle_ablate.registry import ConfigError
from dalle_ablate.track import build_tracker
from dalle_ablate.train import checkpoint
from dalle_ablate.train.assembly import assemble
from dalle_ablate.validate import to_run_config


def evaluate_checkpoint(path: str, overrides: list[str]) -> Path:
    ckpt_dir, step = checkpoint.find_checkpoints(path)
    store = ckpt_dir.parent
    meta_file = store / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"{path}: no meta.json next to {ckpt_dir.name}/; give a run made by this tool")
    meta = json.loads(meta_file.read_text())
    # The run's config, as it was composed, evaluated on this machine's devices in float32, with
    # the vocabulary rows padded as they were saved.
    cfg = to_run_config(compose([*meta.get("overrides", []), "mesh.data=-1", "mesh.fsdp=1", "mesh.model=1", *overrides]))
    run = assemble(cfg, model_axis=int(meta.get("mesh", {}).get("model", 1)), dtype="float32")
    step, state = checkpoint.restore(ckpt_dir, step, run.abstract_state())
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
