"""The local run store, `<job dir>/run/`: what reports and tests read.

    config.yaml    the fully resolved config, nested
    meta.json      overrides, git commit, library versions, devices, parameter count, FLOPs
    metrics.jsonl  one JSON object per log call: {"step": s, <metric>: value, ...}
    summary.json   final values; status running until the run ends (finished, diverged, pruned,
                   failed or interrupted, with a reason unless finished)
    media/         images (PNG), named <key>_<step>.png
    tables/        tables, <key>_<step>.json ({"columns", "rows"}; image cells are PNG paths)
    checkpoints/   orbax checkpoints (written by the trainer)

A store under a staged folder (fileio: a run at `hydra.run.dir=gs://...`) is uploaded as it is
written, each file whole in one PUT: the JSON files and images as they are written, metrics.jsonl
(appended locally) with every summary write and before each checkpoint's save starts
(train/checkpoint.py), so a complete checkpoint in the bucket never has fewer rows than its step.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml
from PIL import Image

from dalle_ablate.fileio import LOCK, BucketLock, atomic_write, fetch, push, retry_bucket, shown, staged, url_of
from dalle_ablate.registry import RunFailed, first_line
from dalle_ablate.track.base import Tracker


# Seconds between two writes of summary.json while a run logs: a store made unwritable mid-run
# (a read-only or full disk, a folder's permissions taken away) is found within them, at a write,
# not minutes later at the next checkpoint -- appending to metrics.jsonl, a file already open,
# still succeeds in a folder that no longer takes new files.
SUMMARY_EVERY = 5.0


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # "nan" / "inf": JSON has no such numbers
    return v


def unwritable(root: Path, e: OSError, again: str = "resume=auto") -> RunFailed:
    """The one line for a run store that cannot be written (a full disk, a read-only folder);
    `again`: what continues once it is fixed."""
    what = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}" if e.errno else str(e)
    where = (
        f" ({re.sub(r'[.][0-9]+[.]tmp$', '', Path(e.filename).name)})" if e.filename else ""
    )  # atomic_write's temporary name
    return RunFailed(
        f"run store {shown(root)} cannot be written{where}: {what}; free space or fix the folder, then {again}"
    )


def _writes(method):
    """A RunStore method that writes: an OSError from it is the one-line RunFailed above."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            raise unwritable(self.root, e, getattr(self, "again", "resume=auto")) from e

    return wrapped


