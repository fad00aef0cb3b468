"""The trainer: one job, top to bottom. A plain run is a job of one member; `seeds=[0,1,2]` is a
job of three, each member the separate run `seed=k` on the device and on disk. The host side is
the same for both: where each member starts (resume.py), its run store and tracker run
(records.py), the loop with its periodic hooks (hooks.py) and each step logged (logger.py), how
each member ends (its sample grid, summary, closing lines) -- only the program varies
(program.py: one run's own state, or the members' states stacked). Stage 1 (the image tokenizer)
runs before, in the job (job.py). Each member's Result says how it ended; its final validation
loss is the metric a sweep optimises."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from dalle_ablate import interrupts
from dalle_ablate.registry import ConfigError
from dalle_ablate.config import RunConfig, member_config
from dalle_ablate.fileio import shown
from dalle_ablate.generate import image_grid
from dalle_ablate.model.flops import train_flops_per_example
from dalle_ablate.parallel import compile_cache, distributed
from dalle_ablate.track.base import ends_on_error
from dalle_ablate.track.runstore import StoreLock, check_locks
from dalle_ablate.train import checkpoint
from dalle_ablate.train.hooks import Hooks, periodic_hooks
from dalle_ablate.train.logger import Chunk, RunLog, StepLogger
from dalle_ablate.train.perf import device_peak_flops
from dalle_ablate.train.program import grid_captions, program_for
from dalle_ablate.train.records import (
    JobInfo,
    Member,
    Result,
    RunHooks,
    closing_lines,
    run_summary,
    run_tracker,
    settled_result,
    write_members_file,
)
from dalle_ablate.train.resume import restore_common_step, resume_point, settled_before, undone_at_resume, with_logged

__all__ = ["JobInfo", "Result", "RunHooks", "train", "train_members"]  # the trainer, as its callers see it


def train(cfg: RunConfig, job: JobInfo) -> Result:
    """One run: a job of one member, trained by its own unbatched program."""
    return train_job(cfg, job, [job])[0]


def train_members(cfg: RunConfig, job: JobInfo, jobs: list[JobInfo]) -> list[Result]:
    """Train `cfg.seeds` as members of one job (docs/guides/members.md); `jobs`: each member's
    folder and names (job.py `member_jobs`). Returns each member's Result, in the order of the seeds."""
    return train_job(cfg, job, jobs)


def train_job(cfg: RunConfig, job: JobInfo, jobs: list[JobInfo]) -> list[Result]:
    """The job of `cfg` with one member per JobInfo of `jobs` (a plain run: `[job]`). A member
    whose run store ended before is left as it is (resume.settled_before); the others are trained
    together, one writer per run store (each store locked before anything is built)."""
    t_start = time.perf_counter()
    distributed.initialize(cfg.distributed)  # before anything touches a device
    compile_cache.configure(cfg.compilation_cache)  # before anything compiles
    compiled = compile_cache.TIMES.snapshot()  # this job's programs: those compiled or loaded from here on
    pi = jax.process_index()
    configs = [member_config(cfg, s) for s in cfg.seeds] if cfg.seeds is not None else [cfg]
    members = [Member(i, c, j, Path(j.job_dir) / "run") for i, (c, j) in enumerate(zip(configs, jobs))]
    for m in members:
        done = settled_before(m.cfg, m.run_dir)
        if done is not None:
            m.status, m.result = done["status"], settled_result(done, m.run_dir)
            if pi == 0:
                print(
                    f"{shown(m.run_dir)}: {m.status} before at step {done['steps']} of {cfg.trainer.steps}; left as it is "
                    "(resume=auto)",
                    flush=True,
                )
    live = [m for m in members if m.result is None]
    for i, m in enumerate(live):
        m.index = i
    if live:
        with contextlib.ExitStack() as locks:
            for m in live if pi == 0 else ():
                locks.enter_context(StoreLock(m.run_dir))
            _train(cfg, job, live, members, t_start, compiled)
    return [m.result for m in members]


def _train(
    cfg: RunConfig,
    job: JobInfo,
    members: list[Member],
    everyone: list[Member],
    t_start: float,
    compiled: compile_cache.CompileTimes,
) -> None:
    """Train the live `members` (`everyone`: all of the job's, for its members.json); `compiled`:
    the process's compile counts when the job started."""
    t = cfg.trainer
    program = program_for(cfg, [m.cfg for m in members])
    run, target = program.run, program.run.abstract_state()
    for m in members:
        m.point = resume_point(m.cfg, m.run_dir, target)
    restore_common_step(members, target)
    flops_per_step = train_flops_per_example(run.model_cfg) * t.batch_size
    peak, peak_source = device_peak_flops(cache_dir=cfg.data.cache_dir)  # of one device; the step runs on every device

    def record() -> None:  # a members job's members.json, rewritten at each change
        if cfg.seeds is not None:
            write_members_file(job.job_dir, everyone, cfg.members.impl)

    with ends_each_on_error(members, record):
        for m in members:
            place = (
                None
                if cfg.seeds is None
                else {
                    "members": {
                        "seeds": cfg.seeds,
                        "index": cfg.seeds.index(m.seed),
                        "job_dir": str(job.job_dir),
                        "impl": cfg.members.impl,
                    }
                }
            )
            m.tracker = run_tracker(m, run, flops_per_step, (peak, peak_source), place)
            m.point = with_logged(m.point, m.run_dir)
            m.t_start = t_start - m.point.wall_time  # a run's wall time counts its earlier processes'
        record()
        _run(cfg, job, program, members, record, flops_per_step, (peak * program.devices, peak_source), compiled)


