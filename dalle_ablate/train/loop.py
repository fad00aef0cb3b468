"""One training run, top to bottom: data, model, optimizer, resume, loop, eval, checkpoints,
samples, tracking. Returns the final validation loss (the metric a sweep optimises)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dalle_ablate.config import RunConfig, data_seed
from dalle_ablate.data.base import host_share
from dalle_ablate.evaluate.runner import evaluation_or_none, headline
from dalle_ablate.generate import image_grid, make_sampler
from dalle_ablate.model import abstract_model, param_count
from dalle_ablate.model.flops import train_flops_per_example
from dalle_ablate.parallel import Placement, distributed
from dalle_ablate.track import build_tracker
from dalle_ablate.track.base import ends_on_error
from dalle_ablate.track.runstore import StoreLock, read_metrics
from dalle_ablate.train import checkpoint
from dalle_ablate.train.meta import run_meta
from dalle_ablate.train.perf import device_peak_flops
from dalle_ablate.train.assembly import assemble
from dalle_ablate.train.step import make_eval_step
from dalle_ablate.train.tokenizer import closing_lines as tokenizer_lines, tokenizer_cached, train_tokenizer

SCALARS = ("train/loss", "train/grad_norm", "train/param_norm", "train/lr")  # fetched every step


class RunHooks:
    """What a caller above the trainer hears from it, on process 0 only (job.py's Optuna trial)."""

    def started(self, run_dir: Path, processes: int) -> None:
        """The run store exists and nothing has been trained yet."""

    def should_stop(self, eval_loss: float, step: int) -> bool:
        """Asked after each evaluation before the last step: True stops the run as "pruned"."""
        return False


@dataclass
class JobInfo:
    """Where a run writes and how it is named; filled from Hydra by `run`, or by hand."""

    job_dir: Path
    name: Optional[str] = None
    group: Optional[str] = None
    job_type: Optional[str] = None  # default: the model layout
    overrides: list[str] = field(default_factory=list)
    config: Optional[dict] = None  # the resolved, nested config to record (default: from RunConfig)
    hooks: RunHooks = field(default_factory=RunHooks)


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


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C inside the block is taken when it ends (in the main thread, where Python handles
    SIGINT with its default handler; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt


class StepLogger:
    """Each step's metrics, logged one step late: the next step is already queued when this one's
    values are fetched, so the device never waits on the host. Keeps the first, last and last
    finite loss, and times steps between boundaries (eval and save time is not step time).

    A step leaves the queue only once it is logged: Ctrl-C during the blocking fetch leaves it
    (and the step after it) queued, and the interrupted run's last `flush()` logs both."""

    def __init__(self, tracker, bar, t, flops_per_step: float, tokens_per_step: int, peak_all: float):
        self.tracker, self.bar, self.t = tracker, bar, t
        self.flops_per_step, self.tokens_per_step, self.peak_all = flops_per_step, tokens_per_step, peak_all
        self.queue: list[tuple[int, dict]] = []  # steps trained and not yet logged, oldest first
        self.newest = 0  # the last step queued
        self.clock, self.compiled = time.perf_counter(), False
        self.first_loss = self.last_loss = math.nan
        self.last_finite: Optional[tuple[int, float]] = None  # (step, loss): what a diverged run reports
        self.reason = ""

    def push(self, step: int, metrics: dict) -> bool:
        """Queue this step and log the one before it; False (holding nothing) once a loss is not
        finite: the run stops there, and the step after it is never logged."""
        if step > self.newest:
            self.queue.append((step, metrics))
            self.newest = step
        return self._drain(keep=1)

    def flush(self) -> bool:
        """Fetch and log every queued step; False if a loss is not finite."""
        return self._drain(keep=0)

    def fetch(self, step: int, metrics: dict) -> dict:
        """The step's values on the host (blocks until the device has computed them)."""
        per_layer = step % self.t.log_every == 0 or step == self.t.steps
        return jax.device_get({k: v for k, v in metrics.items() if per_layer or k in SCALARS})

    def _drain(self, keep: int) -> bool:
        while len(self.queue) > keep:
            step, metrics = self.queue[0]
            values = self.fetch(step, metrics)  # Ctrl-C here: the step stays queued
            with interrupts_deferred():  # logged and dequeued together: never lost, never twice
                self.queue.pop(0)
                ok = self._log(step, values)
            if not ok:
                self.queue.clear()
                return False
        return True

    def _log(self, step: int, values: dict) -> bool:
        t = self.t
        now = time.perf_counter()
        dt, self.clock = now - self.clock, now
        row = {k: float(v) for k, v in values.items()}
        row.update({"samples": step * t.batch_size, "tokens": step * self.tokens_per_step})
        if self.compiled:
            row.update({"perf/step_time": dt, "perf/tokens_per_s": self.tokens_per_step / dt,
                        "perf/mfu": self.flops_per_step / (dt * self.peak_all)})
            self.bar.set_postfix(loss=f"{row['train/loss']:.3f}", tok_s=f"{self.tokens_per_step / dt:,.0f}", refresh=False)
        else:
            row["perf/compile_time"] = dt  # the first step includes compilation
            self.compiled = True
        self.tracker.log(row, step)
        self.bar.update(1)
        self.last_loss = row["train/loss"]
        self.first_loss = self.last_loss if math.isnan(self.first_loss) else self.first_loss
        if math.isfinite(self.last_loss):
            self.last_finite = (step, self.last_loss)
            return True
        self.reason = f"diverged at step {step}: train/loss={self.last_loss}; " + (
            f"last finite loss {self.last_finite[1]:.4f} at step {self.last_finite[0]}" if self.last_finite
            else "no finite loss before it")
        return False

    def restart_clock(self) -> None:
        self.clock = time.perf_counter()


class Boundaries:
    """What happens between steps: the validation loss every `eval_every`, a checkpoint every
    `save_every`, the sampling evaluation every `eval.every` (each also at the last step), and
    the caller's `should_stop` after each validation loss."""

    def __init__(self, cfg: RunConfig, run, tracker, ckpt, job: JobInfo, t_start: float):
        self.cfg, self.run, self.tracker, self.ckpt, self.job, self.t_start = cfg, run, tracker, ckpt, job, t_start
        model_cfg = run.model_cfg
        # Evaluation in float32 whatever the training compute dtype: the same parameters merged
        # into the float32 variant of the model (the dtype lives in the graph, not the weights).
        eval_graphdef = run.graphdef if model_cfg.dtype == "float32" else nnx.split(
            abstract_model(dataclasses.replace(model_cfg, dtype="float32")), nnx.Param)[0]
        self.eval_step = make_eval_step(eval_graphdef, run.placement)
        self.evaluation = evaluation_or_none(cfg, run.dataset, model_cfg, eval_graphdef, tracker, run.placement.replicated)
        self.eval_loss = math.nan
        self.last_eval: dict = {}  # the last sampling evaluation's result, for the closing lines

    def due(self, step: int) -> tuple[bool, bool, bool]:
        t, last = self.cfg.trainer, step == self.cfg.trainer.steps
        every = self.cfg.eval.every
        return (step % t.eval_every == 0 or last, step % t.save_every == 0 or last,
                self.evaluation is not None and (bool(every and step % every == 0) or last))

    def run_at(self, step: int, state, due: tuple[bool, bool, bool]) -> bool:
        """Evaluate, save and sample as `due(step)` says; True when the run is to stop here."""
        t = self.cfg.trainer
        evaluate_now, save_now, sample_now = due
        if evaluate_now:
            self.eval_loss = evaluate(self.eval_step, state.params, self.run.dataset, t.batch_size, t.eval_batches,
                                      self.run.placement)
            self.tracker.log({"eval/valid/loss": self.eval_loss, "samples": step * t.batch_size,
                              "tokens": step * self.run.tokens_per_step}, step)
        if save_now:  # before the sampling evaluation: a failure there never costs a checkpoint
            self.ckpt.save(step, state)
            self.tracker.log_summary({"wall_time": time.perf_counter() - self.t_start, "steps": step})
        if sample_now:  # guidance-scale sweep, caption sensitivity, grids (evaluate/runner.py)
            self.last_eval = self.evaluation.run(state.params, step, self.job.name or Path(self.job.job_dir).name)
            self.tracker.log_summary({"evaluated_step": step})  # complete: a resume at this step need not redo it
        stop = (evaluate_now and jax.process_index() == 0 and step < t.steps
                and self.job.hooks.should_stop(self.eval_loss, step))
        if stop and not save_now:
            self.ckpt.save(step, state)  # a stopped run can be resumed
        return stop


    def left_at(self, step: int, run_dir: Path) -> tuple[bool, bool, bool]:
        """What was due at `step` (the checkpoint this run store continues from) and not done by
        the process that saved it, e.g. the final evaluation a Ctrl-C cut off: (validation loss,
        save: never, sampling evaluation)."""
        evaluate_now, _, sample_now = self.due(step)
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        logged = any(r["step"] == step and "eval/valid/loss" in r for r in rows)
        saved = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        return evaluate_now and not logged, False, sample_now and saved.get("evaluated_step") != step


def run_steps(state, steps: range, train_step, batches, run, log: StepLogger, bounds: Boundaries, ckpt,
              left: tuple[bool, bool, bool] = (False, False, False)):
    """The steps, with what is due between them: (status, the state after the last whole step).
    First what was `left` at the step before them (a resumed run's evaluations). Stops early when
    the loss is not finite (diverged), when the caller's hooks say so (pruned) or on Ctrl-C
    (interrupted; in a run of one process only: others would not stop with it)."""
    batch_size = bounds.cfg.trainer.batch_size
    metrics = None
    try:
        if any(left):
            bounds.run_at(steps.start - 1, state, left)
            log.restart_clock()
        for step in steps:
            ckpt.check()  # a checkpoint that failed in the background stops the run here
            # The step donates `state`: a Ctrl-C between its return and the assignment would
            # leave `state` naming deleted buffers, so the two happen together.
            with interrupts_deferred():
                state, metrics = train_step(state, run.placement.global_batch(next(batches), batch_size))
            if not log.push(step, metrics):
                return "diverged", state  # NaN guard: stop, and never checkpoint a broken state
            due = bounds.due(step)
            if any(due):
                if not log.flush():
                    return "diverged", state
                stop = bounds.run_at(step, state, due)
                log.restart_clock()
                if stop:  # e.g. the sweep's pruner stopped this trial (job.py)
                    log.reason = f"pruned at step {step} of {steps.stop - 1} (eval loss {bounds.eval_loss:.4f})"
                    return "pruned", state
        return "finished", state
    except KeyboardInterrupt:
        if jax.process_count() > 1:
            raise
        # The last state assigned: a whole step, wherever the interrupt came. If it came between
        # the step and its push, its metrics (assigned with it) are queued here.
        done = int(jax.device_get(state.step))
        if metrics is not None and done > log.newest:
            log.queue.append((done, metrics))
            log.newest = done
        return "interrupted", state


def closing_lines(status: str, summary: dict, steps: int, last_eval: dict, run_dir: Path) -> str:
    """What a run prints last (after W&B's own block): its losses, the headline metrics of its last
    evaluation by guidance scale, and where its run store is."""
    s = summary
    lines = [f"{status} at step {s['steps']} of {steps} in {s['wall_time']:.0f} s: train/loss {s['train/loss']:.4g} "
             f"(first {s['train/first_loss']:.4g}), eval/valid/loss {s['eval/valid/loss']:.4g}"]
    lines += [f"  {line}" for line in headline(last_eval)]
    lines.append(f"  run store {run_dir}")
    return "\n".join(lines)


def resume_source(cfg: RunConfig, ckpt_dir: Path):
    """(checkpoint folder, step or None for the latest) to start from, or None for a fresh start:
    `resume=auto` continues this run store's own checkpoints, a path restores from there."""
    if cfg.resume == "auto":
        return (ckpt_dir, None) if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()) else None
    return checkpoint.find_checkpoints(cfg.resume) if cfg.resume else None


def continues_store(cfg: RunConfig, run_dir: Path) -> bool:
    """With `resume=auto`, whether this run store was started by an earlier process that was
    stopped before its first checkpoint was complete (e.g. killed during it): the run starts
    again from step 0, in the same store and the same W&B run."""
    return cfg.resume == "auto" and (run_dir / "meta.json").exists()


def finished_before(cfg: RunConfig, run_dir: Path) -> Optional[dict]:
    """With `resume=auto`, the summary of this run store if it already finished all of
    `trainer.steps`: a rerun of a study or multirun then leaves it as it is (nothing retrained,
    re-evaluated or re-logged). None otherwise, including for a run stopped earlier."""
    path = run_dir / "summary.json"
    if cfg.resume != "auto" or not path.exists():
        return None
    saved = json.loads(path.read_text())
    done = saved.get("status") == "finished" and int(saved.get("steps", -1)) >= cfg.trainer.steps
    return saved if done else None


def continued_summary(run_dir: Path, log: StepLogger, bounds: Boundaries) -> float:
    """Continuing this run store: the summary starts from what was logged before the
    interruption (its first loss; its last ones if no step is left to run). Returns the wall
    time of the earlier processes up to their last checkpoint (recorded at each save)."""
    rows = read_metrics(run_dir)
    train_losses = [float(r["train/loss"]) for r in rows if "train/loss" in r]
    eval_losses = [float(r["eval/valid/loss"]) for r in rows if "eval/valid/loss" in r]
    if train_losses:
        log.first_loss, log.last_loss = train_losses[0], train_losses[-1]
    bounds.eval_loss = eval_losses[-1] if eval_losses else math.nan
    saved = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return float(saved.get("wall_time", 0.0))


def train(cfg: RunConfig, job: JobInfo) -> Result:
    t_start = time.perf_counter()
    distributed.initialize(cfg.distributed)  # before anything touches a device
    run_dir, t, pi = Path(job.job_dir) / "run", cfg.trainer, jax.process_index()
    done = finished_before(cfg, run_dir)
    if done is not None:
        if pi == 0:
            print(f"{run_dir}: finished before at step {done['steps']} of {t.steps}; left as it is (resume=auto)", flush=True)
        return Result(eval_loss=float(done.get("eval/valid/loss", math.nan)), train_loss=float(done.get("train/loss", math.nan)),
                      steps=int(done["steps"]), run_dir=run_dir, status="finished", summary=done)
    # One writer per run store: a second process on it is refused in one line naming the holder.
    with StoreLock(run_dir) if pi == 0 else contextlib.nullcontext():
        return _train(cfg, job, run_dir, t_start)


def _train(cfg: RunConfig, job: JobInfo, run_dir: Path, t_start: float) -> Result:
    t, pi = cfg.trainer, jax.process_index()
    if cfg.data.name == "shapes" and pi == 0 and not tokenizer_cached(cfg.data):
        # stage 1 (e.g. data.tokenizer=dvae) first, with a run store and tracker run of its own
        res = train_tokenizer(cfg, Path(job.job_dir) / "tokenizer", name=f"{job.name} tokenizer" if job.name else None,
                              group=job.group, overrides=job.overrides)
        print(tokenizer_lines(cfg, res), flush=True)
    run = assemble(cfg)  # the mesh and batch are checked before any data is read or anything compiles
    state = run.init_state()
    source = resume_source(cfg, run_dir / "checkpoints")
    start_step = 0
    if source is not None:
        # resume=auto continues this store: a newest checkpoint it cannot restore is set aside
        start_step, state = checkpoint.restore(*source, target=state,
                                               on_broken=checkpoint.set_aside if cfg.resume == "auto" and pi == 0 else None)
    flops_per_step = train_flops_per_example(run.model_cfg) * t.batch_size
    peak, peak_source = device_peak_flops(cache_dir=cfg.data.cache_dir)  # of one device; the step runs on every device
    meta = run_meta(job.overrides, param_count(run.abstract), flops_per_step, peak, peak_source, asdict(run.model_cfg),
                    run.dataset.info, resumed_from=start_step)
    meta["mesh"] = dict(run.mesh.shape)
    meta["wandb_group"] = job.group  # `dalle-ablate eval` files its eval jobs under the same group
    tracker = build_tracker(cfg.tracker, run_dir, job.config if job.config is not None else asdict(cfg), meta, name=job.name,
                            group=job.group, job_type=job.job_type or cfg.model.layout,
                            resume_step=start_step if source is not None or continues_store(cfg, run_dir) else None,
                            is_main_process=pi == 0)
    with ends_on_error(tracker):
        # Every process saves (each writes its own shards; orbax's primary process writes the metadata).
        ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", t.keep_checkpoints, on_saved=tracker.log_checkpoint)
        train_step = run.train_step()
        bounds = Boundaries(cfg, run, tracker, ckpt, job, t_start)
        batches = run.dataset.train_batches(t.batch_size, data_seed(cfg), start_step, *run.placement.host_rows(t.batch_size))
        bar = tqdm(total=t.steps, initial=start_step, disable=not t.progress or pi != 0, unit="step", dynamic_ncols=True)
        log = StepLogger(tracker, bar, t, flops_per_step, run.tokens_per_step, peak * run.mesh.size)
        left = (False, False, False)
        if source is not None and cfg.resume == "auto":
            if pi == 0:
                left = bounds.left_at(start_step, run_dir)
                bounds.t_start = t_start = t_start - continued_summary(run_dir, log, bounds)
            if jax.process_count() > 1:  # process 0's reading of its run store: the evaluations run on every process
                from jax.experimental import multihost_utils

                left = tuple(bool(x) for x in multihost_utils.broadcast_one_to_all(np.array(left, np.int32)))
        if pi == 0:
            job.hooks.started(run_dir, jax.process_count())
        status, state = run_steps(state, range(start_step + 1, t.steps + 1), train_step, batches, run, log, bounds, ckpt, left)
        flushed = log.flush()  # the step in flight
        if status == "interrupted" and not flushed:
            status = "diverged"
        bar.close()
        final_step = int(jax.device_get(state.step))
        if status == "interrupted":
            log.reason = f"interrupted at step {final_step} of {t.steps}"
            if final_step > start_step:
                ckpt.save(final_step, state)  # resume=auto continues from here (none if this step is saved)
        if status == "finished":
            grid = sample_grid(run.graphdef, state.params, run.dataset, run.model_cfg, cfg,
                               jax.random.fold_in(jax.random.key(cfg.seed), 1), run.placement.replicated)
            if grid is not None:
                tracker.log_image("samples/grid", grid[0], final_step, caption=" | ".join(grid[1]))
        summary = {"train/loss": log.last_loss, "train/first_loss": log.first_loss, "eval/valid/loss": bounds.eval_loss,
                   "data/code_unigram_entropy": run.dataset.info.get("code_unigram_entropy"), "steps": final_step,
                   "wall_time": time.perf_counter() - t_start}
        if log.reason:
            summary["reason"] = log.reason
        tracker.log_summary(summary)
        ckpt.close()
        tracker.finish(status)
        if pi == 0:
            print(closing_lines(status, summary, t.steps, bounds.last_eval, run_dir), flush=True)
    return Result(eval_loss=bounds.eval_loss, train_loss=log.last_loss, steps=final_step, run_dir=run_dir, status=status,
                  summary=summary, reason=log.reason)
