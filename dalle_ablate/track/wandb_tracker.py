"""tracker=wandb: the Weights & Biases backend, its config and its builder. Offline by default
(never touches the network); online when `tracker.wandb.mode=online` and logged in, checked
within 25 s before the run starts (or offline instead with `tracker.wandb.fallback=offline`). A
resumed run continues the same W&B run. Conventions (docs/architecture.md): group = the sweep or
multirun folder, name = the overrides it varies, job_type = the variant (track/naming.py), each
settable (`tracker.wandb.group` ...); finish() on every exit path.
`wandb` takes 0.6 s to import, so only a run that logs to it imports it."""

from __future__ import annotations

import logging
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import numpy as np

from dalle_ablate.registry import RunFailed, check, first_line
from dalle_ablate.metrics import of_logged
from dalle_ablate.track.base import TRACKERS, Tracker, TrackerConfig
from dalle_ablate.track.runstore import RunStore

log = logging.getLogger(__name__)

# Charts: every series over `tokens` (an x-axis comparable across batch sizes and sequence
# lengths, where steps are not); the summary keeps the best of the loss and the headline eval
# metrics (by how their names end, docs/architecture.md "Metric names") besides the last; constant
# counts (sample sizes, the real-data floor) are hidden from the charts and stay in the tables.
X_AXIS = "tokens"
ON_X_AXIS = ("train/*", "eval/*", "perf/*", "optim/*")
COUNT = re.compile(r"(/n|_n|/floor)$")


def best_of(key: str) -> str | None:
    """The summary's aggregation for a logged key: a headline metric's best (dalle_ablate/metrics.py:
    the losses' min, caption sensitivity's max, a sampled one's at any guidance scale), else none."""
    m = of_logged(key)
    return None if m is None or not m.headline or not m.better else ("min" if m.better == "lower" else "max")


def _number(v) -> float | int | None:
    """A metrics.jsonl value as W&B takes it: numbers (non-finite ones are stored as strings);
    None for the rest (media and table paths)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return None


def last_step_written(run_dirs: list, run_id: str) -> int:
    """The last history step in the local run files of W&B run `run_id` (every process's, beside
    each of `run_dirs`: files folders of its processes); 0 if none. A file a killed process left
    is read up to its last whole record. The format: a 7-byte header, then 32 KiB blocks of chunks
    `crc32 (4) | length (2) | type (1) | data` (types 1 whole, 2/3/4 first/middle/last piece of a
    record), each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    last = 0
    roots = {Path(d).absolute().parent.parent for d in run_dirs if d}
    for path in sorted({p for root in roots for p in root.glob(f"*-{run_id}/run-{run_id}.wandb")}):
        data, pos, pending = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if pos + 7 + length > len(data):
                break  # cut off by a kill
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind == 0:
                continue
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                try:
                    record.ParseFromString(pending)
                except Exception:  # noqa: BLE001 - a torn record ends what can be read
                    break
                if record.WhichOneof("record_type") == "history" and record.history.HasField("step"):
                    last = max(last, int(record.history.step.num))
    return last


CONNECT_TIMEOUT = 10  # seconds for the server to accept a connection
VERIFY_TIMEOUT = 15  # seconds for it to answer who the API key belongs to


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "dalle-ablate"  # the W&B project
    entity: Optional[str] = None  # the W&B team or user; null = the logged-in default
    tags: list[str] = field(default_factory=list)  # tags of the W&B run
    fallback: Optional[str] = None  # offline = log offline when online cannot connect or authenticate; null = fail
    # null = the run's own: group = the multirun folder, name = the overrides it varies (seed
    # included), job_type = the same less the seed (the layout when nothing varies)
    group: Optional[str] = None
    name: Optional[str] = None  # the W&B run's name; null = the overrides the multirun varies
    job_type: Optional[str] = None  # null = the variant: the name less the seed
    notes: Optional[str] = None  # the W&B run's notes
    log_checkpoints: bool = False  # each complete checkpoint as a `model` artifact (aliases step-<n>, latest)
    # W&B's own terminal output. false: the run's banner and closing block off (W&B's `silent`
    # setting) and W&B's other info lines too (`show_info`), its warnings and errors still shown;
    # one line of the run's says where the W&B run is. true: all of it (then W&B's own WANDB_QUIET
    # and WANDB_SILENT apply)
    banner: bool = False


