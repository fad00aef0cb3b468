"""Orbax checkpoints of the train state under `<run store>/checkpoints/<step>/`.

Orbax writes each step to a temporary folder and renames it when complete, so an interrupted
save never replaces or corrupts an earlier checkpoint. The data order and every random key are
functions of (seed, step), so the step is all a resume needs besides the state itself.

A run store staged from a bucket (fileio) has its checkpoints in the bucket itself: orbax and
TensorStore write `gs://.../run/checkpoints/<step>/` from every process, and, Cloud Storage having
no atomic rename, orbax marks a finished step by writing `commit_success.txt` into it last; a step
folder without it is an unfinished save, never restored. Before each save starts, the store's
metrics.jsonl is uploaded, so a finished checkpoint never has fewer logged rows than its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable, Optional

import jax
import orbax.checkpoint as ocp

from dalle_ablate import interrupts
from dalle_ablate.fileio import check_bucket, check_url, filesystem, is_url, push, staged, url_of
from dalle_ablate.registry import ConfigError, RunFailed, first_line

COMMITTED = "commit_success.txt"  # orbax's mark of a finished save in Cloud Storage (written into the step folder last)


def location(directory) -> str | Path:
    """Where orbax reads and writes a checkpoints folder: its bucket URL if it is staged from one."""
    return url_of(directory) or Path(directory).absolute()


def step_folder(directory, step: int):
    """A step's folder in a checkpoints folder (a URL string in a bucket)."""
    return f"{directory}/{step}" if isinstance(directory, str) else Path(directory) / str(step)


def finished_steps(directory) -> list[int]:
    """The steps saved in a checkpoints folder, ascending: its step-named folders (in a bucket,
    those orbax marked finished)."""
    url = url_of(directory)
    if url is None:
        d = Path(directory)
        return sorted(int(c.name) for c in d.iterdir() if c.is_dir() and c.name.isdigit()) if d.is_dir() else []
    fs = filesystem(url)
    fs.invalidate_cache()
    if not fs.isdir(url):
        return []
    names = [p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False)]
    return sorted(int(n) for n in names if n.isdigit() and fs.exists(f"{url}/{n}/{COMMITTED}"))


