"""A study's runs as child processes: each dies with the study process, and on Ctrl-C (or a
SIGTERM) gets time to save its last whole step before the study ends with one line."""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional

from dalle_ablate import interrupts


def dies_with_this_process() -> Optional[Callable[[], None]]:
    """A preexec_fn for a child that must not outlive this process: the kernel kills the child when
    this process dies, however (kill -9 included), so a study's multirun or stress run never goes
    on writing the study's run stores beside the next `dalle-ablate study` (Linux's
    PR_SET_PDEATHSIG; None elsewhere)."""
    if sys.platform != "linux":
        return None
    import ctypes

    # Resolved here, not in the forked child: importing there could wait on a lock another
    # thread of this process held at the fork.
    prctl, kill, parent = ctypes.CDLL(None, use_errno=True).prctl, int(signal.SIGKILL), os.getpid()

    def preexec() -> None:
        prctl(1, kill)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # this process died before the line above took effect
            os._exit(1)

    return preexec


class PastDeadline(Exception):
    """The child ran into the study's time limit: stopped by SIGTERM (it saved its last step)."""


def call_child(
    command: list[str],
    env: dict,
    preexec: Optional[Callable[[], None]] = None,
    grace: float = 120.0,
    deadline: Optional[float] = None,
) -> int:
    """subprocess.call, but a Ctrl-C lets the child finish what it does on one: Ctrl-C reaches the
    whole foreground process group, and a run saves its last whole step before it exits (exit
    130). subprocess.call would SIGKILL it 0.25 s after the interrupt. A second Ctrl-C, or
    `grace` seconds, kills it; either way KeyboardInterrupt is raised once the child is gone, also
    when the child alone was interrupted (exit 130, or 143 after a SIGTERM). The child leaves the
    line a Ctrl-C ends with to this process (interrupts.PARENT_SAYS): the command that continues
    all of it. A SIGTERM this process takes is passed on to the child (a scheduler may signal the
    first process alone; a second SIGTERM to a child that got the first too is no press). At
    `deadline` (time.monotonic()) the child gets SIGTERM, saves and stops: PastDeadline."""
    import subprocess
    import time

    interrupts.check()  # a Ctrl-C already pressed: a child started now would not get it
    child = subprocess.Popen(command, env={**env, interrupts.PARENT_SAYS: "1"}, preexec_fn=preexec)
    try:
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                interrupts.check()
                if deadline is not None and time.monotonic() > deadline:
                    child.send_signal(signal.SIGTERM)
                    _wait_or_kill(child, grace)
                    raise PastDeadline(" ".join(command)) from None
    except KeyboardInterrupt:
        if interrupts.word() == interrupts.TERMINATED:  # SIGTERM may have reached this process alone
            child.send_signal(signal.SIGTERM)  # (Kubernetes: the container's first one): the child saves too
        _wait_or_kill(child, grace)
        raise
    if code == 128 + signal.SIGTERM:  # the child alone got SIGTERM: stopped the same way, saying so
        interrupts.terminated()
    if code in (130, 128 + signal.SIGTERM) or interrupts.pending():
        interrupts.check()
        raise KeyboardInterrupt
    return code


def _wait_or_kill(child, grace: float) -> None:
    """Wait for an interrupted child to save and exit; kill it after `grace` s or at the next Ctrl-C."""
    import time

    end = time.monotonic() + grace
    try:
        while child.poll() is None and time.monotonic() < end and not interrupts.pending():
            time.sleep(0.1)
    except KeyboardInterrupt:  # Python's own handler (no interrupts.install): the second Ctrl-C
        pass
    if child.poll() is None:
        child.kill()
    child.wait()
