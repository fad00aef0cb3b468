"""Ctrl-C, taken where the program can stop cleanly.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be: inside
a garbage-collection callback (jax's `_xla_gc_callback`), where Python prints "Exception ignored"
and drops it, so the run goes on; or half-way through jax's dispatch of a computation, which
leaves the runtime's state torn and can crash the interpreter on its way out (exit 139; the same
was seen by Keras, keras-team/keras#21019). The entry points (run.py, `python -m dalle_ablate.job`,
`dalle-ablate`) install `on_sigint` instead: a Ctrl-C is recorded, never lost, and raised as
KeyboardInterrupt by the next `check()` -- between train steps, evaluation batches, tokenizer
iterations, rendered scenes, jobs of a multirun, the runs of a study -- so it always lands in
plain Python code that knows how to stop. A second Ctrl-C before the first was taken raises at
once, wherever the program is (a way out of a stage that does not check, at the old risk).

SIGTERM -- what SLURM, Kubernetes and a preempted Cloud TPU or spot VM send before SIGKILL -- is
taken the same way (`install` handles both): recorded, raised as KeyboardInterrupt at the next
check, so a run saves its last whole step and says how to resume; `word()` and `exit_code()` then
say "terminated (SIGTERM)" and 143 instead of "interrupted" and 130. A scheduler may send SIGTERM
again while the run saves (SLURM at its time limit after `--signal=TERM@N`): a repeated SIGTERM is
never taken at once, only a second Ctrl-C is. On several processes (`jax.distributed`) JAX's
preemption service takes SIGTERM instead, and the trainer stops every process at the step they
agree on (train/loop.py, parallel/distributed.py `preempted`), calling `terminated()` here.

Without the handler (the library used from a notebook or a test), nothing changes: Python raises
KeyboardInterrupt itself and `check()` never raises.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Optional

_state = {
    "pressed": 0,
    "taken": 0,
    "holding": 0,
    "held": False,
    "terminated": False,
    "terminated_at": None,  # time.monotonic() of the first SIGTERM, when the main thread's handler took it
    "arrived_at": None,  # ... when the watchdog saw it arrive (its wakeup fd), until the handler takes it
    "watchdog": None,  # what a process that must exit inside the grace period says at its end (arm_watchdog)
    "said": False,  # its own last line is out
}
# Set by a process for the processes it starts (`dalle-ablate study`'s runs) when it prints the
# line a Ctrl-C ends them all with: the line that continues all of it, not each child's own.
PARENT_SAYS = "DALLE_ABLATE_PARENT_SAYS_INTERRUPTED"
AT_ONCE = "at once (Ctrl-C pressed twice)"  # what a second press stopped: wherever the program was
TERMINATED = "terminated (SIGTERM)"  # what a run stopped by SIGTERM says where a Ctrl-C's says "interrupted"


def on_sigint(signum, frame) -> None:
    """The SIGINT and SIGTERM handler: record the press; raise at once only on a second Ctrl-C
    that finds the first not yet taken (and not inside `deferred()`, which raises it when it
    ends). A SIGTERM is a press the first time only, never raised at once."""
    if signum == signal.SIGTERM:
        terminated()
        return
    _state["pressed"] += 1
    if _state["pressed"] - _state["taken"] > 1:
        if _state["holding"]:
            _state["held"] = True
        else:
            _state["taken"] = _state["pressed"]
            raise KeyboardInterrupt(AT_ONCE)


def terminated() -> None:
    """Record a SIGTERM: this process's own (the handler), or another process's of the same run,
    found at the step all of them agreed to stop at (train/loop.py). A pending press if none is
    pending and none was recorded before (a scheduler's repeated SIGTERM adds none)."""
    first = not _state["terminated"]
    _state["terminated"] = True
    if first:  # the time alone: a signal handler starts no thread and takes no lock (the watchdog polls it)
        arrived, _state["arrived_at"] = _state["arrived_at"], None  # the watchdog saw it first: from then
        _state["terminated_at"] = arrived if arrived is not None else time.monotonic()
    if first and not pending():
        _state["pressed"] += 1


def word() -> str:
    """How the line and the summary name a stop: "terminated (SIGTERM)" once a SIGTERM came, else
    "interrupted" (a Ctrl-C)."""
    return TERMINATED if _state["terminated"] or _state["arrived_at"] is not None else "interrupted"


# The grace period a scheduler gives between SIGTERM and SIGKILL: Kubernetes' default, and SLURM's
# KillWait. A process given more (SLURM's --signal=TERM@120) says so here, for a larger model's save.
GRACE_ENV = "DALLE_ABLATE_SIGTERM_GRACE"
EXIT_S = 5.0  # of the grace period, kept for what follows the last write: the lock's release, the exit
WATCHDOG_S = 3.0  # of the grace period, left when the watchdog ends the process (arm_watchdog)


def stop_deadline() -> Optional[float]:
    """After a SIGTERM, when (time.monotonic()) the writes the stop waits on must have ended -- a
    bucket that cannot take them in time is given up, and the process still exits inside its
    grace period; None before any SIGTERM. Counted from the SIGTERM's arrival, which the watchdog
    sees even while the main thread cannot run its handler."""
    at = _state["terminated_at"] if _state["terminated"] else _state["arrived_at"]
    return None if at is None else at + grace_s() - EXIT_S


@contextlib.contextmanager
def watchdog(line):
    """For the block (a job's work): after a SIGTERM, end this process just before its grace
    period does, whatever it waits on. A library call stuck on a bucket that does not answer
    (orbax making a step's folder, through its client's retries) would otherwise run into SIGKILL
    with nothing said. `line()` is the line it ends with, unless the process has said its own
    (`said`) or the process that started it says it (PARENT_SAYS); exit 143 either way. What was
    written stays (a local copy whole, the checkpoints finished before), as after a SIGKILL.
    The grace period is counted from the signal's arrival: Python runs a handler only when the
    main thread next runs Python code, which a call that does not return to it (or a thread that
    blocks the signal, so that another thread receives it) puts off -- the signal's byte on the
    wakeup fd (signal.set_wakeup_fd, written by the C handler at once) is not."""
    _state["watchdog"], _state["said"] = line, False
    wakeup, previous = _wakeup_fd()
    threading.Thread(target=_watch, args=(line, wakeup), daemon=True, name="sigterm-watchdog").start()
    try:
        yield
    finally:
        _state["watchdog"] = None
        if wakeup is not None:  # the watchdog thread reads its end until it stops, then closes it
            signal.set_wakeup_fd(previous)
            os.close(wakeup[1])


def _wakeup_fd() -> tuple[Optional[tuple[int, int]], int]:
    """A pipe the C signal handler writes each signal's number to, and the wakeup fd it replaces;
    (None, -1) off the main thread, where none can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None, -1
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    return wakeup, signal.set_wakeup_fd(wakeup[1], warn_on_full_buffer=False)


def said() -> None:
    """The process's last line is out: from here on only its exit is left."""
    _state["said"] = True


def _watch(line, wakeup: Optional[tuple[int, int]]) -> None:
    """The watchdog's thread, for as long as its block runs, and after a SIGTERM until the exit."""
    import select

    read = None if wakeup is None else wakeup[0]
    while _state["watchdog"] is line or stop_deadline() is not None:
        end = stop_deadline()
        if end is not None and time.monotonic() > end + EXIT_S - WATCHDOG_S:
            _expire(line)
        if read is None:
            time.sleep(0.2)
            continue
        if select.select([read], [], [], 0.2)[0]:
            got = os.read(read, 512)
            ours = signal.getsignal(signal.SIGTERM) is on_sigint  # a handler of ours will take it
            if signal.SIGTERM in got and ours and not _state["terminated"] and _state["arrived_at"] is None:
                _state["arrived_at"] = time.monotonic()
            if not got:  # the block ended and closed the other end
                os.close(read)
                read = None
    if read is not None:
        os.close(read)


def _expire(line) -> None:
    import sys

    try:
        if not _state["said"] and not os.environ.get(PARENT_SAYS):
            print(line(), file=sys.__stderr__, flush=True)
    except BaseException:  # noqa: BLE001 - the exit below is what must happen
        pass
    finally:
        for stream in (sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(exit_code())


def given_up() -> bool:
    """Whether a SIGTERM's stop is past its deadline for writes (stop_deadline): what the process
    still waits on is a library's thread on a bucket that does not answer, not its own work."""
    end = stop_deadline()
    return end is not None and time.monotonic() > end


def grace_s() -> float:
    text = os.environ.get(GRACE_ENV, "30")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > EXIT_S:  # a ValueError: this module sits below registry's ConfigError (job.py makes it one)
        raise ValueError(f"{GRACE_ENV}={text!r}: give the seconds between SIGTERM and SIGKILL, more than {EXIT_S:.0f}")
    return seconds


def exit_code() -> int:
    """The exit code of a stopped process: 143 (128 + SIGTERM) once a SIGTERM came, else 130 (128 + SIGINT)."""
    return 128 + (signal.SIGTERM if word() == TERMINATED else signal.SIGINT)


def installed() -> bool:
    return signal.getsignal(signal.SIGINT) is on_sigint


_DEFAULT = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def install() -> None:
    """Take Ctrl-C and SIGTERM at checks from now on, in this process: each where it has Python's
    default handler (a process started with SIGINT ignored, e.g. a background job of a shell
    script, keeps ignoring it)."""
    if threading.current_thread() is threading.main_thread():
        for sig, default in _DEFAULT.items():
            if signal.getsignal(sig) is default:
                signal.signal(sig, on_sigint)


@contextlib.contextmanager
def taken_at_checks():
    """`install()` for the block, Python's handlers back after it (a command run inside another
    program, e.g. a test calling `cli.main`)."""
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in _DEFAULT} if main else {}
    install()
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None and handler is not on_sigint and signal.getsignal(sig) is on_sigint:
                signal.signal(sig, handler)


def pending() -> bool:
    """Whether a Ctrl-C was pressed and not yet taken."""
    return _state["pressed"] > _state["taken"]


def check(stage: str = "") -> None:
    """Raise KeyboardInterrupt(stage) if a Ctrl-C or SIGTERM is pending (taking it); `stage` says
    what was stopped, for the line the process ends with (e.g. "while fitting the image tokenizer")."""
    if _state["pressed"] > _state["taken"]:
        _state["taken"] = _state["pressed"]
        raise KeyboardInterrupt(*([stage] if stage else []))


def stage_of(e: KeyboardInterrupt, default: str) -> str:
    """What a KeyboardInterrupt stopped, as `check(stage)` named it (`default` if it did not)."""
    return str(e.args[0]) if e.args and isinstance(e.args[0], str) and e.args[0] else default


@contextlib.contextmanager
def deferred():
    """No KeyboardInterrupt inside the block: two things that must happen together (a step and
    the assignment of its state, a metrics row logged and dequeued) both happen, and a Ctrl-C
    that came between them is raised when the block ends. With `on_sigint` installed that is
    only a second press; with Python's default handler (in the main thread) any press."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if installed():
        _state["holding"] += 1
        try:
            yield
        finally:
            _state["holding"] -= 1
            if _state["held"] and not _state["holding"]:
                _state["held"] = False
                _state["taken"] = _state["pressed"]
                raise KeyboardInterrupt(AT_ONCE)
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt
