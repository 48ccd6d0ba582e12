"""The directories one invocation makes for its jobs, so that a job that never ran removes exactly those.

Hydra makes a job's directory (``hydra.run.dir``, a sweep job's ``<sweep dir>/<N>``) with all its missing
parents before the job starts, and a config error is found only after. What existed before is learnt when
Hydra resolves the directory's name, which it does before it makes it: the resolvers of ``conf/config.yaml``
call :func:`note` then. A directory that existed then, the user's own, empty or not, is never removed.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Each job directory named this invocation -> the highest of it and its parents that did not exist when it was
#: first named (``None``: it existed). The first naming wins: Hydra resolves the name again after making it.
_first_missing: dict[Path, Path | None] = {}


def highest_missing(path: Path) -> Path | None:
    """The highest of ``path`` and its parents that does not exist (``None`` if ``path`` exists)."""
    missing = None
    for directory in (path, *path.parents):
        if directory.exists():
            break
        missing = directory
    return missing


def note(path: str) -> str:
    """Record what of ``path`` does not exist yet (Hydra is about to make it), and give ``path`` back unchanged."""
    absolute = Path(os.path.abspath(path))
    _first_missing.setdefault(absolute, highest_missing(absolute))
    return path


def discard_all() -> None:
    """Remove every job directory this invocation named and the parents it made for them, each only while empty: what
    a command stopped before its jobs wrote anything leaves behind. The last named goes first, so that a sweep's
    directory, made for its first job, goes with that job's."""
    for path in reversed(list(_first_missing)):
        discard(str(path))


def discard(path: str) -> None:
    """Remove ``path`` and the parents this invocation made for it,
    each only while empty, and nothing it did not make."""
    directory = Path(os.path.abspath(path))
    top = _first_missing.get(directory)
    if top is None:
        return
    while True:
        try:
            directory.rmdir()  # only if empty: a file written since keeps it, and every parent above it
        except OSError:
            return
        if directory == top:
            return
        directory = directory.parent