@dataclass
class WandbTrackerConfig(TrackerConfig):
    backend: str = "wandb"
    wandb: WandbConfig = field(default_factory=WandbConfig)  # the W&B run: mode, naming, what it keeps

    def validate(self, run) -> None:
        mode, fallback = self.wandb.mode, self.wandb.fallback
        check(
            mode in ("offline", "online", "disabled"),
            f"tracker.wandb.mode={mode!r} is not valid; valid: disabled, offline, online",
        )
        check(fallback in (None, "offline"), f"tracker.wandb.fallback={fallback!r} is not valid; valid: offline, null")


@TRACKERS.option("wandb", WandbTrackerConfig)
def wandb_tracker(cfg: WandbTrackerConfig, store: RunStore, config: dict, meta: dict, **naming) -> list[Tracker]:
    return [] if cfg.wandb.mode == "disabled" else [WandbTracker(cfg.wandb, store, config, meta, **naming)]


def online_problem() -> str | None:
    """Why an online run could not start, found within CONNECT_TIMEOUT + VERIFY_TIMEOUT seconds
    (wandb.init alone retries for minutes): no API key, no route to the server, a refused key."""
    import wandb

    try:
        wandb.login(verify=False)  # reads WANDB_API_KEY or ~/.netrc; never prompts without a tty
    except wandb.errors.UsageError:
        return "no W&B API key (run `wandb login` or set WANDB_API_KEY)"
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        return f"cannot reach {url} ({e.strerror or e})"
    try:
        wandb.Api(timeout=VERIFY_TIMEOUT).viewer  # noqa: B018 - the request is the check
    except wandb.errors.CommError as e:
        return f"{url} did not accept the API key ({first_line(e)})"
    return None


def where(run, mode: str) -> str:
    """The one line a run prints about its W&B run while W&B itself is silent: where it is, and
    how an offline one gets uploaded."""
    if mode == "online":
        return f"W&B run: {run.url}"
    return f"W&B run (offline): {run.settings.sync_dir}; upload it with wandb sync"


def _mode(cfg, store: RunStore) -> str:
    """tracker.wandb.mode, but offline where online cannot work and tracker.wandb.fallback=offline
    allows it (the reason put in the store's meta, which the tracker writes once W&B has started);
    without that fallback, the reason in one line."""
    if cfg.mode != "online":
        return cfg.mode
    problem = online_problem()
    if problem and cfg.fallback != "offline":
        raise RunFailed(
            f"tracker.wandb.mode=online: {problem}; run offline with tracker.wandb.mode=offline "
            f"(`wandb sync` uploads it later) or set tracker.wandb.fallback=offline"
        )
    if problem:
        log.warning(f"W&B online: {problem}; logging offline instead (tracker.wandb.fallback=offline)")
        store.meta["wandb_fallback"] = problem
        return "offline"
    return "online"


