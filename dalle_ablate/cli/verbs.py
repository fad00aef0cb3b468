"""The verbs' registry: each module of this package registers its verbs with `@verb`, beside the
function that adds the verb's arguments; `dalle_ablate.cli.build_parser` builds the parser from it."""

from __future__ import annotations

import argparse
from typing import Callable

VERBS: dict[str, tuple[Callable, Callable, dict]] = {}  # name -> (command, its arguments, add_parser's keywords)


def verb(name: str, arguments: Callable[[argparse.ArgumentParser], None], **parser_kwargs):
    """`cmd_*` as the verb `dalle-ablate <name>`: its arguments are added by `arguments(parser)`,
    the function just above it; `parser_kwargs` (help, description, epilog) go to add_parser."""

    def register(cmd):
        VERBS[name] = (cmd, arguments, parser_kwargs)
        return cmd

    return register