class RunStore(Tracker):
    @_writes
    def __init__(self, root: Path, config: dict, meta: dict, resume_step: Optional[int] = None):
        self.root = Path(root)
        # an evaluation's store (dalle-ablate eval) is written again by the same command, not by a resume
        self.again = "run the same dalle-ablate eval again" if "evaluated_step" in meta else "resume=auto"
        retry_bucket(self.root)  # a bucket an earlier run of this process could not reach: try it again
        self.media = self.root / "media"
        self.media.mkdir(parents=True, exist_ok=True)
        atomic_write(self.root / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        self.meta = dict(meta)
        old_meta = self.root / "meta.json"
        if resume_step is not None and old_meta.exists():
            # The W&B run this store logs to outlives the process: a resume continues it.
            old = json.loads(old_meta.read_text())
            for key in ("wandb_id", "wandb_dir"):
                if key in old:
                    self.meta.setdefault(key, old[key])
        self.write_meta()
        self.resume_step = resume_step
        metrics = self.root / "metrics.jsonl"
        self.resumed_rows: list[dict] = []  # the rows kept from the interrupted run (steps <= resume_step)
        if resume_step is not None and metrics.exists():
            # Resuming from a checkpoint at resume_step: lines logged after it (by the run that
            # was interrupted) are dropped so that every step appears once.
            self.resumed_rows = [r for r in _rows(metrics) if r["step"] <= resume_step]
            atomic_write(metrics, "".join(json.dumps(r) + "\n" for r in self.resumed_rows))
        elif metrics.exists():
            metrics.unlink()
        self._metrics = open(metrics, "a")
        summary = self.root / "summary.json"
        self.summary: dict[str, Any] = (
            json.loads(summary.read_text()) if resume_step is not None and summary.exists() else {}
        )
        self.summary.pop("reason", None)
        self.log_summary({"status": "running"})  # until finish(); a killed run keeps saying so

    @_writes
    def write_meta(self) -> None:
        atomic_write(self.root / "meta.json", json.dumps(self.meta, indent=2, default=str))

    def log_meta(self, values):
        self.meta.update(values)
        self.write_meta()

    @_writes
    def log(self, metrics, step):
        row = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if time.monotonic() - self._summary_written > SUMMARY_EVERY:
            self.log_summary({})

    @_writes
    def log_image(self, key, image, step, caption=""):
        path = self.media / f"{key.replace('/', '_')}_{int(step)}.png"
        Image.fromarray(np.asarray(image, np.uint8)).save(path)
        push(path)
        self.log({f"{key}/path": str(path.relative_to(self.root)), f"{key}/caption": caption}, step)

    @_writes
    def log_table(self, key, columns, rows, step, line=None):
        name = f"{key.replace('/', '_')}_{int(step)}"
        tables = self.root / "tables"
        tables.mkdir(exist_ok=True)
        out = []
        for i, row in enumerate(rows):
            cells = []
            for j, v in enumerate(row):
                if isinstance(v, np.ndarray) and v.ndim == 3:
                    path = tables / name / f"{i}_{j}.png"
                    path.parent.mkdir(exist_ok=True)
                    Image.fromarray(np.asarray(v, np.uint8)).save(path)
                    push(path)
                    v = str(path.relative_to(self.root))
                cells.append(_jsonable(v))
            out.append(cells)
        atomic_write(tables / f"{name}.json", json.dumps({"columns": list(columns), "rows": out, "line": line}))
        self.log({f"{key}/table": f"tables/{name}.json"}, step)

    @_writes
    def log_summary(self, values):
        self.summary.update({k: _jsonable(v) for k, v in values.items()})
        if self.summary.get("status") in (None, "running"):
            check_locks()  # a writer that lost its lock writes no more (its end is written, saying why)
        unsent = None
        if not self._metrics.closed:
            try:
                push(self._metrics.name)  # the rows up to now, before the summary that may name their step
            except RunFailed as e:  # the bucket fails: a summary that ends the run is written all the same
                if self.summary.get("status") in (None, "running"):
                    raise
                unsent = e
        try:
            atomic_write(self.root / "summary.json", json.dumps(self.summary, indent=2))
        finally:
            self._summary_written = time.monotonic()
            if unsent is not None:
                raise unsent

    @_writes
    def finish(self, status="finished"):
        if not self._metrics.closed:
            self.log_summary({"status": status})
            self._metrics.close()
            push(self._metrics.name)


_LOST: dict[str, RunFailed] = {}  # the locks this process could not keep: why, by store
_LOST_MUTEX = threading.Lock()


def check_locks() -> None:
    """Raise the RunFailed of a writer's lock this process lost (its lease not renewed in time, or
    taken over): the writer stops here -- between train steps, at a summary write."""
    with _LOST_MUTEX:
        lost = next(iter(_LOST.values()), None)
    if lost is not None:
        raise lost


class StoreLock:
    """One writer per run store: an exclusive `flock` on `<run store>/.writer.lock`, held while
    the run writes. The kernel drops it with its process (however it ends, kill -9 included), so
    a stale lock never blocks a resume. The file names the holder, for the refusal's line. A store
    staged from a bucket is also locked there (fileio.BucketLock: an object created only if absent,
    its lease renewed by a thread of this process while it writes)."""

    def __init__(self, root: Path, what: str = "run store"):
        import fcntl
        import socket

        self.root = Path(root)
        path = self.root / LOCK
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a+")
        except OSError as e:
            raise unwritable(self.root, e) from e
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "a process that has not said who it is yet"
            self._file.close()
            raise RunFailed(
                f"{what} {shown(self.root)} is being written by another process ({holder}); wait for it to end or "
                f"stop it, then run again (one writer per run store)"
            ) from None
        holder = f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(map(_as_given, sys.argv))}"
        if len(holder) > 500:  # its head (who) and its tail (the folders, last on a command line), within 500
            holder = f"{holder[:240]} ... {holder[-240:]}"
        self._file.seek(0)
        self._file.truncate()
        self._file.write(holder)
        self._file.flush()
        self.bucket, self._stop = None, threading.Event()
        if url_of(self.root) is not None:
            try:
                self.bucket = BucketLock(url_of(self.root), holder, what=what)
            except BaseException:
                self._file.close()
                raise
            threading.Thread(target=self._renew, name="store-lock-lease", daemon=True).start()

    def _renew(self) -> None:
        """The lease, renewed every quarter of it for as long as the writer lives; a renewal that
        fails is tried again, sooner each time at first (1 s, doubling), for as long as the lease
        leaves a quarter of itself. A lock that cannot be kept -- taken over, or not renewed by then
        -- is lost: the writer stops at its next check (`check_locks`), before another host may
        take the lock over."""
        lease = self.bucket.lease_s
        expires, wait, backoff = time.time() + lease, lease / 4, 1.0
        while not self._stop.wait(wait):
            try:
                self.bucket.renew()
                expires, wait, backoff = time.time() + lease, lease / 4, 1.0
            except RunFailed as e:  # taken over: another writer has it now
                self._lose(str(e))
                return
            except Exception as e:  # noqa: BLE001 - the client's errors (connection, 5xx, 403): tried again
                left = expires - time.time() - lease / 4
                if left <= 0:
                    self._lose(
                        f"{self.bucket.what} {self.bucket.url}: its lock's lease could not be renewed ({first_line(e)}); "
                        f"this writer stopped {lease / 4:.0f} s before the lease runs out, before another process may "
                        "take it over; resume=auto once the bucket answers"
                    )
                    return
                wait, backoff = min(backoff, left), backoff * 2

    def _lose(self, why: str) -> None:
        with _LOST_MUTEX:
            _LOST.setdefault(str(self.root), RunFailed(why))

    def release(self) -> None:
        self._stop.set()
        with _LOST_MUTEX:
            _LOST.pop(str(self.root), None)
        try:
            if self.bucket is not None:
                self.bucket.release()
        finally:
            if not self._file.closed:
                self._file.close()  # closing the file drops the lock

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Released; a bucket lock that cannot be (the bucket unreachable or read-only) is left to
        its lease, and never masks the error the block ends with -- that one says what went wrong.
        After a block that ended well, a warning says so."""
        try:
            self.release()
        except Exception as e:  # noqa: BLE001 - any error of the client: the lease ends the lock anyway
            if exc is None and self.bucket is not None:
                print(
                    f"warning: {self.bucket.what} {self.bucket.url}: its lock could not be released "
                    f"({first_line(e)}); it lapses with its lease ({self.bucket.lease_s:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )


def _as_given(arg: str) -> str:
    """A command-line argument as the user gave it: `hydra.run.dir=gs://...`, not the staging
    folder job.py put in its place."""
    key, eq, value = arg.partition("=")
    return f"{key}={url_of(value)}" if eq and value.startswith("/") and url_of(value) else arg


def _rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl that a resume continues: a last line cut off mid-write (the
    process was killed while writing it) is dropped, saying so; a bad line before it is an error
    naming the file and the line."""
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a row with a step")
        except ValueError as e:
            if i == len(lines) and not text.endswith("\n"):
                print(
                    f"{path}: its last line (line {i}) was cut off mid-write; dropped it and resuming",
                    file=sys.stderr,
                    flush=True,
                )
                break
            raise RunFailed(
                f"{path}: line {i} is not a metrics row ({e}); remove that line (or the run folder) and resume again"
            ) from e
        rows.append(row)
    return rows


def mark_failed(run_dir: str | Path, reason: str) -> None:
    """Record in a run store that its process died (found by a sweep's heartbeat check); in a
    bucket, on the bucket's summary (written back whole)."""
    url = url_of(run_dir)
    path = (staged(url) if url else Path(run_dir)) / "summary.json"
    if url is not None:
        fetch(f"{url}/summary.json", path)
    summary = json.loads(path.read_text()) if path.exists() else {}
    if summary.get("status") in (None, "running"):
        summary.update(status="failed", reason=reason)
        atomic_write(path, json.dumps(summary, indent=2))


def settled(summary: dict, steps: Optional[int]) -> bool:
    """Whether the run store with this summary.json ended for good: it finished all `steps` (None:
    whatever its budget was), or it diverged -- retrained from its last checkpoint it would diverge
    at the same step again. `resume=auto` leaves such a run as it is, and a study or its stress plan
    run again does not start it; the one definition for the trainer, the study runner and the page."""
    status = summary.get("status")
    if status == "diverged":
        return True
    return status == "finished" and (steps is None or int(summary.get("steps", -1)) >= steps)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run store's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]
