"""The ``osdpipe`` console script: start the ranks' fork server, then run the command.

The server's imports (torch among them) then run while this process imports
its own and composes the config (see :mod:`osdpipe.rankserver`). The
subcommands that start no ranks and compose no config (``check``,
``inspect``) are dispatched here, before Hydra is imported.
"""

from __future__ import annotations

import importlib
import sys

#: ``osdpipe <name> ...``: the function that runs it, given the remaining arguments, and returns the exit code.
SUBCOMMANDS = {"check": "osdpipe.check:run_check", "inspect": "osdpipe.inspect_command:run_inspect"}


def main() -> None:
    args = sys.argv[1:]
    if args[:1] and args[0] in SUBCOMMANDS:
        module, _, function = SUBCOMMANDS[args[0]].partition(":")
        sys.exit(getattr(importlib.import_module(module), function)(args[1:]))
    from osdpipe.rankserver import start_early

    start_early(args)
    from osdpipe.cli import main as command

    command()
