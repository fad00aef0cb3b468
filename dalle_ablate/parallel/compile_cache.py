"""JAX's persistent compilation cache for every run (`compilation_cache.*`, docs/guides/runs.md,
"Compiled programs"): the programs a run compiles -- its step, validation, sampler -- are written
to disk, and the next run that compiles the same program loads it instead.

What "the same" means is JAX's own cache key, never one of ours: a hash of the lowered program
(so of the code and the config that shaped it), its compile options and device assignment, the
XLA flags, the backend and device kind, and the jax/jaxlib versions
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html). A change to any of them is a
new entry, so the cache cannot hand a run a program compiled for something else; nothing here
adds to the key or reads an entry itself. JAX writes entries from process 0 only (`_cache_write`:
"Only write cache entries from the first process"), so on several hosts the others only read.

What can go wrong costs a compile, never the run: a folder that cannot be written turns the cache
off for the run with one warning line (`configure`), and an entry JAX cannot read or write is one
warning line each (`_one_line`) -- JAX compiles the program instead. `CompileTimes` counts, per
run, how much of its start-up went to compiling against loading (meta.json's "compilation")."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from dalle_ablate.fileio import is_url

# JAX's monitoring events (jax/_src/dispatch.py, compiler.py): every program's compile-or-load, a
# load's time, and the tracing and lowering that the cache never saves.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
# JAX's own warnings about an entry (jax/_src/compiler.py _cache_read, _cache_write): each becomes one line.
ENTRY_WARNINGS = (
    "Error reading persistent compilation cache entry",
    "Error writing persistent compilation cache entry",
)


class _Process:
    """What this process has set up: the folder its cache was last pointed at (JAX initialises
    the cache at the first compile, once), and the event listener (registered once)."""

    configured = False
    folder: str | None = None
    listening = False


def configure(cfg) -> str | None:
    """Point JAX at `cfg.dir` (a `CompilationCacheConfig`) before this process compiles anything;
    None turns the cache off. Returns the folder used, or None. A folder that cannot be made or
    written is one warning line and no cache for this run."""
    if not _Process.listening:
        jax.monitoring.register_event_duration_secs_listener(TIMES._on_duration)
        _Process.listening = True
    _route_entry_warnings()
    folder = _usable(cfg.dir)
    if _Process.configured and folder != _Process.folder:
        # JAX initialises its cache at its first compile, once: a job of the same process (a
        # multirun, a sweep) that names another folder re-arms it (its INFO line is not the run's).
        logging.getLogger("jax._src.compilation_cache").setLevel(logging.WARNING)
        jax_cache.reset_cache()
    _Process.configured, _Process.folder = True, folder
    jax.config.update("jax_enable_compilation_cache", folder is not None)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(cfg.min_compile_time_s))
    # JAX's LRU cache: with a bound, it evicts and takes a file lock around each entry's read and
    # write (jax/_src/lru_cache.py); without one (-1), neither.
    jax.config.update("jax_compilation_cache_max_size", -1 if cfg.max_size_gb is None else int(cfg.max_size_gb * 2**30))
    return folder


def _usable(folder: str | None) -> str | None:
    """The cache folder, made if need be, or None (off, or not writable: one warning line)."""
    if folder is None:
        return None
    if is_url(folder):
        _warn(
            f"compilation_cache.dir={folder}: a bucket is not a compilation cache here (compiled programs are per "
            "machine); compiling without it -- give a local folder, or null to say so"
        )
        return None
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        _warn(
            f"compilation_cache.dir={folder} cannot be written ({type(e).__name__}: {e.strerror or e}); this run "
            "compiles every program -- fix the folder, set another, or compilation_cache.dir=null"
        )
        return None
    return str(path)


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _route_entry_warnings() -> None:
    """JAX's warnings about one cache entry, as one line each instead of Python's two (the file,
    the line of source): the run goes on, and JAX compiles the program the entry would have held."""
    shown = warnings.showwarning
    if getattr(shown, "entry_warnings_routed", False):  # set again by each configure: a catch_warnings may undo it
        return

    def one_line(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith(ENTRY_WARNINGS):
            _warn(f"{text}; compiled it instead (the cache folder: compilation_cache.dir)")
        else:
            shown(message, category, filename, lineno, file, line)

    one_line.entry_warnings_routed = True
    warnings.showwarning = one_line


@dataclass
class CompileTimes:
    """Programs compiled and loaded in this process, and the seconds each took, from JAX's
    monitoring events. `since(earlier)` is one run's share of a process that runs several (a
    multirun, a sweep)."""

    programs: int = 0  # compiled or loaded
    loaded: int = 0  # of them, from the cache
    compile_s: float = 0.0  # XLA compiling those not in the cache
    load_s: float = 0.0  # reading those in it
    trace_s: float = 0.0  # tracing and lowering every program: the cache saves none of it
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def since(self, earlier: "CompileTimes") -> dict:
        """What happened after `earlier` (a `snapshot()`), as meta.json records it."""
        with self.lock:
            return {
                "cache_dir": _Process.folder,
                "compiled": (self.programs - self.loaded) - (earlier.programs - earlier.loaded),
                "compile_s": round(self.compile_s - earlier.compile_s, 3),
                "loaded": self.loaded - earlier.loaded,
                "load_s": round(self.load_s - earlier.load_s, 3),
                "trace_s": round(self.trace_s - earlier.trace_s, 3),
            }

    def snapshot(self) -> "CompileTimes":
        with self.lock:
            return CompileTimes(self.programs, self.loaded, self.compile_s, self.load_s, self.trace_s)

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        with self.lock:
            if event == COMPILE_EVENT:  # a compile or a load, timed whole: the load is taken out below
                self.programs += 1
                self.compile_s += seconds
            elif event == LOAD_EVENT:
                self.loaded += 1
                self.load_s += seconds
                self.compile_s -= seconds
            elif event in TRACE_EVENTS:
                self.trace_s += seconds


TIMES = CompileTimes()  # this process's, counted from its first `configure`


def cache_entries(folder: str | os.PathLike) -> list[Path]:
    """The entries JAX wrote in a cache folder (its `-cache` files), for tests and benchmarks."""
    return sorted(Path(folder).glob("*-cache"))