@contextlib.contextmanager
def ends_each_on_error(members: list[Member], record):
    """Each member still running (its tracker made) ends as a run ends on an error
    (track/base.py ends_on_error), and the job's record says so."""
    try:
        yield
    except BaseException as e:
        for m in members:
            if m.status == "running" and m.tracker is not None:
                m.status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
                with contextlib.suppress(BaseException), ends_on_error(m.tracker):
                    raise e
        with contextlib.suppress(Exception):  # best effort (a bucket that fails fails here too): `e` says why
            record()
        raise


def _run(
    cfg: RunConfig,
    job: JobInfo,
    program,
    members: list[Member],
    record,
    flops_per_step: float,
    peak_all: tuple[float, str],
    compiled: compile_cache.CompileTimes,
):
    """The members' steps, from their common start to the end, then how each ends."""
    t, pi = cfg.trainer, jax.process_index()
    start = members[0].point.step
    state = program.init([m.point for m in members])
    for m in members:
        # Every process saves (each writes its own shards; orbax's primary process writes the metadata).
        m.ckpt = checkpoint.Checkpointer(
            m.run_dir / "checkpoints", t.keep_checkpoints, on_saved=m.tracker.log_checkpoint
        )
        m.log = RunLog(m.tracker, t.batch_size, program.run.tokens_per_step)
        m.log.first_loss, m.log.last_loss = m.point.first_loss, m.point.last_loss
        m.seen.eval_loss = m.point.eval_loss

    def end(m: Member, status: str, final_step: int) -> None:
        summary = run_summary(m, program.run.dataset.info, final_step)
        m.tracker.log_summary(summary)
        # the job's compiling against loading from the cache (a members job's, shared by its members)
        m.tracker.log_meta({"compilation": compile_cache.TIMES.since(compiled)})
        m.ckpt.close()  # a save that failed raises here: the member is still running, and fails (ends_each_on_error)
        m.tracker.finish(status)
        m.status = status
        if pi == 0:
            said = interrupts.word() if status == "interrupted" else status  # "terminated (SIGTERM)" after a SIGTERM
            print(closing_lines(said, summary, t.steps, m.seen.last_eval, m.run_dir), flush=True)
        m.result = Result(
            eval_loss=m.seen.eval_loss,
            train_loss=m.log.last_loss,
            steps=final_step,
            run_dir=m.run_dir,
            status=status,
            summary=summary,
            reason=m.log.reason,
            saved=status == "interrupted" and final_step > m.point.step,
        )
        record()

    hooks = periodic_hooks(cfg, program, members, job.hooks)
    job.hooks.add_hooks(hooks)
    bar = tqdm(total=t.steps, initial=start, disable=not t.progress or pi != 0, unit="step", dynamic_ncols=True)
    log = StepLogger(
        members,
        program.member,
        lambda m, step: end(m, "diverged", step),
        bar,
        t,
        flops_per_step,
        program.run.tokens_per_step,
        peak_all,
    )
    left = undone_at_resume(members, hooks)
    if pi == 0:
        for m in members:
            job.hooks.started(m.run_dir, jax.process_count())
    status, state, reason = run_steps(state, range(start + 1, t.steps + 1), program, log, hooks, members, left)
    log.flush()  # the step in flight (a member that diverged in it is ended there)
    bar.close()
    finish(cfg, program, members, status, state, reason, end)


