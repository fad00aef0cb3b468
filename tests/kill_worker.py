"""`python run.py ...` that kills itself with SIGKILL (or `KILL_SIGNAL`, e.g. SIGINT for a Ctrl-C)
at a chosen point, so a test can cut a run off exactly there: `KILL_AT=step:N` before train step N
(the checkpoint before it written), `KILL_AT=save:N` right after the save of step N was handed
to orbax (the write in flight), `KILL_AT=fetch:N` in the blocking fetch of step N's metrics
(step N+1 already trained and queued), or `KILL_AT=plot:N` while the sampling evaluation of step N
draws its Pareto plot. `KILL_AT=settle:N` sends nothing: after the save of step N is handed to
orbax it waits until orbax has ended that save's background write (failed or not), so that the
next step meets its outcome; `KILL_AT=shell:N` runs the shell command `AFTER_SAVE` once the save of
step N is complete on disk (e.g. to make a folder read-only under the run), `KILL_AT=shell_step:N`
runs it before train step N.

Stages before the steps: `KILL_AT=compose:1` once Hydra has composed the job's config,
`KILL_AT=fit:N` at the N-th iteration of the k-means tokenizer's fit -- from inside a garbage
collection callback, as jax's `_xla_gc_callback` is one: where Python drops a KeyboardInterrupt
("Exception ignored in") --, `KILL_AT=render:N` while the N-th scene is rendered,
`KILL_AT=compile:1` as the first train step is called (it compiles), `KILL_AT=job:N` before the
N-th job of a multirun starts."""

from __future__ import annotations

import gc
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import hydra._internal.config_loader_impl as hydra_loader
import hydra.core.utils as hydra_utils

from dalle_ablate.data import image_tokenizer, shapes
from dalle_ablate.evaluate import runner
from dalle_ablate.train import assembly, checkpoint, logger

ROOT = Path(__file__).resolve().parent.parent
where, at = os.environ["KILL_AT"].split(":")
at = int(at)
sig = getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL"))
if sig == signal.SIGINT:
    # A terminal's Ctrl-C: a suite started in the background (`cmd &` in a script) hands its
    # children SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
save, check = checkpoint.Checkpointer.save, checkpoint.Checkpointer.check
steps = {"n": 0}


def killing_save(self, step, state):
    steps["saving"] = True
    save(self, step, state)
    steps["saving"] = False
    if where == "save" and step == at:
        signal.raise_signal(sig)
    if where == "settle" and step == at:
        while self.manager.is_saving_in_progress():
            time.sleep(0.01)
    if where == "shell" and step == at:
        self.manager.wait_until_finished()
        subprocess.run(os.environ["AFTER_SAVE"], shell=True, check=True)
    if where == "step":
        self.manager.wait_until_finished()  # the checkpoints before the kill are complete


def killing_check(self):
    if steps.get("saving"):  # save() calls check() too: not a step
        return check(self)
    steps["n"] += 1  # the loop checks once before every train step
    if where == "step" and steps["n"] == at:
        # raise(3): taken in this thread before the call returns, so a Ctrl-C lands before the step
        signal.raise_signal(sig)
    if where == "shell_step" and steps["n"] == at:
        subprocess.run(os.environ["AFTER_SAVE"], shell=True, check=True)
    check(self)


fetch = logger.StepLogger.fetch


def killing_fetch(self, step, metrics):
    if where == "fetch" and step == at and not steps.get("fetch_killed"):  # once: the run's last flush fetches it again
        steps["fetch_killed"] = True
        signal.raise_signal(sig)
    return fetch(self, step, metrics)


log_pareto, figure_array = runner.Evaluation._log_pareto, runner.figure_array


def killing_log_pareto(self, rows, step, run_name):
    steps["plotting"] = where == "plot" and step == at and not steps.get("plot_killed")
    return log_pareto(self, rows, step, run_name)


def killing_figure_array(fig):
    if steps.get("plotting"):  # once, half way through drawing the figure
        steps["plotting"], steps["plot_killed"] = False, True
        fig.tight_layout()
        signal.raise_signal(sig)
    return figure_array(fig)


def nth(name: str) -> bool:
    """True at the `at`-th call counted under `name`, if KILL_AT names it."""
    steps[name] = steps.get(name, 0) + 1
    return where == name and steps[name] == at


def after(fn, name: str):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        if nth(name):
            signal.raise_signal(sig)
        return out

    return wrapped


def before(fn, name: str):
    def wrapped(*args, **kwargs):
        if nth(name):
            signal.raise_signal(sig)
        return fn(*args, **kwargs)

    return wrapped


def from_gc(fn):
    def wrapped(*args, **kwargs):
        if nth("fit"):

            def callback(phase, info):  # once: the signal's handler runs inside the callback
                gc.callbacks.remove(callback)
                signal.raise_signal(sig)

            gc.callbacks.append(callback)
            gc.collect()
        return fn(*args, **kwargs)

    return wrapped


train_step = assembly.Assembly.train_step


def killing_train_step(self, *args, **kwargs):
    return before(train_step(self, *args, **kwargs), "compile")


hydra_loader.ConfigLoaderImpl.load_configuration = after(hydra_loader.ConfigLoaderImpl.load_configuration, "compose")
# (Hydra loads its launcher plugin anew, which imports run_job from here again)
hydra_utils.run_job = before(hydra_utils.run_job, "job")
image_tokenizer._lloyd_step = from_gc(image_tokenizer._lloyd_step)
shapes.render = before(shapes.render, "render")
assembly.Assembly.train_step = killing_train_step
runner.Evaluation._log_pareto, runner.figure_array = killing_log_pareto, killing_figure_array
checkpoint.Checkpointer.save, checkpoint.Checkpointer.check = killing_save, killing_check
logger.StepLogger.fetch = killing_fetch
sys.argv = [str(ROOT / "run.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
