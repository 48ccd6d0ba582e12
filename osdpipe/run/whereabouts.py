"""Which stage each rank is in, so that a rank that dies without a word is still reported where it died.

A rank killed by a signal (SIGKILL from the OOM killer or a user, a
segfault) raises nothing and sends nothing: its launcher sees an exit code
and no more. So each rank posts the stage it enters (:func:`enter`) on a
:class:`Board` in memory it shares with the launcher, which reads the
board when it finds the rank dead. The rank itself keeps its stage too
(:func:`current`), to say where it was when it is told to stop.
"""

from __future__ import annotations

import ctypes
from typing import Any

#: Bytes a stage name may take on the board (longer names are cut).
WIDTH = 32

_current: str | None = None
_cell: tuple[Any, int] | None = None  # (the board's shared bytes, this rank's offset)


class Board:
    """One cell per rank of a local world, in shared memory: the stage the rank last entered."""

    def __init__(self, mp_context: Any, world_size: int) -> None:
        self.cells = mp_context.RawArray(ctypes.c_char, world_size * WIDTH)

    def stage_of(self, rank: int) -> str | None:
        raw = bytes(self.cells[rank * WIDTH : (rank + 1) * WIDTH]).rstrip(b"\0")
        return raw.decode(errors="replace") or None


def attach(cells: Any, rank: int) -> None:
    """Post this process's stages in ``rank``'s cell of a board's ``cells`` (in a local world's rank)."""
    global _cell
    _cell = (cells, rank * WIDTH)


def enter(stage: str) -> None:
    """This rank now runs ``stage``."""
    global _current
    _current = stage
    if _cell is not None:
        cells, offset = _cell
        cells[offset : offset + WIDTH] = stage.encode()[:WIDTH].ljust(WIDTH, b"\0")


def current() -> str | None:
    """The stage this rank last entered (``None`` before the first)."""
    return _current
