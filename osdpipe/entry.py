"""The ``osdpipe`` console script: start the ranks' fork server, then run the command.

The server's imports (torch among them) then run while this process imports
its own and composes the config (see :mod:`osdpipe.rankserver`).
"""

from __future__ import annotations

import sys


def main() -> None:
    from osdpipe.rankserver import start_early

    start_early(sys.argv[1:])
    from osdpipe.cli import main as command

    command()
