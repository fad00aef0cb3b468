"""What the trainer records of a job and its runs (a plain run is a job of one member): where each
run writes and how it is named (`JobInfo`), each member's host side while it trains (`Member`),
its run store and tracker run with what it records about itself (`run_tracker`), what it ends
with (`Result`, `run_summary`, `closing_lines`) and, for `seeds=[...]`, the job's own record of
its members (`members.json`)."""

from __future__ import annotations

import json
import os
import sys
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import jax

from dalle_ablate.config import RunConfig
from dalle_ablate.evaluate.runner import headline
from dalle_ablate.fileio import atomic_write, shown, staging_root, url_of
from dalle_ablate.model import param_count
from dalle_ablate.track import build_tracker
from dalle_ablate.train.meta import run_meta
from dalle_ablate.train.resume import ResumePoint

if TYPE_CHECKING:
    from dalle_ablate.train.logger import RunLog

MEMBERS_FILE = "members.json"  # in a members job's own folder: its members' folders and how each ended


class RunHooks:
    """What a caller above the trainer hears from it (job.py's Optuna trial), and periodic work of
    its own. `started` and `should_stop` are called on process 0 only; `add_hooks` on every
    process (a hook runs on all of them, as the run's evaluations do). A job of several members
    (`seeds=[...]`) calls them as a plain run does: `started` once for each member's run store,
    `should_stop` with the mean of its running members' validation losses, and a hook sees the
    program's state (train/program.py: the members' states stacked)."""

    def add_hooks(self, hooks) -> None:
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


def settled_result(summary: dict, run_dir: Path) -> Result:
    """The Result of a run store that ended before (resume.settled_before), from its summary."""
    return Result(
        eval_loss=float(summary.get("eval/valid/loss", math.nan)),
        train_loss=float(summary.get("train/loss", math.nan)),
        steps=int(summary["steps"]),
        run_dir=run_dir,
        status=summary["status"],
        summary=summary,
        reason=summary.get("reason", ""),
    )


@dataclass
class Evaluations:
    """What a run's hooks measured last, for its summary and closing lines."""

    eval_loss: float = math.nan
    last_eval: dict = field(default_factory=dict)  # the last sampling evaluation's result


@dataclass
class Member:
    """One run of a job, on the host: its config (the run `seed=k`), folder and names, where it
    starts, its tracker run, checkpoints, logging and evaluations, and how it stands."""

    index: int  # its place on the program's member axis (train/program.py)
    cfg: RunConfig
    job: JobInfo
    run_dir: Path
    point: ResumePoint = field(default_factory=ResumePoint)
    tracker: Any = None
    ckpt: Any = None
    log: Optional[RunLog] = None
    seen: Evaluations = field(default_factory=Evaluations)
    t_start: float = 0.0  # when it started, moved back by its earlier processes' wall time
    status: str = "running"  # running | finished | diverged | pruned | interrupted | failed
    result: Optional[Result] = None

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def name(self) -> str:
        return self.job.name or Path(self.job.job_dir).name

    @property
    def reason(self) -> str:
        return self.result.reason if self.result is not None else self.log.reason if self.log is not None else ""

    def done_at(self, step: int, hook: str) -> bool:
        """Whether the earlier process of this member's store finished `hook` at `step` (a resume)."""
        return step == self.point.step and self.point.done_at_step.get(hook, False)


def run_tracker(m: Member, run, flops_per_step: float, peak: tuple, extra: Optional[dict] = None):
    """The member's run store and tracker run, with what it records about itself (meta.json;
    `extra` added to it, e.g. a member's place in its job); `run`: the Assembly it trains;
    `peak`: (FLOP/s of one device, its source)."""
    cfg, job = m.cfg, m.job
    meta = run_meta(
        job.overrides,
        param_count(run.abstract),
        flops_per_step,
        *peak,
        asdict(run.model_cfg),
        run.dataset.info,
        resumed_from=m.point.step,
    )
    meta["mesh"] = dict(run.mesh.shape)
    stages = [name for name, _ in run.gradient_options.added]
    if stages:  # a caller's own gradient stages (train/gradients.py gradient_stage) changed what trained
        meta["gradient_stages"] = stages
    meta["wandb_group"] = job.group  # `dalle-ablate eval` files its eval jobs under the same group
    meta.update(extra or {})
    return build_tracker(
        cfg.tracker,
        m.run_dir,
        job.config if job.config is not None else asdict(cfg),
        meta,
        name=job.name,
        group=job.group,
        job_type=job.job_type or cfg.model.layout,
        resume_step=m.point.tracker_step,
        is_main_process=jax.process_index() == 0,
    )


