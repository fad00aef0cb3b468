"""Run at the start of every Python process of a measured suite (benchmarks/suite_children.py puts
a .pth line that runs it into the clone's own virtual environment, and only there): when
$DALLE_ABLATE_CHILD_CLOCK names a file, the process appends one line when it starts and one when it
exits -- its pid and parent, the test that started it ($PYTEST_CURRENT_TEST, which pytest sets and
children inherit), its command's first words and its wall and CPU seconds. A process killed (SIGKILL)
writes no end line. Measurement only: nothing of it is imported by the package or its tests."""

import atexit
import json
import os
import sys
import time


def _append(record: dict) -> None:
    """One line, in one write to a file opened for appending: lines of processes running at once
    never interleave."""
    try:
        fd = os.open(os.environ["DALLE_ABLATE_CHILD_CLOCK"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:  # a measurement never fails the process it measures
        pass


def _start() -> None:
    started, test = time.time(), os.environ.get("PYTEST_CURRENT_TEST")
    _append({"event": "start", "pid": os.getpid(), "test": test, "argv": sys.argv[:3], "t": started})

    def end() -> None:
        cpu = sum(os.times()[:2])
        wall = time.time() - started
        _append({"event": "end", "pid": os.getpid(), "ppid": os.getppid(), "wall": wall, "cpu": cpu})

    atexit.register(end)


# Once a process: a venv whose lib64 links to lib reads each .pth file twice.
if os.environ.get("DALLE_ABLATE_CHILD_CLOCK") and not getattr(sys, "_child_clock", False):
    sys._child_clock = True
    _start()
