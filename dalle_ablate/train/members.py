"""Seeds as members of one job (`seeds=[0,1,2]`, issue 40): the runs `seed=k` of one configuration
trained by one compiled program over a leading member axis, with one start-up, one compilation, one
pass over the validation batches and one batched sampler for all of them.

Each member is the separate run `seed=k` would be, on the device and on disk: its own initial
parameters, data order and dropout keys (derived from its seed as `loop.train` derives them), its
own run store, W&B run, checkpoints (the separate run's format, so `resume`, `eval`, `report` and
`study` read a member as a run), summary, sample grid and evaluation. The program is `jax.vmap` of
the run's step core (`members.impl=vmap`: equal to the separate runs within float32 rounding, XLA's
batched matmuls summing in another order) or `jax.lax.map` over it (`map`: each member's own
unbatched program in one loop, bit-for-bit on a CPU). A member whose loss is not finite is frozen
there (its updates masked on the device) and ended `diverged` as its separate run would end; the
others go on (docs/guides/members.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dalle_ablate.config import MembersConfig, RunConfig, data_seed, init_seed
from dalle_ablate.evaluate.runner import MemberEvaluations, evaluation_or_none
from dalle_ablate.fileio import atomic_write
from dalle_ablate.generate import image_grid
from dalle_ablate.model import build_model
from dalle_ablate.model.flops import train_flops_per_example
from dalle_ablate.parallel import init_state
from dalle_ablate.registry import RunFailed
from dalle_ablate.track.base import ends_on_error
from dalle_ablate.track.runstore import StoreLock
from dalle_ablate.train import checkpoint
from dalle_ablate.train.assembly import Assembly, assemble
from dalle_ablate.train.hooks import Evaluations, Hooks, eval_graph, evaluate, log_examples
from dalle_ablate.train.loop import (JobInfo, ResumePoint, Result, StepLogger, closing_lines, finished_before, grid_captions,
                                     grid_key, grid_sampler, interrupted_at, resume_point, run_steps, run_summary,
                                     run_tracker, undone_at_resume, with_logged)
from dalle_ablate.train.perf import device_peak_flops
from dalle_ablate.train.member_program import (MemberPlacement, MembersState, member_placement, member_slice, members_eval_step,
                                               members_step, over_members, stacked)

MEMBERS_FILE = "members.json"  # in the job's own folder: its members' folders and how each ended


def member_config(cfg: RunConfig, seed: int) -> RunConfig:
    """The config of member `seed`: the separate run `seed=k` (seeds, members and mesh.member unset)."""
    return dataclasses.replace(cfg, seed=seed, seeds=None, members=MembersConfig(),
                               mesh=dataclasses.replace(cfg.mesh, member=1))


@dataclass
class Member:
    """One member's host side: what `loop._train` keeps for its one run."""

    index: int
    cfg: RunConfig
    job: JobInfo
    run_dir: Path
    point: ResumePoint = field(default_factory=ResumePoint)
    tracker: Any = None
    ckpt: Any = None
    log: Optional[StepLogger] = None
    seen: Evaluations = field(default_factory=Evaluations)
    t_start: float = 0.0
    status: str = "running"  # running | finished | diverged | interrupted | failed
    result: Optional[Result] = None

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def name(self) -> str:
        return self.job.name or Path(self.job.job_dir).name

    def done_at(self, step: int, hook: str) -> bool:
        """Whether the earlier process of this member's store finished `hook` at `step` (a resume)."""
        return step == self.point.step and self.point.done_at_step.get(hook, False)


class MembersLogger(StepLogger):
    """The job's steps, fetched once for all members and logged by each running member's own
    StepLogger (its tracker, losses and divergence); the progress bar counts the job's steps."""

    def __init__(self, members: list[Member], bar, t, on_diverged: Callable[[Member, int], None]):
        super().__init__(None, bar, t, 0.0, 0, 1.0)
        self.members, self.on_diverged = members, on_diverged

    def _log(self, step: int, values: dict) -> bool:
        for m in self.members:
            m.log.timed = self.timed  # untimed after a Ctrl-C (run_steps), as a run's own
            if m.status == "running" and not m.log._log(step, {k: v[m.index] for k, v in values.items()}):
                self.on_diverged(m, step)  # where its separate run ends: the step whose loss was not finite
        self.bar.update(1)
        return any(m.status == "running" for m in self.members)

    def restart_clock(self) -> None:
        for m in self.members:
            m.log.restart_clock()