def run_summary(m: Member, dataset_info: dict, final_step: int) -> dict:
    """What a run's summary says when it ends (its losses, steps, wall time and why it stopped). A
    loss not measured yet (no step logged, no validation run: e.g. a Ctrl-C before them) is left
    out, not written as NaN; a diverged run's train/loss is the value that was not finite."""
    log = m.log
    summary = {
        "data/code_unigram_entropy": dataset_info.get("code_unigram_entropy"),
        "steps": final_step,
        "wall_time": time.perf_counter() - m.t_start,
    }
    if not math.isnan(log.first_loss):
        summary.update({"train/loss": log.last_loss, "train/first_loss": log.first_loss})
    if not math.isnan(m.seen.eval_loss):
        summary["eval/valid/loss"] = m.seen.eval_loss
    if log.reason:
        summary["reason"] = log.reason
    return summary


def closing_lines(status: str, summary: dict, steps: int, last_eval: dict, run_dir: Path) -> str:
    """What a run prints last (after W&B's own block): its losses, the headline metrics of its last
    evaluation by guidance scale, and where its run store is."""
    s = summary
    train = (
        f"train/loss {s['train/loss']:.4g} (first {s['train/first_loss']:.4g})"
        if "train/first_loss" in s
        else "train/loss not measured yet"
    )
    valid = (
        f"eval/valid/loss {s['eval/valid/loss']:.4g}" if "eval/valid/loss" in s else "eval/valid/loss not measured yet"
    )
    lines = [f"{status} at step {s['steps']} of {steps} in {s['wall_time']:.0f} s: {train}, {valid}"]
    lines += [f"  {line}" for line in headline(last_eval)]
    lines.append(f"  run store {shown(run_dir)}")
    return "\n".join(lines)


def member_folder(job_dir: Path, recorded: str) -> Path:
    """A member's folder as members.json names it: from the folder the job's folder is in (relative:
    `baseline-seed1` beside it, `map/seed0` under it), or, in a file written before, absolute -- a bucket job's under the staging root of the host that wrote it,
    which is this host's staging copy of the same bucket folder (the path from its `gs/` on)."""
    path = Path(recorded)
    if not path.is_absolute():
        return Path(os.path.normpath(Path(job_dir).parent / path))
    if url_of(job_dir) is not None and url_of(path) is None and "gs" in path.parts:
        at = len(path.parts) - 1 - path.parts[::-1].index("gs")
        return staging_root().joinpath(*path.parts[at:])
    return path


def write_members_file(job_dir: Path, members: list[Member], impl: str) -> None:
    """`<job>/members.json`: the members' seeds, folders and how each stands (rewritten at each change)."""
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(
        Path(job_dir) / MEMBERS_FILE,
        json.dumps(
            {
                "seeds": [m.seed for m in members],
                "impl": impl,
                "members": [
                    # where it lives from the job's folder: the same on every host, whatever its staging root
                    {
                        "seed": m.seed,
                        "job_dir": os.path.relpath(m.job.job_dir, Path(job_dir).parent),
                        "status": m.status,
                        "reason": m.reason,
                    }
                    for m in members
                ],
            },
            indent=2,
        ),
    )


def believe_the_stores(job_dir: Path, seeds: list[int], dirs: list[Path]) -> None:
    """A resumed members job goes by each member's own run store, which its checkpoints match;
    where members.json says otherwise (a member finished there, not in its store: written so by
    an older version resumed on another VM, which trained the members into a folder of its own)
    it says so, once per member."""
    path = job_dir / MEMBERS_FILE
    if not path.exists():
        return
    said = {m["seed"]: m.get("status") for m in json.loads(path.read_text())["members"]}
    for seed, folder in zip(seeds, dirs):
        summary = Path(folder) / "run" / "summary.json"
        store = json.loads(summary.read_text()) if summary.exists() else {"status": "not started", "steps": 0}
        if said.get(seed) == "finished" and store.get("status") != "finished":
            print(
                f"warning: {shown(path)} says member seed={seed} finished, but its run store "
                f"{shown(Path(folder) / 'run')} says {store.get('status')} at step {store.get('steps', 0)}: "
                "the store is believed, and the member continues from its own newest checkpoint",
                file=sys.stderr,
                flush=True,
            )


def recorded_member_dirs(job_dir: Path, seeds: list[int]) -> list[Path] | None:
    """The member folders a members job recorded in `<job dir>/members.json` (write_members_file)
    for these same seeds: a resumed job wins them back from it, since the resume hint names its
    folder literally (`hydra.run.dir=<job dir>`) and the template that placed them is gone."""
    path = job_dir / MEMBERS_FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("seeds") != seeds:
        return None
    recorded = {m["seed"]: member_folder(job_dir, m["job_dir"]) for m in record["members"]}
    return [recorded[k] for k in seeds]