class Checkpointer:
    """Asynchronous saves that fail loudly: a save that could not be written (disk full, no
    permission) stops the run at the next step with one line naming the folder and the OS error;
    the checkpoints written before it stay, so `resume=auto` continues from the last of them."""

    def __init__(self, directory: Path, keep: int, on_saved: Optional[Callable[[int, Path], None]] = None):
        """`on_saved(step, folder)` is called once each save is complete on disk."""
        self.directory = location(directory)
        self.metrics = (
            Path(directory).parent / "metrics.jsonl" if url_of(directory) else None
        )  # its store's, in a bucket
        self.on_saved = on_saved
        if self.metrics is not None:
            check_bucket(str(self.directory))
        else:
            try:  # find an unwritable folder now, not at the first save
                self.directory.mkdir(parents=True, exist_ok=True)
                tempfile.TemporaryFile(dir=self.directory).close()
            except OSError as e:
                raise RunFailed(f"checkpoints cannot be written to {self.directory}: {e.strerror or e}") from e
        self.manager = ocp.CheckpointManager(
            self.directory,
            # cleanup_tmp_directories: a save that failed or was killed leaves `<step>.orbax-checkpoint-tmp`;
            # the resumed run removes it and writes that step again.
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True),
        )
        self.saving: Optional[int] = None  # step of the save that may still be in flight
        _quiet_abandoned_writes()
        _OPEN.add(self)

    def save(self, step: int, state) -> None:
        try:
            # orbax waits for the previous save before starting one: wait here, so that its
            # failure is reported as its own.
            self._wait()
            self.check()
            self._saved()
            if step in self.manager.all_steps():
                return  # e.g. a run interrupted just after its scheduled save of this step
            if self.metrics is not None and jax.process_index() == 0 and self.metrics.exists():
                push(
                    self.metrics
                )  # the rows up to this step (process 0 writes them), in the bucket before the checkpoint can be
            self.saving = step
            self.manager.save(step, args=ocp.args.StandardSave(state))
        except RunFailed:
            raise
        except Exception as e:  # noqa: BLE001 - orbax wraps the OS error in several types
            raise self._failed(e) from e

    def check(self) -> None:
        """Raise RunFailed if a save in the background has failed (cheap: no waiting). Called
        before every step: a save that failed stops the run at the next step, not at the next
        save (orbax hands the failure of a save that has ended to its manager's
        wait_until_finished, which returns at once then)."""
        if self.saving is None:
            return
        try:
            self.manager.check_for_errors()
            if not self.manager.is_saving_in_progress():
                self.manager.wait_until_finished()  # ended: returns at once, or raises its failure
                self._saved()
        except Exception as e:  # noqa: BLE001
            raise self._failed(e) from e

    def _wait(self) -> None:
        """Wait for the save in flight; after a SIGTERM only until its grace period's deadline
        (interrupts.stop_deadline): a bucket that cannot take the step in time is given up, so
        that the process still exits before SIGKILL, the earlier checkpoints intact."""
        end = interrupts.stop_deadline()
        while end is not None and self.manager.is_saving_in_progress():
            if time.monotonic() > end:
                raise TimeoutError(f"not written within the {interrupts.grace_s():.0f} s grace period of its SIGTERM")
            time.sleep(0.05)
        self.manager.wait_until_finished()

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def _saved(self) -> None:
        """Report the save in flight as complete (called after waiting for it without error)."""
        if self.saving is not None and self.on_saved is not None and self.saving in self.manager.all_steps():
            self.on_saved(self.saving, step_folder(self.directory, self.saving))
        self.saving = None

    def close(self) -> None:
        try:
            self._wait()
            self.check()
            self._saved()
        except RunFailed:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._failed(e) from e
        finally:
            self.manager.close()

    def _failed(self, e: BaseException) -> RunFailed:
        self._abandon()
        code = _os_error_code(e)
        cause = f"{errno.errorcode.get(code, code)}: {os.strerror(code)}" if code else first_line(e)
        done = [s for s in self.manager.all_steps() if s != self.saving]
        kept = (
            f"checkpoints {done} are intact, resume=auto continues from step {max(done)}"
            if done
            else "no earlier checkpoint"
        )
        return RunFailed(f"checkpoint of step {self.saving} could not be written to {self.directory} ({cause}); {kept}")

    def _abandon(self) -> None:
        """After a failed save: cancel the writes orbax still waits on. Its commit threads would
        otherwise each wait out orbax's 300 s timeout for a folder that was never made, and the
        interpreter waits for them before it exits (seen: 330 s after the one-line error)."""
        checkpointer = getattr(self.manager, "_checkpointer", None)
        try:
            if hasattr(checkpointer, "cancel"):
                checkpointer.cancel()  # the background save thread, if one was started
            # The failed save's commit threads, also those of a save that failed before orbax
            # handed them to its background thread (no earlier save is in flight: each save
            # waits for the one before it).
            # Each waits for signals (e.g. "the step's folder was made") that will never come:
            # cancelled, then given them, it returns without writing anything.
            from orbax.checkpoint._src.futures import future, signaling_client

            client = signaling_client.get_signaling_client()
            for t in threading.enumerate():
                if isinstance(t, future._SignalingThread):
                    t.cancel()
                    for signal in getattr(t, "_receive_signals", None) or []:
                        key = future.AwaitableSignalsContract.get_unique_awaitable_singal_key(signal, t._operation_id)
                        client.key_value_set(key, "abandoned", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - best effort: the failure itself is what gets reported
            pass
        # ... and their coroutines, never run, would each print "coroutine ... was never awaited" at exit
        warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


_OPEN: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def abandon_saves() -> None:
    """Give up every save still in flight: a SIGTERM's stop whose grace period ran out elsewhere
    (its bucket gone). Left waiting, orbax's threads would hold the exit for their 300 s timeout;
    the checkpoints finished before stay."""
    for c in list(_OPEN):
        with contextlib.suppress(Exception):  # best effort: the stop's line is what must come out
            if c.manager.is_saving_in_progress():
                c._abandon()


def _quiet_abandoned_writes() -> None:
    """After one write of a save fails, orbax closes that save's event loop; tensorstore then
    completes the save's other writes into the closed loop, and each completion prints a
    "RuntimeError: Event loop is closed" traceback (about a hundred for a small model) through
    sys.unraisablehook. They say nothing the one-line failure does not: drop just those."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_callbacks", False):
        return

    def hook(args):
        if not (args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed"):
            previous(args)

    hook.drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def _os_error_code(e: BaseException) -> Optional[int]:
    """The errno behind an exception from orbax or tensorstore, which report it in the text."""
    while e is not None:
        if isinstance(e, OSError) and e.errno:
            return e.errno
        found = re.search(r"os_error_code='(\d+)'|\[Errno (\d+)\]", str(e))
        if found:
            return int(found.group(1) or found.group(2))
        e = e.__cause__ or e.__context__
    return None


def set_aside(folder) -> None:
    """Rename a checkpoint that cannot be restored to `<step>.unrestorable` (kept for a look; no
    longer a step): the resumed run writes that step again. In a bucket its finished mark goes
    first (a rename there is a copy of each object), so a kill meanwhile leaves no step behind."""
    if url_of(folder) is None:
        Path(folder).rename(Path(folder).with_name(f"{Path(folder).name}.unrestorable"))
        return
    url = url_of(folder)
    fs = filesystem(url)
    fs.rm_file(f"{url}/{COMMITTED}")
    fs.mv(url, f"{url}.unrestorable", recursive=True)


def _closed_loop_callback(kind, value, tb) -> bool:
    """Whether an error is asyncio's "Event loop is closed" raised by a call into a loop that is gone."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (
        kind is RuntimeError
        and str(value) == "Event loop is closed"
        and tb is not None
        and tb.tb_frame.f_code.co_name == "_check_closed"
    )