class WandbTracker(Tracker):
    def __init__(self, cfg, store: RunStore, config: dict, meta: dict, *, name, group, job_type):
        import wandb

        self._wandb, self.cfg = wandb, cfg
        if not cfg.banner:  # its info lines (an artifact's files, ...) off for the process; warnings and errors show
            wandb.setup(settings=wandb.Settings(show_info=False))
        run_id = store.meta.get("wandb_id")  # set by an earlier run in this store: resume it
        mode = _mode(cfg, store)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=mode,
            name=cfg.name or name,
            group=cfg.group or group,
            job_type=cfg.job_type or job_type,
            notes=cfg.notes,
            tags=list(cfg.tags),
            config={**config, "meta": meta},
            dir=None if os.environ.get("WANDB_DIR") else str(store.root),
            id=run_id,
            resume="allow" if run_id else None,
            # A multirun's jobs never share a run; the members of one job (train/loop.py) are
            # live runs side by side, each finished by its own member.
            reinit="create_new" if meta.get("members") else "finish_previous",
            settings=wandb.Settings(init_timeout=30, **({} if cfg.banner else {"silent": True})),
        )
        if not cfg.banner:
            print(where(self.run, mode), flush=True)
        self.first_new_step = self._first_new_step(store, run_id, mode)
        store.meta["wandb_id"] = self.run.id
        # tracker.wandb.group if set: `dalle-ablate eval` files its jobs there
        store.meta["wandb_group"] = self.run.group
        store.meta["wandb_dir"] = self.run.dir
        store.write_meta()
        self._done = False
        self.run.define_metric(X_AXIS)
        self.run.define_metric("samples", step_metric=X_AXIS)
        for pattern in ON_X_AXIS:
            self.run.define_metric(pattern, step_metric=X_AXIS)
        self._declared: set[str] = set()
        self._best: set[str] = set()  # keys whose summary W&B aggregates (log_summary leaves them)
        for row in (r for r in store.resumed_rows if r["step"] >= self.first_new_step):
            values = {k: _number(v) for k, v in row.items() if k != "step" and _number(v) is not None}
            self._declare(values)
            self.run.log(values, step=int(row["step"]))

    def _first_new_step(self, store: RunStore, run_id: Optional[str], mode: str) -> int:
        """The first step this process sends: 0 for a new run (a cached tokenizer's metrics). A
        resumed W&B run continues after the last step the earlier processes sent (online: the
        step its server holds; offline: the last step in their run files). Steps up to it are
        not sent again (the resumed run recomputes them exactly); the steps after it up to the
        checkpoint (logged by a killed process, not yet flushed to W&B) are sent now from the
        run store's metrics.jsonl: the W&B history holds each step once."""
        if not run_id:
            return 0
        if mode == "online":
            return self.run.step
        return last_step_written([store.meta.get("wandb_dir"), self.run.dir], run_id) + 1

    def _declare(self, keys) -> None:
        """define_metric for keys seen for the first time: counts hidden, headlines with their best."""
        for key in set(keys) - self._declared:
            self._declared.add(key)
            step = X_AXIS if key.startswith(tuple(p[:-1] for p in ON_X_AXIS)) else None
            if COUNT.search(key):
                self.run.define_metric(key, step_metric=step, hidden=True)
                continue
            best = best_of(key)
            if best:
                self.run.define_metric(key, step_metric=step, summary=f"{best},last")
                self._best.add(key)

    def _logged(self, step) -> bool:
        return step < self.first_new_step

    def log(self, metrics, step):
        if not self._logged(step):
            self._declare(metrics)
            self.run.log(dict(metrics), step=int(step))

    def log_image(self, key, image, step, caption=""):
        if not self._logged(step):
            self.run.log({key: self._wandb.Image(np.asarray(image, np.uint8), caption=caption)}, step=int(step))

    def log_table(self, key, columns, rows, step, line=None):
        if self._logged(step):
            return
        wandb = self._wandb
        cell = lambda v: wandb.Image(np.asarray(v, np.uint8)) if isinstance(v, np.ndarray) and v.ndim == 3 else v  # noqa: E731
        table = wandb.Table(columns=list(columns), data=[[cell(v) for v in r] for r in rows])
        logged = {key: table}
        if line is not None:
            logged[f"{key}_chart"] = wandb.plot.line(table, line[0], line[1], title=f"{key}: {line[1]} vs {line[0]}")
        self.run.log(logged, step=int(step))

    def log_checkpoint(self, step, path):
        if self.cfg.log_checkpoints and not self._logged(step):
            artifact = self._wandb.Artifact(f"checkpoint-{self.run.id}", type="model", metadata={"step": int(step)})
            if "://" in str(
                path
            ):  # in a bucket: W&B records its objects by reference (not a copy: rotated out, it is gone)
                artifact.add_reference(str(path))
            else:
                artifact.add_dir(str(path))  # staged (copied) now: the checkpoint may be rotated out later
            self.run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def log_summary(self, values):
        for k, v in values.items():
            if k not in self._best:  # W&B keeps their best and last; the run store's summary.json has the final value
                self.run.summary[k] = v

    def finish(self, status="finished"):
        if not self._done:
            self._done = True
            self.run.summary["status"] = status
            # A trial the sweep's pruner stopped ended as asked: not a crashed run.
            self.run.finish(exit_code=0 if status in ("finished", "pruned") else 1)
