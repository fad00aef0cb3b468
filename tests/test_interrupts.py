"""Ctrl-C taken at checks (dalle_ablate/interrupts.py): the process-level behaviour, stage by
stage, is tested end to end in tests/train/test_faults.py and tests/report/test_findings.py."""

from __future__ import annotations

import gc
import signal

import pytest

from dalle_ablate import interrupts


def test_a_ctrl_c_is_never_lost_taken_at_the_next_check_and_a_second_one_at_once():
    """interrupts.py: a Ctrl-C is recorded and raised by the next check -- also one that came while
    a garbage-collection callback ran, where Python drops a KeyboardInterrupt raised in it (jax's
    `_xla_gc_callback` is one); none inside `deferred()`; a second press before the first is
    taken raises at once; Python's handler is back after the block."""

    def press_in_gc(phase, info):
        gc.callbacks.remove(press_in_gc)
        signal.raise_signal(signal.SIGINT)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # also where the suite runs with SIGINT ignored
    try:
        with interrupts.taken_at_checks():
            interrupts.check()  # nothing pressed: nothing raised
            gc.callbacks.append(press_in_gc)
            gc.collect()
            assert interrupts.pending()
            with pytest.raises(KeyboardInterrupt) as e:
                interrupts.check("while doing x")
            assert interrupts.stage_of(e.value, "") == "while doing x" and not interrupts.pending()
            signal.raise_signal(signal.SIGINT)  # pressed, not taken yet ...
            with pytest.raises(KeyboardInterrupt) as e:
                signal.raise_signal(signal.SIGINT)  # ... and again: at once
            assert interrupts.stage_of(e.value, "") == interrupts.AT_ONCE and not interrupts.pending()
            done = []
            with pytest.raises(KeyboardInterrupt) as e:
                with interrupts.deferred():
                    signal.raise_signal(signal.SIGINT)
                    signal.raise_signal(signal.SIGINT)  # the second press, held until the block ends
                    done.append("the block ran to its end")
            assert done and interrupts.stage_of(e.value, "") == interrupts.AT_ONCE and not interrupts.pending()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert signal.getsignal(signal.SIGINT) is before


def _stuck_after_sigterm(tmp_path, body: str, grace: str = "6", before: str = "", line: str = "'the watchdog line'"):
    """A process that takes SIGTERM as the entry points do, inside `watchdog` (ending with the
    expression `line`), does `before`, sends itself one and then does `body` (a library call that
    never returns): its exit code, stderr and seconds."""
    import os
    import subprocess
    import sys
    import time

    code = (
        "import os, signal, sys, threading, time\n"
        "from dalle_ablate import interrupts\n"
        "interrupts.install()\n"
        f"with interrupts.watchdog(lambda: {line}):\n"
        + "".join(f"    {line}\n" for line in before.splitlines())
        + "    os.kill(os.getpid(), signal.SIGTERM)\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, interrupts.GRACE_ENV: grace},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr, time.monotonic() - start


def test_after_a_sigterm_the_watchdog_ends_a_process_stuck_past_its_grace_period(tmp_path):
    """A stop held by a call that never returns (a client retrying a bucket that is gone) still
    exits 143 before the grace period ends, with the watchdog's line; one whose own line is out
    (`said`) and is held in its exit by a library's thread exits without a second line."""
    rc, err, took = _stuck_after_sigterm(tmp_path, "time.sleep(100)")
    assert (rc, err.strip()) == (143, "the watchdog line") and took < 100
    held = "threading.Thread(target=time.sleep, args=(100,)).start()\nprint('its own line', file=sys.stderr)\n"
    rc, err, took = _stuck_after_sigterm(tmp_path, held + "interrupts.said()\nsys.exit(143)")
    assert (rc, err.strip()) == (143, "its own line") and took < 100


def test_the_grace_period_counts_from_the_sigterms_arrival_though_the_main_thread_cannot_take_it(tmp_path):
    """The main thread blocks SIGTERM, so another thread receives it, and sleeps: Python runs the
    handler only when the main thread next runs Python code (here after 100 s; in a run, after
    whatever call holds it). The watchdog still ends the process inside the grace period, timed
    from the signal's arrival (its wakeup fd), saying "terminated (SIGTERM)"."""
    rc, err, took = _stuck_after_sigterm(
        tmp_path,
        "time.sleep(100)",
        before="signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])",
        line="interrupts.word()",
    )
    assert (rc, err.strip()) == (143, interrupts.TERMINATED) and took < 100


def test_a_grace_period_that_leaves_no_time_is_refused_naming_the_variable(monkeypatch):
    """(job.py refuses it as a ConfigError, one line, before the job starts.)"""
    for text in ("5", "thirty"):
        monkeypatch.setenv(interrupts.GRACE_ENV, text)
        with pytest.raises(ValueError) as e:
            interrupts.grace_s()
        assert (
            str(e.value)
            == f"{interrupts.GRACE_ENV}={text!r}: give the seconds between SIGTERM and SIGKILL, more than 5"
        )
