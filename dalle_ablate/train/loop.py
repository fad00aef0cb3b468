"""One training run, top to bottom: data, model, optimizer, resume, loop, eval, checkpoints,
samples, tracking. Returns the final validation loss (the metric a sweep optimises)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dalle_ablate.config import RunConfig
from dalle_ablate.data import build_dataset
from dalle_ablate.data.base import host_share
from dalle_ablate.evaluate.runner import evaluation_or_none
from dalle_ablate.generate import image_grid, make_sampler
from dalle_ablate.model import abstract_model, build_model, param_count, resolve
from dalle_ablate.model.flops import train_flops_per_example
from dalle_ablate.optim import build_optimizer
from dalle_ablate.parallel import Placement, build_mesh, check_batch, distributed, init_state, make_placement, pad_vocab_for_mesh
from dalle_ablate.registry import first_line
from dalle_ablate.track import build_tracker
from dalle_ablate.track.runstore import read_metrics
from dalle_ablate.train import checkpoint
from dalle_ablate.train.meta import run_meta
from dalle_ablate.train.perf import device_peak_flops
from dalle_ablate.train.step import TrainState, make_eval_step, make_train_step

SCALARS = ("train/loss", "train/grad_norm", "train/param_norm", "train/lr")  # fetched every step


@dataclass
class JobInfo:
    """Where a run writes and how it is named; filled from Hydra by `run`, or by hand."""

    job_dir: Path
    name: Optional[str] = None
    group: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    config: Optional[dict] = None  # the resolved, nested config to record (default: from RunConfig)


@dataclass
class Result:
    eval_loss: float
    train_loss: float
    steps: int
    run_dir: Path
    status: str
    summary: dict = field(default_factory=dict)
    reason: str = ""  # why a run that did not finish stopped, in one line


def evaluate(eval_step, params, dataset, batch_size: int, max_batches: Optional[int], placement: Placement) -> float:
    """Weighted mean NLL over the valid split; every host reads the same eval batches and feeds
    its own rows of each."""
    total, weight = 0.0, 0.0
    rows = host_share(np.arange(batch_size), *placement.host_rows(batch_size))
    for batch in dataset.eval_batches(batch_size, max_batches):
        s, w = jax.device_get(eval_step(params, placement.global_batch({k: v[rows] for k, v in batch.items()}, batch_size)))
        total, weight = total + float(s), weight + float(w)
    return total / max(weight, 1.0)


def sample_grid(graphdef, params, dataset, model_cfg, cfg: RunConfig, key, out_sharding=None) -> Optional[tuple[np.ndarray, list[str]]]:
    captions = list(cfg.samples.captions or dataset.demo_captions())
    if not captions or not dataset.has_image_decoder():
        return None  # e.g. parquet data without data.codebook_path
    ids, mask = dataset.text.encode([c for c in captions for _ in range(cfg.samples.per_caption)])
    sampler = make_sampler(graphdef, model_cfg.image_len, temperature=cfg.samples.temperature, top_k=cfg.samples.top_k,
                           out_sharding=out_sharding)
    codes = np.asarray(sampler(params, ids, mask, key))
    return image_grid(dataset.decode_images(codes), captions, cfg.samples.per_caption), captions


def train(cfg: RunConfig, job: JobInfo) -> Result:
    t_start = time.perf_counter()
    distributed.initialize(cfg.distributed)  # before anything touches a device
    run_dir = Path(job.job_dir) / "run"
    pi = jax.process_index()
    t = cfg.trainer

    mesh = build_mesh(cfg.mesh)  # checked before any data is read or anything compiles
    check_batch(t, tuple(mesh.shape.values()))
    dataset = build_dataset(cfg.data, cfg.model)
    model_cfg = resolve(cfg.model, dataset.image_len, dataset.image_vocab, dataset.text.vocab_size)
    model_cfg = pad_vocab_for_mesh(model_cfg, mesh.shape["model"])
    abstract = abstract_model(model_cfg)
    graphdef = nnx.split(abstract, nnx.Param)[0]
    n_params = param_count(abstract)
    optimizer, schedule = build_optimizer(cfg.optim, cfg.schedule, t.steps, mesh)
    placement = make_placement(mesh, abstract, optimizer, TrainState)
    state = init_state(lambda: build_model(model_cfg, cfg.seed), optimizer, placement, TrainState)

    # Resume: `auto` continues this run store's own checkpoints; a path restores from there.
    ckpt_dir = run_dir / "checkpoints"
    start_step = 0
    source = None
    if cfg.resume == "auto":
        if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
            source = (ckpt_dir, None)
    elif cfg.resume:
        source = checkpoint.find_checkpoints(cfg.resume)
    if source is not None:
        start_step, state = checkpoint.restore(*source, target=state)

    flops_per_step = train_flops_per_example(model_cfg) * t.batch_size
    peak, peak_source = device_peak_flops()  # of one device
    peak_all = peak * mesh.size  # the step runs on every device of the mesh
    tokens_per_step = t.batch_size * (model_cfg.text_len + model_cfg.image_len)
    meta = run_meta(
        job.overrides, n_params, flops_per_step, peak, peak_source, asdict(model_cfg), dataset.info, resumed_from=start_step
    )
    meta["mesh"] = dict(mesh.shape)
    meta["wandb_group"] = job.group  # `dalle-ablate eval` files its eval jobs under the same group
    tracker = build_tracker(
        cfg.tracker,
        run_dir,
        job.config if job.config is not None else asdict(cfg),
        meta,
        name=job.name,
        group=job.group,
        job_type=cfg.model.layout,
        resume_step=start_step if source is not None else None,
        is_main_process=pi == 0,
    )
    status, reason = "failed", ""
    try:
        # Every process saves (each writes its own shards; orbax's primary process writes the metadata).
        ckpt = checkpoint.Checkpointer(ckpt_dir, t.keep_checkpoints)
        train_step = make_train_step(graphdef, optimizer, schedule, t.grad_accum, cfg.seed, placement)
        # Evaluation in float32 whatever the training compute dtype: the same parameters merged
        # into the float32 variant of the model (the dtype lives in the graph, not the weights).
        eval_graphdef = graphdef if model_cfg.dtype == "float32" else nnx.split(
            abstract_model(dataclasses.replace(model_cfg, dtype="float32")), nnx.Param)[0]
        eval_step = make_eval_step(eval_graphdef, placement)
        evaluation = evaluation_or_none(cfg, dataset, model_cfg, eval_graphdef, tracker, placement.replicated)
        batches = dataset.train_batches(t.batch_size, cfg.seed, start_step, *placement.host_rows(t.batch_size))
        bar = tqdm(total=t.steps, initial=start_step, disable=not t.progress or pi != 0, unit="step", dynamic_ncols=True)
        first_loss = last_loss = eval_loss = math.nan
        if source is not None and cfg.resume == "auto" and pi == 0:
            # Continuing this run store: the summary starts from what was logged before the
            # interruption (its first loss; its last ones if no step is left to run).
            rows = read_metrics(run_dir)
            train_losses = [float(r["train/loss"]) for r in rows if "train/loss" in r]
            eval_losses = [float(r["eval/valid/loss"]) for r in rows if "eval/valid/loss" in r]
            if train_losses:
                first_loss, last_loss = train_losses[0], train_losses[-1]
            eval_loss = eval_losses[-1] if eval_losses else math.nan
            # wall_time counts the earlier processes up to their last checkpoint (recorded at each save).
            saved = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
            t_start -= float(saved.get("wall_time", 0.0))
        last_finite = None  # (step, loss): what a diverged run reports
        pruning = None
        if cfg.optuna.trial is not None and pi == 0:  # launched by the Optuna sweeper
            from dalle_ablate.sweep.trial import pruning_for, record_run_dir

            record_run_dir(cfg.optuna, run_dir)
            if jax.process_count() == 1:
                pruning = pruning_for(cfg.optuna)
        pending = None
        clock = {"t": time.perf_counter(), "compiled": False}

        def flush() -> float:
            """Fetch and log the metrics of the step in flight (the next one is already queued, so
            the device never waits on this host sync)."""
            nonlocal pending
            step, metrics = pending
            pending = None
            per_layer = step % t.log_every == 0 or step == t.steps
            values = jax.device_get({k: v for k, v in metrics.items() if per_layer or k in SCALARS})
            now = time.perf_counter()
            dt, clock["t"] = now - clock["t"], now
            row = {k: float(v) for k, v in values.items()}
            row.update({"samples": step * t.batch_size, "tokens": step * tokens_per_step})
            if clock["compiled"]:
                row.update({
                    "perf/step_time": dt,
                    "perf/tokens_per_s": tokens_per_step / dt,
                    "perf/mfu": flops_per_step / (dt * peak_all),
                })
                bar.set_postfix(loss=f"{row['train/loss']:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
            else:
                row["perf/compile_time"] = dt  # the first step includes compilation
                clock["compiled"] = True
            tracker.log(row, step)
            bar.update(1)
            return row["train/loss"]

        def record() -> bool:
            """Log the step in flight; False once the loss is no longer finite."""
            nonlocal first_loss, last_loss, last_finite, reason
            step = pending[0]
            last_loss = flush()
            first_loss = last_loss if math.isnan(first_loss) else first_loss
            if math.isfinite(last_loss):
                last_finite = (step, last_loss)
                return True
            reason = f"diverged at step {step}: train/loss={last_loss}; " + (
                f"last finite loss {last_finite[1]:.4f} at step {last_finite[0]}" if last_finite else "no finite loss before it")
            return False

        for step in range(start_step + 1, t.steps + 1):
            ckpt.check()  # a checkpoint that failed in the background stops the run here
            state, metrics = train_step(state, placement.global_batch(next(batches), t.batch_size))
            if pending is not None and not record():
                status = "diverged"  # NaN guard: stop, and never checkpoint a broken state
                break
            pending = (step, metrics)
            evaluate_now = step % t.eval_every == 0 or step == t.steps
            save_now = step % t.save_every == 0 or step == t.steps
            sample_now = evaluation is not None and ((cfg.eval.every and step % cfg.eval.every == 0) or step == t.steps)
            if evaluate_now or save_now or sample_now:
                if not record():
                    status = "diverged"
                    break
                if evaluate_now:
                    eval_loss = evaluate(eval_step, state.params, dataset, t.batch_size, t.eval_batches, placement)
                    tracker.log({"eval/valid/loss": eval_loss, "samples": step * t.batch_size, "tokens": step * tokens_per_step}, step)
                if save_now:  # before the sampling evaluation: a failure there never costs a checkpoint
                    ckpt.save(step, state)
                    tracker.log_summary({"wall_time": time.perf_counter() - t_start, "steps": step})
                if sample_now:  # guidance-scale sweep, caption sensitivity, grids (evaluate/runner.py)
                    evaluation.run(state.params, step, job.name or run_dir.parent.name)
                clock["t"] = time.perf_counter()  # eval and save time is not step time
                if evaluate_now and pruning is not None and step < t.steps and pruning.report(eval_loss, step):
                    status = "pruned"  # the sweep's pruner stops this trial (optuna, via sweep/trial.py)
                    if not save_now:
                        ckpt.save(step, state)
                    break
        else:
            status = "finished"
        if pending is not None:
            last_loss = flush()
        bar.close()
        final_step = int(jax.device_get(state.step))
        if status == "finished":
            grid = sample_grid(graphdef, state.params, dataset, model_cfg, cfg, jax.random.fold_in(jax.random.key(cfg.seed), 1),
                               placement.replicated)
            if grid is not None:
                tracker.log_image("samples/grid", grid[0], final_step, caption=" | ".join(grid[1]))
        summary = {
            "train/loss": last_loss,
            "train/first_loss": first_loss,
            "eval/valid/loss": eval_loss,
            "data/code_unigram_entropy": dataset.info.get("code_unigram_entropy"),
            "steps": final_step,
            "wall_time": time.perf_counter() - t_start,
        }
        if reason:
            summary["reason"] = reason
        tracker.log_summary(summary)
        ckpt.close()
        tracker.finish(status)
    except KeyboardInterrupt:
        tracker.finish("interrupted")
        raise
    except BaseException as e:
        tracker.log_summary({"reason": first_line(e)})
        tracker.finish("failed")
        raise
    if status == "pruned":
        import optuna

        raise optuna.TrialPruned(f"pruned at step {final_step} of {t.steps} (eval loss {eval_loss:.4f})")
    return Result(eval_loss=eval_loss, train_loss=last_loss, steps=final_step, run_dir=run_dir, status=status, summary=summary,
                  reason=reason)