def run_steps(
    state, steps: range, program, log: StepLogger, hooks: Hooks, members: list[Member], left: tuple[str, ...] = ()
) -> tuple[str, object, str]:
    """The steps, with the hooks due after each: (status, the state after the last whole step,
    why it stopped early: pruned or interrupted). First the hooks `left` undone at the step before them (a resumed run's
    evaluations). Stops early when no member is left running (each diverged), when a hook says
    so (pruned), on Ctrl-C or SIGTERM in a run of one process (interrupted), and in a run of
    several processes on SIGTERM to any of them, every process after the same step (interrupted:
    distributed.preempted; a Ctrl-C there is raised, the other processes would not stop with it).
    The steps go to the device trainer.steps_per_dispatch at a time (`dispatches`)."""
    dispatched, batches, t = [], program.batches(steps.start - 1), members[0].cfg.trainer
    dispatch = dispatcher(program, t.steps_per_dispatch)
    agreed = False  # every process stops after this step (a run of several)
    try:
        if left:
            hooks.run(steps.start - 1, state, left)
            log.restart_clock()
        for first, last in dispatches(steps, t.steps_per_dispatch, hooks):
            for m in members:  # a checkpoint that failed in the background stops the run here
                if m.status == "running":
                    m.ckpt.check()
            check_locks()  # and a writer's lock in a bucket that could not be kept
            interrupts.check()  # Ctrl-C, SIGTERM (interrupts.py): taken here, between whole dispatches
            if distributed.preempted(first - 1):  # a SIGTERM to one of several processes: all stop here
                agreed = True
                interrupts.terminated()  # for the line, the summary and the exit code
                interrupts.check()  # the press terminated() recorded, taken
                raise KeyboardInterrupt
            got = [program.placement.global_batch(next(batches), t.batch_size) for _ in range(first, last + 1)]
            # The step donates `state`: a Ctrl-C between its return and the assignment would
            # leave `state` naming deleted buffers, so the two happen together.
            with interrupts.deferred():
                state, dispatched = dispatch(state, got, first)
            for step, metrics in dispatched:
                if not log.push(step, metrics):
                    return "diverged", state, ""  # NaN guard: stop, and never checkpoint a broken state
            due = hooks.due(last)
            if due:
                if not log.flush():  # every step before a hook's work is logged first
                    return "diverged", state, ""
                stop = hooks.run(last, state, due)
                log.restart_clock()  # hook time is not step time
                if stop:  # e.g. the sweep's pruner stopped this trial (job.py)
                    return "pruned", state, f"pruned at step {last} of {steps.stop - 1} ({stop})"
        return "finished", state, ""
    except KeyboardInterrupt as e:
        if jax.process_count() > 1 and not agreed:
            raise
        # The last state assigned: a whole dispatch, wherever the interrupt came. If it came between
        # the dispatch and its pushes, its metrics (assigned with it) are queued here.
        done = int(jax.device_get(state.step))
        log.interrupted(dispatched)
        stopped = interrupts.stage_of(e, "")  # what it stopped, if not a step (e.g. an evaluation)
        return (
            "interrupted",
            state,
            f"{interrupts.word()} at step {done} of {steps.stop - 1}" + (f", {stopped}" if stopped else ""),
        )


def dispatches(steps: range, per: int, hooks: Hooks):
    """(first, last) step of each dispatch: `per` steps, ending where `per` divides the step (so
    the dispatches keep one length from any start) and at every step a hook is due after."""
    first = steps.start
    while first < steps.stop:
        last = min(first + per - 1 - (first - 1) % per, steps.stop - 1)
        last = next((k for k in range(first, last) if hooks.due(k)), last)
        yield first, last
        first = last + 1


def dispatcher(program, per: int):
    """dispatch(state, batches, first step) -> (state, [(step, metrics)]): one batch, the program's
    step; several, the same step over each in one program (lax.scan), its metrics on a leading axis."""
    if per > 1 and jax.process_count() > 1:
        raise ConfigError(f"trainer.steps_per_dispatch={per} is for runs of one process; this run has several: use 1")
    scanned = jax.jit(lambda state, stacked: jax.lax.scan(program.step, state, stacked), donate_argnums=0)
    stack = jax.jit(lambda batches: jax.tree.map(lambda *xs: jax.numpy.stack(xs), *batches))

    def dispatch(state, batches: list, first: int):
        if len(batches) == 1:  # K = 1, and a dispatch cut to one step by a hook: the program's own step
            state, metrics = program.step(state, batches[0])
            return state, [(first, metrics)]
        state, metrics = scanned(state, stack(batches))
        return state, [(first + i, Chunk(metrics, i, len(batches))) for i in range(len(batches))]

    return dispatch


def finish(cfg: RunConfig, program, members: list[Member], status: str, state, reason: str, end) -> None:
    """How each member still running ends with the job's `status`: interrupted ones save their
    last step (resume=auto continues from there), finished ones draw their sample grid."""
    final_step = int(jax.device_get(state.step))
    running = [m for m in members if m.status == "running"]
    for m in running:
        m.log.reason = reason
        if status == "interrupted" and final_step > m.point.step:
            m.ckpt.save(final_step, program.saved(state, m.index))  # none if this step is saved
    if status == "finished" and running:
        sample_grids(cfg, program, running, state.params, final_step)
    failed = []
    for m in running:  # each ends even if one before it cannot (its last save failed); the first failure is raised
        try:
            end(m, status, final_step)
        except Exception as e:  # noqa: BLE001 - re-raised below, once the others have ended
            failed.append(e)
    if failed:
        raise failed[0]


def sample_grids(cfg: RunConfig, program, running: list[Member], params, step: int) -> None:
    """The end-of-run sample grid of each finished member, drawn for all of them at once, each
    with its own seed's grid key."""
    dataset = program.run.dataset
    inputs = grid_captions(dataset, cfg)
    if inputs is None:
        return
    captions, ids, mask = inputs
    codes = np.asarray(program.grid(params, ids, mask))
    for m in running:
        grid = image_grid(dataset.decode_images(program.member(codes, m.index)), captions, cfg.samples.per_caption)
        m.tracker.log_image("samples/grid", grid, step, caption=" | ".join(captions))