def _stray_read(args) -> bool:
    """Whether an unraisable error (sys.unraisablehook's argument) is a stray read's of a failed
    restore: its callback into the closed loop, or orbax's read coroutine dropped with its error."""
    return (
        _closed_loop_callback(args.exc_type, args.exc_value, args.exc_traceback)
        or getattr(args.object, "__name__", None) == "_read_array_index_and_device_put"
    )


def _quiet_stray_reads() -> None:
    """After a restore that failed part-way: orbax closes its event loop on the first array that
    cannot be read, while TensorStore still reads the others on its own threads; each read that
    ends later calls back into the closed loop, and that RuntimeError (or the dropped read
    coroutine's own error) is printed as an unraisable error -- tracebacks under the one error
    line, more of them the busier the machine. Those, and only those, are dropped from then on
    (sys.unraisablehook, and sys.excepthook should TensorStore print through it); every other
    error reaches the hooks as before."""
    if getattr(sys.unraisablehook, "quiet_stray_reads", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def on_unraisable(args):
        if not _stray_read(args):
            unraisable(args)

    def on_uncaught(kind, value, tb):
        if not _closed_loop_callback(kind, value, tb):
            excepthook(kind, value, tb)

    on_unraisable.quiet_stray_reads = on_uncaught.quiet_stray_reads = True
    sys.unraisablehook, sys.excepthook = on_unraisable, on_uncaught


def _as_written(mngr, step: int, folder: Path, abstract):
    """(what to restore, restored -> the state) for the checkpoint of `step`: the state's fields as
    that checkpoint holds them. One written before a field existed lacks it: where this run leaves
    the field None it is restored without it; where this run needs it, the checkpoint is of
    dalle-ablate 0.1.0, which kept the gradient scaler's and PowerSGD's state inside `opt_state` by
    position (`opt_state.0.scale`), and is refused in one line rather than read as something else."""
    try:
        tree = getattr(mngr.item_metadata(step), "tree", None)
    except Exception:  # noqa: BLE001 - unreadable metadata: the restore names what is wrong with it
        tree = None
    if not (isinstance(tree, dict) and dataclasses.is_dataclass(abstract)):
        return abstract, lambda restored: restored
    fields = {f.name: getattr(abstract, f.name) for f in dataclasses.fields(abstract)}
    missing = [k for k, v in fields.items() if k not in tree and v is not None]
    if missing and isinstance(tree.get("opt_state"), (list, tuple)):
        raise RunFailed(
            f"checkpoint {folder} was written by dalle-ablate 0.1.0, whose train state kept the "
            f"{' and '.join(missing)} state inside opt_state by position; this release names them and cannot "
            f"restore it: resume it with 0.1.0, or remove the run folder to start over"
        )
    if all(k in tree for k in fields):
        return abstract, lambda restored: restored
    present = {k: v for k, v in fields.items() if k in tree or v is not None}
    return present, lambda restored: type(abstract)(**{**dict.fromkeys(fields), **restored})


def _root_cause(e: BaseException) -> str:
    """The first line of the innermost error behind `e` (tensorstore's names the file and what
    is wrong with it; orbax's wrapper names an array index)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def find_checkpoints(path: str, given: str = "resume=") -> tuple[Path, Optional[int]]:
    """A checkpoints folder and step from what a user may pass as `resume=` (or as `given`, e.g.
    "dalle-ablate eval "): a job dir, a run store, a checkpoints folder, or one step's folder
    inside it -- a local path or a gs:// URL (its staging folder is returned; orbax reads the
    bucket, `location`)."""
    if is_url(path) or url_of(path):  # a URL, or a staged folder: its checkpoints are in the bucket
        return _find_in_bucket(check_url(path, "resume", given) if is_url(path) else url_of(path), given)
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise ConfigError(f"{given}{path}: no such file or folder (give a run dir, its run/ or run/checkpoints/)")
    for cand in (p / "run" / "checkpoints", p / "checkpoints", p):
        if cand.is_dir() and any(c.is_dir() and c.name.isdigit() for c in cand.iterdir()):
            return cand, None
    if p.name.isdigit() and p.parent.is_dir():
        return p.parent, int(p.name)
    raise ConfigError(f"{given}{path}: no orbax checkpoint found there")


def _find_in_bucket(url: str, given: str) -> tuple[Path, Optional[int]]:
    for cand in (f"{url}/run/checkpoints", f"{url}/checkpoints", url):
        if finished_steps(cand):
            return staged(cand), None
    parent, _, name = url.rpartition("/")
    if name.isdigit() and int(name) in finished_steps(parent):
        return staged(parent), int(name)
    raise ConfigError(f"{given}{url}: no finished orbax checkpoint found there")


def restore(directory: Path, step: Optional[int], target, on_broken: Optional[Callable[[Path], None]] = None):
    """The state saved at `step`, shaped and sharded like `target`. With `step` None, the latest
    that can be restored: a newer one that cannot (truncated, corrupt) is named on stderr and the
    one before it tried, and `on_broken(folder)` hears of each that could not be restored once an
    earlier one was. A checkpoint that cannot be restored, and no earlier one, is one line."""
    directory = location(directory)
    # the handler named, so that item_metadata reads a step's tree before anything is restored
    mngr = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=ocp.StandardCheckpointHandler()
    )
    try:
        steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            raise ConfigError(f"{directory}: holds no finished checkpoint")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        broken = []
        for s in steps:
            item, as_state = _as_written(mngr, s, step_folder(directory, s), abstract)
            try:
                state = as_state(mngr.restore(s, args=ocp.args.StandardRestore(item)))
            except Exception as e:  # noqa: BLE001 - orbax and tensorstore report a bad file in several types
                _quiet_stray_reads()
                broken.append((s, _root_cause(e), e))
                if jax.process_count() > 1:  # each process reads its own shards: falling back alone, one
                    break  # could resume from another step than the others; stop, naming it, instead
                continue
            if broken:
                print(
                    f"warning: checkpoint {step_folder(directory, broken[0][0])} cannot be restored ({broken[0][1]}); "
                    f"resuming from step {s}, the newest intact one",
                    file=sys.stderr,
                    flush=True,
                )
                for b, _, _ in broken:
                    if on_broken is not None:
                        on_broken(step_folder(directory, b))
            return s, state
        newest, cause, error = broken[0]
        earlier = (
            "no earlier checkpoint"
            if len(steps) == 1
            else "a run of several processes does not fall back to an earlier one"
            if len(broken) < len(steps)
            else f"nor can any earlier one ({', '.join(str(b[0]) for b in broken[1:])})"
        )
        raise RunFailed(
            f"checkpoint {step_folder(directory, newest)} cannot be restored ({cause}); {earlier}: "
            f"remove the run folder to start over, or resume= another checkpoint"
        ) from error
    finally:
        mngr.close()