class MembersCheckpoints:
    """`check()` of every running member's Checkpointer, before each step (run_steps)."""

    def __init__(self, members: list[Member]):
        self.members = members

    def check(self) -> None:
        for m in self.members:
            if m.status == "running":
                m.ckpt.check()


class MemberBatches:
    """The members' training batches, each from its own seed's data order, stacked: [members, batch, ...]."""

    def __init__(self, run: Assembly, members: list[Member], start: int):
        bs = run.cfg.trainer.batch_size
        self.iters = [run.dataset.train_batches(bs, data_seed(m.cfg), start, 0, 1) for m in members]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batches = [next(it) for it in self.iters]
        return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def write_members_file(job_dir: Path, members: list[Member], impl: str) -> None:
    """`<job>/members.json`: the members' seeds, folders and how each stands (rewritten at each change)."""
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(job_dir) / MEMBERS_FILE, json.dumps({
        "seeds": [m.seed for m in members], "impl": impl,
        "members": [{"seed": m.seed, "job_dir": str(m.job.job_dir), "status": m.status,
                     "reason": m.log.reason if m.log is not None else ""} for m in members]}, indent=2))


def settled_before(cfg: RunConfig, run_dir: Path) -> Optional[dict]:
    """With `resume=auto`, the summary of a member's store that finished (loop.finished_before) or
    diverged before: left as it is. (A separate run that diverged retrains from its last
    checkpoint and diverges there again, the same run; a member is spared that, and the others are
    not sent back to its checkpoint.)"""
    done = finished_before(cfg, run_dir)
    path = run_dir / "summary.json"
    if done is None and cfg.resume == "auto" and path.exists():
        saved = json.loads(path.read_text())
        done = saved if saved.get("status") == "diverged" else None
    return done


def restore_common_step(members: list[Member], target) -> None:
    """Resumed members must start at one step: where their newest checkpoints differ (a kill
    between the members' saves of one step), each newer one restarts from the newest step every
    member has; its own newer checkpoint is written again, with the same values, on the way."""
    steps = {m.point.step for m in members}
    if len(steps) == 1:
        return
    common = min(steps)
    moved = [m for m in members if m.point.step > common]
    for m in moved:
        if common == 0:
            m.point = ResumePoint(continues_store=True)
            continue
        if common not in checkpoint.finished_steps(m.run_dir / "checkpoints"):  # kept no longer (trainer.keep_checkpoints)
            raise RunFailed(f"members resume from step {common}, the newest every member has, but {m.run_dir} no longer "
                            f"keeps it; resume seed={m.seed} as a run of its own, or raise trainer.keep_checkpoints")
        step, state = checkpoint.restore(m.run_dir / "checkpoints", common, target)
        m.point = ResumePoint(step, state, continues_store=True)
    print(f"members {', '.join(f'seed={m.seed}' for m in moved)} resume from step {common}, the newest step every member "
          "has a checkpoint of", file=sys.stderr, flush=True)


def train_members(cfg: RunConfig, job: JobInfo, jobs: list[JobInfo]) -> list[Result]:
    """Train `cfg.seeds` as members of one job; `jobs`: each member's folder and names (job.py
    `member_jobs`). Returns each member's Result, in the order of the seeds. The job's `hooks`
    (RunHooks: an Optuna trial's, refused with seeds) are not called: their periodic work sees one
    run's state, and members have a stack of them."""
    t_start = time.perf_counter()
    members = [Member(i, member_config(cfg, s), j, Path(j.job_dir) / "run") for i, (s, j) in enumerate(zip(cfg.seeds, jobs))]
    results: dict[int, Result] = {}
    for m in members:
        done = settled_before(m.cfg, m.run_dir)
        if done is not None:
            m.status = done["status"]
            print(f"{m.run_dir}: {done['status']} before at step {done['steps']} of {cfg.trainer.steps}; left as it is "
                  "(resume=auto)", flush=True)
            results[m.seed] = Result(eval_loss=float(done.get("eval/valid/loss", np.nan)),
                                     train_loss=float(done.get("train/loss", np.nan)), steps=int(done["steps"]),
                                     run_dir=m.run_dir, status=done["status"], summary=done, reason=done.get("reason", ""))
    live = [m for m in members if m.seed not in results]
    if live:
        for i, m in enumerate(live):
            m.index = i
        with contextlib.ExitStack() as locks:  # one writer per run store, each member's taken before anything is built
            for m in live:
                locks.enter_context(StoreLock(m.run_dir))
            for m in _train_members(cfg, job, live, members, t_start):
                results[m.seed] = m.result
    return [results[s] for s in cfg.seeds]


