"""Command line: the `dalle-ablate` console script, and the error handling around `run.py`.

User mistakes (an unknown config option or field, a bad value, a bad data file) end in one line
on stderr naming what is wrong and what would be valid, and exit code 2; anything else is a bug
and keeps its full traceback. Each verb lives in this package's modules beside its arguments
(files.py, runs.py, reports.py); `verbs.py` is their registry.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from dalle_ablate.cli import files, runs, reports  # noqa: F401 - registers their verbs, in this order
from dalle_ablate.cli.errors import run_hydra
from dalle_ablate.cli.verbs import VERBS, verb
from dalle_ablate.registry import Interrupted, RunFailed
from dalle_ablate.validate import format_error

__all__ = ["VERBS", "build_parser", "format_error", "main", "run_hydra", "verb"]


def build_parser() -> argparse.ArgumentParser:
    """The `dalle-ablate` parser and its verbs, in the order their modules are imported above (docs/reference/cli.md is
    generated from it)."""
    parser = argparse.ArgumentParser(prog="dalle-ablate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for name, (cmd, arguments, kwargs) in VERBS.items():
        arguments(sub.add_parser(name, **kwargs))
        sub.choices[name].set_defaults(func=cmd)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.verb == "study":  # its overrides may follow its options: `study mega-variants --out x trainer.steps=500`
        args.overrides += [e for e in extra if not e.startswith("-")]
        extra = [e for e in extra if e.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command, for the line a Ctrl-C ends it with
    try:
        args.func(args)  # a verb whose stages check for Ctrl-C takes it at those checks (interrupts.taken_at_checks)
    except RunFailed as ex:  # e.g. a study whose multirun failed: its page is written, the exit code says so
        print(f"error: {ex}", file=sys.stderr)
        sys.exit(ex.exit_code)
    except KeyboardInterrupt as ex:  # Ctrl-C: what finished is kept (a study's runs, a report's files); one line, no error
        print(str(ex) if isinstance(ex, Interrupted) else f"dalle-ablate {args.verb} interrupted; run the same command again",
              file=sys.stderr)
        sys.exit(130)
    except Exception as ex:  # noqa: BLE001 - re-raised unless it is a user mistake
        msg = format_error(ex)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
