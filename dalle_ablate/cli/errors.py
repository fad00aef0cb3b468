"""The error handling around `run.py` (and `python -m dalle_ablate.job`): a user mistake is one
line on stderr and exit code 2, a run that failed for a known reason one line and its code, a bug
its full traceback, Ctrl-C one line saying what it stopped and how to continue, and exit code 130
(SIGTERM: the same line, "terminated (SIGTERM)", and 143; docs/guides/troubleshooting.md lists the codes)."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from dalle_ablate import interrupts
from dalle_ablate.registry import Interrupted, RunFailed


HYDRA_JOB_ERROR = "Error executing job with overrides: "


class _JobErrorLine:
    """sys.stderr while a `@hydra.main` function runs: Hydra writes "Error executing job with
    overrides: [...]" just before it re-raises a job's exception; the line is held back, so that
    the error is one line on stderr (with a multirun's job overrides folded in)."""

    def __init__(self, stream):
        self.stream, self.overrides = stream, None

    def write(self, text: str) -> int:
        if text.startswith(HYDRA_JOB_ERROR):
            self.overrides = text[len(HYDRA_JOB_ERROR) :].strip()
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _multirun() -> bool:
    """Whether the command line asked for a multirun (Hydra has forgotten by the time a job's error reaches us)."""
    return any(a in ("-m", "--multirun") or a.replace(" ", "") == "hydra.mode=MULTIRUN" for a in sys.argv[1:])


# OS errors that say a file cannot be written there (no permission, read-only, full): a known cause
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def unwritable(ex: BaseException) -> Optional[str]:
    """The line for an error whose cause is a file that cannot be written -- e.g. Hydra's log and
    config in a job folder that is read-only, met before anything is built; None otherwise."""
    seen = ex
    while seen is not None and not (isinstance(seen, OSError) and seen.errno in UNWRITABLE and seen.filename):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    path = Path(seen.filename).absolute()
    return (
        f"folder {path.parent} cannot be written ({path.name}: {errno.errorcode[seen.errno]}: {seen.strerror}); fix it, "
        "or, for the job's own folder, choose another with hydra.run.dir= (hydra.sweep.dir= for a multirun)"
    )


def run_hydra(main: Callable[[], object]) -> None:
    """Call a `@hydra.main` function: a user mistake is one line and exit code 2, a run that
    diverged or failed for a known reason one line and its code, Ctrl-C (taken at the checks of
    interrupts.py) one line and 130, SIGTERM the same line and 143 (docs/guides/troubleshooting.md)."""
    # Hydra would print multi-line messages and exit 1 itself; let the exception reach us.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    from dalle_ablate.launch.jobs import WorkerLost

    stderr = sys.stderr = _JobErrorLine(sys.stderr)

    def fail(msg: str, code: int) -> None:
        if stderr.overrides and _multirun():  # which job of the multirun failed: Hydra prints its overrides' list
            import ast

            try:
                job = " ".join(ast.literal_eval(stderr.overrides))
            except (ValueError, SyntaxError, TypeError):
                job = stderr.overrides
            msg = f"{msg} (job: {job})"
        print(f"error: {msg}", file=stderr.stream)
        sys.exit(code)

    try:
        with interrupts.taken_at_checks():
            interrupts.check("while starting")  # e.g. during the imports
            main()
            if interrupts.pending():  # too late for any check: everything had finished
                raise Interrupted(
                    f"{interrupts.word()} as it ended, after everything had finished: nothing to continue"
                )
    except RunFailed as ex:  # diverged, or failed for a known reason: the run store says so too
        fail(str(ex), ex.exit_code)
    except WorkerLost as ex:  # a cluster launcher's job killed, timed out or its node lost (a sweep goes on)
        fail(str(ex), RunFailed.FAILED)
    except (
        KeyboardInterrupt
    ) as ex:  # Ctrl-C or SIGTERM: what a job saved and how to continue, in one line (not an error)
        if not os.environ.get(interrupts.PARENT_SAYS):  # else the process that started this one says it
            print(
                str(ex)
                if isinstance(ex, Interrupted)
                else f"{interrupts.word()} {interrupts.stage_of(ex, 'while starting')}; no step trained; "
                "run the same command again",
                file=stderr.stream,
            )
        interrupts.said()
        if interrupts.given_up():  # only a library's thread, on a bucket that does not answer, is left to wait for
            for stream in (stderr.stream, sys.stdout):
                stream.flush()
            os._exit(interrupts.exit_code())
        sys.exit(interrupts.exit_code())
    except Exception as ex:  # noqa: BLE001 - re-raised unless it is a user mistake
        from dalle_ablate.validate import format_error

        msg = format_error(ex) or (format_error(ex.__cause__) if ex.__cause__ else None)
        if msg is None and unwritable(ex):
            fail(unwritable(ex), RunFailed.FAILED)
        if msg is None:
            if stderr.overrides:  # a bug: Hydra's line above its traceback, as Hydra prints it
                stderr.stream.write(f"{HYDRA_JOB_ERROR}{stderr.overrides}{os.linesep}")
            raise
        fail(msg, 2)
    finally:
        sys.stderr = stderr.stream
