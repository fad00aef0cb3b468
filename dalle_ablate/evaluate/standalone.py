"""`dalle-ablate eval <run dir or checkpoint> [overrides]`: the evaluation of a saved checkpoint,
with the run's own config (recomposed from the overrides it recorded) plus new `eval.*`
overrides. Results go to `<run store>/evals/<eval.name>_step<step>/` (a run store of their own:
the training run's files are never rewritten) and, with W&B, to an `eval` job in the run's group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx

from dalle_ablate.registry import ConfigError


def evaluate_checkpoint(path: str, overrides: list[str]) -> Path:
    from dalle_ablate.cli import compose
    from dalle_ablate.config import to_run_config
    from dalle_ablate.data import build_dataset
    from dalle_ablate.evaluate.runner import evaluation_or_none
    from dalle_ablate.model import abstract_model, build_model, resolve
    from dalle_ablate.optim import build_optimizer
    from dalle_ablate.parallel import abstract_state, build_mesh, make_placement, pad_vocab_for_mesh
    from dalle_ablate.track import build_tracker
    from dalle_ablate.train import checkpoint
    from dalle_ablate.train.step import TrainState

    ckpt_dir, step = checkpoint.find_checkpoints(path)
    store = ckpt_dir.parent
    meta_file = store / "meta.json"
    if not meta_file.exists():
        raise ConfigError(f"{path}: no meta.json next to {ckpt_dir.name}/; give a run made by this tool")
    meta = json.loads(meta_file.read_text())
    # The run's config, as it was composed, evaluated on this machine's devices in float32.
    cfg = to_run_config(compose([*meta.get("overrides", []), "mesh.data=-1", "mesh.fsdp=1", "mesh.model=1", *overrides]))
    mesh = build_mesh(cfg.mesh)
    dataset = build_dataset(cfg.data, cfg.model)
    model_cfg = resolve(cfg.model, dataset.image_len, dataset.image_vocab, dataset.text.vocab_size)
    model_cfg = pad_vocab_for_mesh(model_cfg, int(meta.get("mesh", {}).get("model", 1)))  # rows as saved
    model_cfg = dataclasses.replace(model_cfg, dtype="float32")
    abstract = abstract_model(model_cfg)
    optimizer, _ = build_optimizer(cfg.optim, cfg.schedule, cfg.trainer.steps, mesh)
    placement = make_placement(mesh, abstract, optimizer, TrainState)
    target = abstract_state(lambda: build_model(model_cfg, cfg.seed), optimizer, placement, TrainState)
    step, state = checkpoint.restore(ckpt_dir, step, target)
    out = store / "evals" / f"{cfg.eval.name}_step{step}"
    run_name = store.parent.name
    tracker = build_tracker(cfg.tracker, out, dataclasses.asdict(cfg), {**meta, "evaluated_step": step, "checkpoint": str(ckpt_dir)},
                            name=f"eval {cfg.eval.name} {run_name} step {step}", group=meta.get("wandb_group"), job_type="eval",
                            is_main_process=jax.process_index() == 0)
    status = "failed"
    try:
        ev = evaluation_or_none(cfg, dataset, model_cfg, nnx.split(abstract, nnx.Param)[0], tracker, placement.replicated)
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
    for k, v in result["model"].items():
        print(f"{k}={v:.4g}")
    print(f"wrote {out}")
    return out