def _train_members(cfg: RunConfig, job: JobInfo, members: list[Member], everyone: list[Member], t_start: float) -> list[Member]:
    """Train the `members` not finished before (`everyone`: all of the job's, for members.json)."""
    t, impl = cfg.trainer, cfg.members.impl
    devices = jax.devices()
    # mesh.member divides the job's members; those left to train (a resume, a top-up) it may not
    groups = math.gcd(cfg.mesh.member, len(members))
    run = assemble(members[0].cfg, devices=devices[:len(devices) // groups])
    mp = member_placement(run, devices, groups)
    target = run.abstract_state()
    for m in members:
        m.point = resume_point(m.cfg, m.run_dir, target)
    restore_common_step(members, target)
    flops_per_step = train_flops_per_example(run.model_cfg) * t.batch_size
    peak, peak_source = device_peak_flops(cache_dir=cfg.data.cache_dir)
    with _ends_on_error(members, job.job_dir, everyone, impl):
        for m in members:
            place = {"members": {"seeds": cfg.seeds, "index": cfg.seeds.index(m.seed), "job_dir": str(job.job_dir),
                                 "impl": impl}}
            m.tracker = run_tracker(m.cfg, m.job, run, m.run_dir, m.point, flops_per_step, (peak, peak_source), place)
            m.point = with_logged(m.point, m.run_dir)
            m.t_start = t_start - m.point.wall_time
        write_members_file(job.job_dir, everyone, impl)
        return _run_members(cfg, job, run, mp, members, everyone, flops_per_step, peak * run.mesh.size * groups)


@contextlib.contextmanager
def _ends_on_error(members: list[Member], job_dir: Path, everyone: list[Member], impl: str):
    """Each member still running (its tracker made) ends as `loop.train` ends a run on an error
    (track/base.py ends_on_error), and members.json says so."""
    try:
        yield
    except BaseException as e:
        for m in members:
            if m.status == "running" and m.tracker is not None:
                m.status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
                with contextlib.suppress(BaseException), ends_on_error(m.tracker):
                    raise e
        with contextlib.suppress(OSError):
            write_members_file(job_dir, everyone, impl)
        raise


def _run_members(cfg, job, run: Assembly, mp: MemberPlacement, members: list[Member], everyone: list[Member], flops_per_step,
                 peak_all) -> list[Member]:
    t, impl = cfg.trainer, cfg.members.impl
    start = members[0].point.step
    states = [m.point.state if m.point.state is not None else
              init_state(lambda s=init_seed(m.cfg): build_model(run.model_cfg, s), run.new_state, run.placement) for m in members]
    state = MembersState(stacked(states, mp), jax.device_put(np.ones(len(members), bool), mp.vector))
    del states
    for m in members:
        m.ckpt = checkpoint.Checkpointer(m.run_dir / "checkpoints", t.keep_checkpoints, on_saved=m.tracker.log_checkpoint)
        m.log = StepLogger(m.tracker, tqdm(disable=True), t, flops_per_step, run.tokens_per_step, peak_all, share=len(members))
        m.log.first_loss, m.log.last_loss = m.point.first_loss, m.point.last_loss
        m.seen.eval_loss = m.point.eval_loss

    def ended(m: Member, status: str, final_step: int) -> None:
        summary = run_summary(m.log, m.seen, run, final_step, m.t_start)
        m.tracker.log_summary(summary)
        m.ckpt.close()  # a save that failed raises here: the member is still running, and fails (_ends_on_error)
        m.tracker.finish(status)
        m.status = status
        print(closing_lines(status, summary, t.steps, m.seen.last_eval, m.run_dir), flush=True)
        m.result = Result(eval_loss=m.seen.eval_loss, train_loss=m.log.last_loss, steps=final_step, run_dir=m.run_dir,
                          status=status, summary=summary, reason=m.log.reason,
                          saved=status == "interrupted" and final_step > m.point.step)
        write_members_file(job.job_dir, everyone, impl)

    hooks = member_hooks(cfg, run, mp, members)
    bar = tqdm(total=t.steps, initial=start, disable=not t.progress, unit="step", dynamic_ncols=True)
    log = MembersLogger(members, bar, t, lambda m, step: ended(m, "diverged", step))
    left = tuple(sorted({name for m in members for name in undone_at_resume(m.point, hooks)},
                        key=[h.name for h in hooks.hooks].index))
    batches = MemberBatches(run, members, start)
    train_step = members_step(run, [m.seed for m in members], impl, mp)
    status, state = run_steps(state, range(start + 1, t.steps + 1), train_step, batches, mp, t.batch_size, log, hooks,
                              MembersCheckpoints(members), left)
    log.flush()  # the step in flight (a member that diverged in it is ended there)
    bar.close()
    final_step = int(jax.device_get(state.step))
    running = [m for m in members if m.status == "running"]
    if status == "interrupted":
        for m in running:
            m.log.reason = interrupted_at(log, final_step, t.steps)
            if final_step > m.point.step:
                m.ckpt.save(final_step, member_slice(state.state, m.index))
    if status == "finished" and running:
        member_grids(cfg, run, mp, members, running, state.state.params, final_step)
    failed = []
    for m in running:  # each ends even if one before it cannot (its last save failed); the first failure is raised
        try:
            ended(m, status, final_step)
        except Exception as e:  # noqa: BLE001 - re-raised below, once the others have ended
            failed.append(e)
    if failed:
        raise failed[0]
    return members


def member_hooks(cfg, run: Assembly, mp: MemberPlacement, members: list[Member]) -> Hooks:
    """The run's periodic work (hooks.periodic_hooks) for every running member: one validation pass
    and one sampling evaluation for all of them, each member's checkpoint in its own store."""
    t = cfg.trainer
    hooks = Hooks(t.steps)
    graph = eval_graph(run)
    eval_step = members_eval_step(graph, cfg.members.impl, mp)
    base = evaluation_or_none(members[0].cfg, run.dataset, run.model_cfg, graph, None, mp.replicated)
    sampler = over_members(base.sampler, cfg.members.impl, (0, *(None,) * 6)) if base is not None else None
    evaluations = MemberEvaluations(base, [m.tracker for m in members], jax.jit(sampler)) if base is not None else None

    def due(step: int, name: str) -> list[Member]:
        return [m for m in members if m.status == "running" and not m.done_at(step, name)]

    def validation(step, ms):
        losses, examples = evaluate(eval_step, ms.state.params, run.dataset, t.batch_size, t.eval_batches, mp.shared)
        for m in due(step, "validation"):
            m.seen.eval_loss = float(losses[m.index])
            m.tracker.log({"eval/valid/loss": m.seen.eval_loss, "samples": step * t.batch_size,
                           "tokens": step * run.tokens_per_step}, step)
            log_examples(m.tracker, examples[m.index], step)

    def save(step, ms):  # before the sampling evaluation, as a separate run saves
        for m in due(step, "checkpoint"):
            m.ckpt.save(step, member_slice(ms.state, m.index))
            m.tracker.log_summary({"wall_time": time.perf_counter() - m.t_start, "steps": step})

    def sample(step, ms):
        todo = due(step, "evaluation")
        params = ms.state.params
        out = evaluations.run(params, step, {m.index: (member_slice(params, m.index), m.name) for m in todo})
        for m in todo:
            m.seen.last_eval = out[m.index]
            m.tracker.log_summary({"evaluated_step": step})

    hooks.add("validation", validation, t.eval_every)
    hooks.add("checkpoint", save, t.save_every)
    if evaluations is not None:
        hooks.add("evaluation", sample, cfg.eval.every or 0)
    return hooks


def member_grids(cfg, run: Assembly, mp: MemberPlacement, members: list[Member], running: list[Member], params, step: int) -> None:
    """The end-of-run sample grid of each finished member, drawn for all members at once with each
    member's own grid key."""
    inputs = grid_captions(run.dataset, cfg)
    if inputs is None:
        return
    captions, ids, mask = inputs
    sampler = jax.jit(over_members(grid_sampler(run.graphdef, run.model_cfg, cfg), cfg.members.impl, (0, None, None, 0)),
                      out_shardings=mp.replicated)
    codes = np.asarray(sampler(params, ids, mask, jnp.stack([grid_key(m.seed) for m in members])))
    for m in running:
        grid = image_grid(run.dataset.decode_images(codes[m.index]), captions, cfg.samples.per_caption)
        m.tracker.log_image("samples/grid", grid, step, caption=" | ".join(captions))
