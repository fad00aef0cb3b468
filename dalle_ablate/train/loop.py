"""One training run, top to bottom: the run assembled, where it starts (`ResumePoint`), the loop
with its periodic hooks (hooks.py: validation loss, checkpoints, the sampling evaluation), the
sample grid and the summary. Stage 1 (the image tokenizer) runs before, in the job (job.py).
Returns the final validation loss (the metric a sweep optimises)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
from tqdm.auto import tqdm

from dalle_ablate import interrupts
from dalle_ablate.config import RunConfig, data_seed
from dalle_ablate.evaluate.runner import headline
from dalle_ablate.fileio import shown
from dalle_ablate.generate import image_grid, make_sampler
from dalle_ablate.model import param_count
from dalle_ablate.model.flops import train_flops_per_example
from dalle_ablate.parallel import distributed
from dalle_ablate.track import build_tracker
from dalle_ablate.track.base import ends_on_error
from dalle_ablate.track.runstore import StoreLock, read_metrics
from dalle_ablate.train import checkpoint
from dalle_ablate.train.meta import run_meta
from dalle_ablate.train.perf import device_peak_flops
from dalle_ablate.train.assembly import assemble
from dalle_ablate.train.hooks import Hooks, left_at, periodic_hooks

SCALARS = ("train/loss", "train/grad_norm", "train/param_norm", "train/lr")  # fetched every step


class RunHooks:
    """What a caller above the trainer hears from it (job.py's Optuna trial), and periodic work of
    its own. `started` and `should_stop` are called on process 0 only; `add_hooks` on every
    process (a hook runs on all of them, as the run's evaluations do)."""

    def add_hooks(self, hooks: Hooks) -> None:
        """Register periodic work between steps (`hooks.add(name, fn, every)`, train/hooks.py);
        called once, after the run's own hooks are registered, so these run after them."""

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
    saved: bool = False  # an interrupted run: whether it saved a checkpoint of its last step (it trained one)


def grid_captions(dataset, cfg: RunConfig) -> Optional[tuple[list[str], Any, Any]]:
    """(captions, ids, mask) of the end-of-run sample grid, each caption `per_caption` times; None
    when the data cannot draw (e.g. parquet data without data.codebook_path)."""
    captions = list(cfg.samples.captions or dataset.demo_captions())
    if not captions or not dataset.has_image_decoder():
        return None
    ids, mask = dataset.text.encode([c for c in captions for _ in range(cfg.samples.per_caption)])
    return captions, ids, mask


def grid_sampler(graphdef, model_cfg, cfg: RunConfig, out_sharding=None):
    """sample(params, ids, mask, key) -> codes, as the sample grid draws them."""
    return make_sampler(graphdef, model_cfg.image_len, temperature=cfg.samples.temperature, top_k=cfg.samples.top_k,
                        out_sharding=out_sharding)


def sample_grid(graphdef, params, dataset, model_cfg, cfg: RunConfig, key, out_sharding=None) -> Optional[tuple[np.ndarray, list[str]]]:
    inputs = grid_captions(dataset, cfg)
    if inputs is None:
        return None
    captions, ids, mask = inputs
    codes = np.asarray(grid_sampler(graphdef, model_cfg, cfg, out_sharding)(params, ids, mask, key))
    return image_grid(dataset.decode_images(codes), captions, cfg.samples.per_caption), captions


def grid_key(seed: int):
    """The end-of-run sample grid's noise, from the run's seed."""
    return jax.random.fold_in(jax.random.key(seed), 1)


class StepLogger:
    """Each step's metrics, logged one step late: the next step is already queued when this one's
    values are fetched, so the device never waits on the host. Keeps the first, last and last
    finite loss, and times steps between boundaries (eval and save time is not step time).

    A step leaves the queue only once it is logged: Ctrl-C during the blocking fetch leaves it
    (and the step after it) queued, and the interrupted run's last `flush()` logs both -- untimed
    (`timed` False): the time since the step before is no step time once a Ctrl-C came between."""

    def __init__(self, tracker, bar, t, flops_per_step: float, tokens_per_step: int, peak_all: float, share: int = 1):
        """`share`: the runs one step of the program trains (the members of a job, train/members.py):
        each is charged its share of the step's time, so its step time and throughput read as a
        separate run's would on the same machine."""
        self.tracker, self.bar, self.t = tracker, bar, t
        self.flops_per_step, self.tokens_per_step, self.peak_all = flops_per_step, tokens_per_step, peak_all
        self.share = share
        self.queue: list[tuple[int, dict]] = []  # steps trained and not yet logged, oldest first
        self.newest = 0  # the last step queued
        self.clock, self.compiled = time.perf_counter(), False
        self.first_loss = self.last_loss = math.nan
        self.last_finite: Optional[tuple[int, float]] = None  # (step, loss): what a diverged run reports
        self.diverged_at: Optional[int] = None  # the step whose loss was not finite: where a diverged run ends
        self.timed = True  # False: steps are logged without perf/ timing (those flushed after a Ctrl-C)
        self.stopped = ""  # what a Ctrl-C stopped between the steps, as its check named it (e.g. an evaluation)
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
            with interrupts.deferred():  # logged and dequeued together: never lost, never twice
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
        if self.compiled and self.timed:
            if self.share > 1:
                row["perf/job_step_time"] = dt  # the whole program's step, all its members
                dt /= self.share
            row.update({"perf/step_time": dt, "perf/tokens_per_s": self.tokens_per_step / dt,
                        "perf/mfu": self.flops_per_step / (dt * self.peak_all)})
            self.bar.set_postfix(loss=f"{row['train/loss']:.3f}", tok_s=f"{self.tokens_per_step / dt:,.0f}", refresh=False)
        elif not self.compiled and self.timed:
            row["perf/compile_time"] = dt  # the first step includes compilation
            self.compiled = True
        self.tracker.log(row, step)
        self.bar.update(1)
        self.last_loss = row["train/loss"]
        self.first_loss = self.last_loss if math.isnan(self.first_loss) else self.first_loss
        if math.isfinite(self.last_loss):
            self.last_finite = (step, self.last_loss)
            return True
        self.diverged_at = step
        self.reason = f"diverged at step {step}: train/loss={self.last_loss}; " + (
            f"last finite loss {self.last_finite[1]:.4f} at step {self.last_finite[0]}" if self.last_finite
            else "no finite loss before it")
        return False

    def restart_clock(self) -> None:
        self.clock = time.perf_counter()


def run_steps(state, steps: range, train_step, batches, placement, batch_size: int, log: StepLogger, hooks: Hooks, ckpt,
              left: tuple[str, ...] = ()):
    """The steps, with the hooks due after each: (status, the state after the last whole step).
    First the hooks `left` undone at the step before them (a resumed run's evaluations). Stops
    early when the loss is not finite (diverged), when a hook says so (pruned) or on Ctrl-C
    (interrupted; in a run of one process only: others would not stop with it)."""
    metrics = None
    try:
        if left:
            hooks.run(steps.start - 1, state, left)
            log.restart_clock()
        for step in steps:
            ckpt.check()  # a checkpoint that failed in the background stops the run here
            interrupts.check()  # Ctrl-C (interrupts.py): taken here, between whole steps
            # The step donates `state`: a Ctrl-C between its return and the assignment would
            # leave `state` naming deleted buffers, so the two happen together.
            with interrupts.deferred():
                state, metrics = train_step(state, placement.global_batch(next(batches), batch_size))
            if not log.push(step, metrics):
                return "diverged", state  # NaN guard: stop, and never checkpoint a broken state
            due = hooks.due(step)
            if due:
                if not log.flush():  # every step before a hook's work is logged first
                    return "diverged", state
                stop = hooks.run(step, state, due)
                log.restart_clock()  # hook time is not step time
                if stop:  # e.g. the sweep's pruner stopped this trial (job.py)
                    log.reason = f"pruned at step {step} of {steps.stop - 1} ({stop})"
                    return "pruned", state
        return "finished", state
    except KeyboardInterrupt as e:
        if jax.process_count() > 1:
            raise
        # The last state assigned: a whole step, wherever the interrupt came. If it came between
        # the step and its push, its metrics (assigned with it) are queued here.
        done = int(jax.device_get(state.step))
        if metrics is not None and done > log.newest:
            log.queue.append((done, metrics))
            log.newest = done
        log.timed, log.stopped = False, interrupts.stage_of(e, "")
        return "interrupted", state


def interrupted_at(log: StepLogger, step: int, steps: int) -> str:
    """The reason of a run a Ctrl-C stopped: its step, and what it stopped if not a step."""
    return f"interrupted at step {step} of {steps}" + (f", {log.stopped}" if log.stopped else "")


def closing_lines(status: str, summary: dict, steps: int, last_eval: dict, run_dir: Path) -> str:
    """What a run prints last (after W&B's own block): its losses, the headline metrics of its last
    evaluation by guidance scale, and where its run store is."""
    s = summary
    train = (f"train/loss {s['train/loss']:.4g} (first {s['train/first_loss']:.4g})" if "train/first_loss" in s
             else "train/loss not measured yet")
    valid = f"eval/valid/loss {s['eval/valid/loss']:.4g}" if "eval/valid/loss" in s else "eval/valid/loss not measured yet"
    lines = [f"{status} at step {s['steps']} of {steps} in {s['wall_time']:.0f} s: {train}, {valid}"]
    lines += [f"  {line}" for line in headline(last_eval)]
    lines.append(f"  run store {shown(run_dir)}")
    return "\n".join(lines)


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
    done = {"validation": any(r["step"] == point.step and "eval/valid/loss" in r for r in rows),
            # evaluated at this step, or later: a process got past this step's hooks (a resume from
            # an earlier checkpoint than the newest, e.g. the members' common step, members.py)
            "evaluation": int(saved.get("evaluated_step", -1)) >= point.step}
    return dataclasses.replace(point, wall_time=float(saved.get("wall_time", 0.0)), first_loss=first, last_loss=last,
                               eval_loss=eval_losses[-1] if eval_losses else math.nan, done_at_step=done)


def undone_at_resume(point: ResumePoint, hooks: Hooks) -> tuple[str, ...]:
    """The hooks due at the resumed step that were not finished (process 0 read its run store;
    the evaluations run on every process, so it tells the others)."""
    left = left_at(hooks, point.step, point.done_at_step) if point.done_at_step else ()
    if jax.process_count() == 1:
        return left
    from jax.experimental import multihost_utils

    flags = multihost_utils.broadcast_one_to_all(np.array([h.name in left for h in hooks.hooks], np.int32))
    return tuple(h.name for h, f in zip(hooks.hooks, flags) if f)


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


def run_tracker(cfg: RunConfig, job: JobInfo, run, run_dir: Path, point: ResumePoint, flops_per_step: float, peak: tuple,
                extra: Optional[dict] = None):
    """The run's store and tracker run, with what the run records about itself (meta.json; `extra`
    added to it, e.g. a member's place in its job); `peak`: (FLOP/s of one device, its source)."""
    meta = run_meta(job.overrides, param_count(run.abstract), flops_per_step, *peak, asdict(run.model_cfg), run.dataset.info,
                    resumed_from=point.step)
    meta["mesh"] = dict(run.mesh.shape)
    stages = [name for name, _ in run.gradient_options.added]
    if stages:  # a caller's own gradient stages (train/gradients.py gradient_stage) changed what trained
        meta["gradient_stages"] = stages
    meta["wandb_group"] = job.group  # `dalle-ablate eval` files its eval jobs under the same group
    meta.update(extra or {})
    return build_tracker(cfg.tracker, run_dir, job.config if job.config is not None else asdict(cfg), meta, name=job.name,
                         group=job.group, job_type=job.job_type or cfg.model.layout, resume_step=point.tracker_step,
                         is_main_process=jax.process_index() == 0)


def run_summary(log: StepLogger, seen, run, final_step: int, t_start: float) -> dict:
    """What a run's summary says when it ends (its losses, steps, wall time and why it stopped). A
    loss not measured yet (no step logged, no validation run: e.g. a Ctrl-C before them) is left
    out, not written as NaN; a diverged run's train/loss is the value that was not finite."""
    summary = {"data/code_unigram_entropy": run.dataset.info.get("code_unigram_entropy"), "steps": final_step,
               "wall_time": time.perf_counter() - t_start}
    if not math.isnan(log.first_loss):
        summary.update({"train/loss": log.last_loss, "train/first_loss": log.first_loss})
    if not math.isnan(seen.eval_loss):
        summary["eval/valid/loss"] = seen.eval_loss
    if log.reason:
        summary["reason"] = log.reason
    return summary


def _train(cfg: RunConfig, job: JobInfo, run_dir: Path, t_start: float) -> Result:
    t, pi = cfg.trainer, jax.process_index()
    run = assemble(cfg)  # the mesh and batch are checked before any data is read or anything compiles
    point = resume_point(cfg, run_dir, target=run.abstract_state())
    state = point.state if point.state is not None else run.init_state()
    flops_per_step = train_flops_per_example(run.model_cfg) * t.batch_size
    peak, peak_source = device_peak_flops(cache_dir=cfg.data.cache_dir)  # of one device; the step runs on every device
    tracker = run_tracker(cfg, job, run, run_dir, point, flops_per_step, (peak, peak_source))
    point = with_logged(point, run_dir)
    t_start -= point.wall_time  # the run's wall time counts its earlier processes'
    with ends_on_error(tracker):
        # Every process saves (each writes its own shards; orbax's primary process writes the metadata).
        ckpt = checkpoint.Checkpointer(run_dir / "checkpoints", t.keep_checkpoints, on_saved=tracker.log_checkpoint)
        train_step = run.train_step()
        hooks, seen = periodic_hooks(cfg, run, tracker, ckpt, job, lambda: t_start)
        job.hooks.add_hooks(hooks)
        seen.eval_loss = point.eval_loss
        batches = run.dataset.train_batches(t.batch_size, data_seed(cfg), point.step, *run.placement.host_rows(t.batch_size))
        bar = tqdm(total=t.steps, initial=point.step, disable=not t.progress or pi != 0, unit="step", dynamic_ncols=True)
        log = StepLogger(tracker, bar, t, flops_per_step, run.tokens_per_step, peak * run.mesh.size)
        log.first_loss, log.last_loss = point.first_loss, point.last_loss
        left = undone_at_resume(point, hooks)
        if pi == 0:
            job.hooks.started(run_dir, jax.process_count())
        status, state = run_steps(state, range(point.step + 1, t.steps + 1), train_step, batches, run.placement, t.batch_size,
                                  log, hooks, ckpt, left)
        flushed = log.flush()  # the step in flight
        if status == "interrupted" and not flushed:
            status = "diverged"
        bar.close()
        # a diverged run ends at the step whose loss was not finite (the step after it, already
        # trained when that loss was fetched, is neither logged nor counted)
        final_step = log.diverged_at if status == "diverged" else int(jax.device_get(state.step))
        saved = status == "interrupted" and final_step > point.step
        if status == "interrupted":
            log.reason = interrupted_at(log, final_step, t.steps)
            if saved:
                ckpt.save(final_step, state)  # resume=auto continues from here (none if this step is saved)
        if status == "finished":
            grid = sample_grid(run.graphdef, state.params, run.dataset, run.model_cfg, cfg, grid_key(cfg.seed),
                               run.placement.replicated)
            if grid is not None:
                tracker.log_image("samples/grid", grid[0], final_step, caption=" | ".join(grid[1]))
        summary = run_summary(log, seen, run, final_step, t_start)
        tracker.log_summary(summary)
        ckpt.close()
        tracker.finish(status)
        if pi == 0:
            print(closing_lines(status, summary, t.steps, seen.last_eval, run_dir), flush=True)
    return Result(eval_loss=seen.eval_loss, train_loss=log.last_loss, steps=final_step, run_dir=run_dir, status=status,
                  summary=summary, reason=log.reason, saved=saved)
