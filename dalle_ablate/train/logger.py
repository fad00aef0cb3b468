"""Each step's metrics, logged: the job's steps fetched one step late (`StepLogger`) and each
member's row written to its own tracker (`RunLog`: its losses, timing and where it diverged)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import jax

from dalle_ablate import interrupts
from dalle_ablate.train.perf import PeakBelowStep, mfu

SCALARS = ("train/loss", "train/grad_norm", "train/param_norm", "train/lr")  # fetched every step


@dataclass(frozen=True)
class Chunk:
    """Step `index` of a dispatch of `size` steps (trainer.steps_per_dispatch): `metrics` hold every
    step of it on a leading axis, fetched once for all of them."""

    metrics: dict
    index: int
    size: int


class RunLog:
    """One run's side of the logging: its rows in its tracker, its first, last and last finite
    loss, the step where it diverged and why it stopped."""

    def __init__(self, tracker, batch_size: int, tokens_per_step: int):
        self.tracker, self.batch_size, self.tokens_per_step = tracker, batch_size, tokens_per_step
        self.first_loss = self.last_loss = math.nan
        self.last_finite: Optional[tuple[int, float]] = None  # (step, loss): what a diverged run reports
        self.diverged_at: Optional[int] = None  # the step whose loss was not finite: where a diverged run ends
        self.reason = ""

    def log(self, step: int, values: dict, perf: dict) -> bool:
        """Log this step's values and `perf` (its timing); False once the loss is not finite."""
        row = {k: float(v) for k, v in values.items()}
        row.update({"samples": step * self.batch_size, "tokens": step * self.tokens_per_step, **perf})
        self.tracker.log(row, step)
        self.last_loss = row["train/loss"]
        self.first_loss = self.last_loss if math.isnan(self.first_loss) else self.first_loss
        if math.isfinite(self.last_loss):
            self.last_finite = (step, self.last_loss)
            return True
        self.diverged_at = step
        self.reason = f"diverged at step {step}: train/loss={self.last_loss}; " + (
            f"last finite loss {self.last_finite[1]:.4f} at step {self.last_finite[0]}"
            if self.last_finite
            else "no finite loss before it"
        )
        return False


