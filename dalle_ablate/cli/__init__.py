"""Command line: the `dalle-ablate` console script, and the error handling around `run.py`.

User mistakes (an unknown config option or field, a bad value, a bad data file) end in one line
on stderr naming what is wrong and what would be valid, and exit code 2; anything else is a bug
and keeps its full traceback. Each verb lives in this package's modules beside its arguments
(files.py, runs.py, reports.py); `verbs.py` is their registry. A verb imports what it needs when
it runs, so that `--help` and a mistyped verb answer without loading JAX or the config schemas.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from dalle_ablate import interrupts
from dalle_ablate.cli import files, runs, reports  # noqa: F401 - registers their verbs, in this order
from dalle_ablate.cli.errors import run_hydra
from dalle_ablate.cli.verbs import VERBS, verb
from dalle_ablate.registry import Interrupted, RunFailed

__all__ = ["VERBS", "build_parser", "format_error", "main", "run_hydra", "verb"]

# What `dalle-ablate --help` tells a user: what the tool is, a few commands to start from, where the docs are.
DESCRIPTION = """\
dalle-ablate: the commands around training runs of DALL·E-style text-to-image transformers.
Training itself is `python run.py [group=option ...] [field=value ...]` (`python run.py --help`);
dalle-ablate compares the runs (report, study), evaluates a checkpoint (eval), sizes a config
without running it (describe, plan) and prepares data, weights and fitted helpers."""
EXAMPLES = """\
examples:
  dalle-ablate report multirun/<date>/<time> --baseline model=normformer
      compare the runs of a multirun: reports/<name>/index.html, with intervals over seeds
  dalle-ablate describe model=normformer size=mega
      parameters, FLOPs per image token and memory of a config, without allocating it
  dalle-ablate study mega-variants --seeds auto
      run a published study's arms with the seeds it needs, then its report and results page

`dalle-ablate VERB --help` lists a verb's arguments. Docs: docs/guides/command-line.md and
docs/reference/cli.md in the dalle-ablate repository (`mkdocs serve` serves them as a site)."""


def format_error(ex: BaseException) -> Optional[str]:
    """validate.format_error, imported when an error needs it (it loads every option's schema)."""
    from dalle_ablate.validate import format_error as one_line

    return one_line(ex)


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The `dalle-ablate` parser and its verbs, in the order their modules are imported above (docs/reference/cli.md is
    generated from it). `only`: the arguments of that verb alone (the command line's: no other verb's are
    parsed, and a verb's arguments may import what their help names, e.g. plan's device table); None: every verb's."""
    parser = argparse.ArgumentParser(
        prog="dalle-ablate",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(
        dest="verb",
        required=True,
        title="verbs",
        metavar="VERB",
        help="one of these (its arguments: dalle-ablate VERB --help)",
    )
    for name, (cmd, arguments, kwargs) in VERBS.items():
        verb_parser = sub.add_parser(name, **kwargs)
        if only is None or name == only:
            arguments(verb_parser)
        verb_parser.set_defaults(func=cmd)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=next((a for a in argv if not a.startswith("-")), ""))
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
    except (
        KeyboardInterrupt
    ) as ex:  # Ctrl-C: what finished is kept (a study's runs, a report's files); one line, no error
        print(
            str(ex)
            if isinstance(ex, Interrupted)
            else f"dalle-ablate {args.verb} {interrupts.word()}; run the same command again",
            file=sys.stderr,
        )
        sys.exit(interrupts.exit_code())
    except Exception as ex:  # noqa: BLE001 - re-raised unless it is a user mistake
        msg = format_error(ex)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