class StepLogger:
    """The job's steps, each logged one step late: the next step is already queued when this one's
    values are fetched, so the device never waits on the host. Each running member's values
    (`member(values, i)`, the program's slice) go to its RunLog; a member whose loss is not
    finite is handed to `on_diverged`. Times steps between boundaries (eval and save time is not
    step time), each member charged its share of the job's step, so that its step time and
    throughput read as a separate run's would on the same machine.

    A step leaves the queue only once it is logged: Ctrl-C during the blocking fetch leaves it
    (and the step after it) queued, and the interrupted job's last `flush()` logs both -- untimed
    (`timed` False): the time since the step before is no step time once a Ctrl-C came between."""

    def __init__(
        self,
        members: list,
        member: Callable,
        on_diverged: Callable,
        bar,
        t,
        flops_per_step: float,
        tokens_per_step: int,
        peak_all: tuple[float, str],
    ):
        self.members, self.member, self.on_diverged = members, member, on_diverged
        self.bar, self.t = bar, t
        self.flops_per_step, self.tokens_per_step = flops_per_step, tokens_per_step
        self.peak_all: Optional[tuple[float, str]] = peak_all  # (FLOP/s of every device, its source); None: no MFU
        self.share = len(members)  # the runs one step of the program trains
        self.queue: list[tuple[int, dict]] = []  # steps trained and not yet logged, oldest first
        self.newest = 0  # the last step queued
        self.clock, self.compiled = time.perf_counter(), False
        self.timed = True  # False: steps are logged without perf/ timing (those flushed after a Ctrl-C)
        self.held: tuple = (None, None)  # (a dispatch's metrics, their host values): fetched once
        self.chunk_perf: dict = {}  # the timing of a dispatch's first step, each of its steps' share

    def push(self, step: int, metrics: dict) -> bool:
        """Queue this step and log the one before it; False (holding nothing) once no member is
        left running (its loss was not finite): the job stops there."""
        self._enqueue(step, metrics)
        return self._drain(keep=1)

    def flush(self) -> bool:
        """Fetch and log every queued step; False once no member is left running."""
        return self._drain(keep=0)

    def interrupted(self, dispatched: list) -> None:
        """A Ctrl-C or SIGTERM stopped the job: the (step, metrics) of its last dispatch are queued
        if the interrupt came between the dispatch and their push, and what is flushed from here on
        is logged untimed."""
        for step, metrics in dispatched:
            self._enqueue(step, metrics)
        self.timed = False

    def _enqueue(self, step: int, metrics) -> None:
        if step > self.newest:  # a step is queued once
            self.queue.append((step, metrics))
            self.newest = step

    def fetch(self, step: int, metrics) -> dict:
        """The step's values on the host (blocks until the device has computed them)."""
        per_layer = step % self.t.log_every == 0 or step == self.t.steps
        if not isinstance(metrics, Chunk):
            return jax.device_get({k: v for k, v in metrics.items() if per_layer or k in SCALARS})
        if self.held[0] is not metrics.metrics:
            self.held = (metrics.metrics, jax.device_get(metrics.metrics))
        return {k: v[metrics.index] for k, v in self.held[1].items() if per_layer or k in SCALARS}

    def _drain(self, keep: int) -> bool:
        while len(self.queue) > keep:
            step, metrics = self.queue[0]
            values = self.fetch(step, metrics)  # Ctrl-C here: the step stays queued
            with interrupts.deferred():  # logged and dequeued together: never lost, never twice
                self.queue.pop(0)
                ok = self._log(step, values, metrics if isinstance(metrics, Chunk) else None)
            if not ok:
                self.queue.clear()
                return False
        return True

    def _log(self, step: int, values: dict, chunk: Optional[Chunk] = None) -> bool:
        perf = self._timing(chunk)
        for m in self.members:
            if m.status == "running" and not m.log.log(step, self.member(values, m.index), perf):
                self.on_diverged(m, step)  # where its separate run ends: the step whose loss was not finite
        running = [m for m in self.members if m.status == "running"]
        if running and "perf/tokens_per_s" in perf:
            self.bar.set_postfix(
                loss=f"{running[0].log.last_loss:.3f}", tok_s=f"{perf['perf/tokens_per_s']:,.0f}", refresh=False
            )
        self.bar.update(1)
        return bool(running)

    def _timing(self, chunk: Optional[Chunk] = None) -> dict:
        """The perf/ values of the step just fetched: the first includes compilation. A dispatch
        of several steps is timed at its first and each of its steps charged an equal share."""
        if chunk is not None and chunk.index > 0:
            return dict(self.chunk_perf)
        now = time.perf_counter()
        dt, self.clock = now - self.clock, now
        self.chunk_perf = {}
        if not self.timed:
            return {}
        if not self.compiled:
            self.compiled = True
            return {"perf/compile_time": dt}
        dt /= chunk.size if chunk is not None else 1
        perf = {}
        if self.share > 1:
            perf["perf/job_step_time"] = dt  # the whole program's step, all its members
            dt /= self.share
        perf.update({"perf/step_time": dt, "perf/tokens_per_s": self.tokens_per_step / dt})
        if self.peak_all is not None:
            try:
                perf["perf/mfu"] = mfu(self.flops_per_step / dt, *self.peak_all)
            except PeakBelowStep as e:  # the run goes on; its MFU is not logged, and the line says why
                print(f"{e}; perf/mfu is not logged for the rest of this run", file=sys.stderr, flush=True)
                self.peak_all = None
        self.chunk_perf = perf
        return perf

    def restart_clock(self) -> None:
        self.clock = time.perf_counter()
