"""The output directory's life: check it can be written, stage a conversion, commit it whole.

A conversion is the set of entries osdpipe writes under ``output.path``
(:func:`conversion_entries`: the rank files or ``optim.pt`` or ``dcp/``, the
generated ``source/``, ``manifest.json``). Everything of a run is written into
``.staging/`` first, the generated source included. Only a run that passed
goes in, by :func:`commit`:

1. ``.staging`` is renamed to ``.incoming`` (one atomic rename: "committing"),
2. every entry of the previous conversion moves into ``.previous/``, then
   ``.previous/.complete`` is written,
3. every entry of ``.incoming`` moves into place,
4. ``.previous`` and ``.incoming`` are removed.

So an overwrite never mixes two conversions: a file of the old one is either
in place with the whole old conversion, or in ``.previous``. If a run is
killed in the middle, :func:`recover` (called before every run into the
directory) finishes the commit when it had begun, or drops the staged run
when it had not: the directory then holds the old or the new conversion,
whole. ``report.json`` is not part of a conversion: it describes the last run,
failed or not.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

STAGING = ".staging"
INCOMING = ".incoming"
PREVIOUS = ".previous"
_COMPLETE = ".complete"
_RANK_FILE = re.compile(r"rank_\d+\.pt")
_NAMED = ("optim.pt", "dcp", "source", "manifest.json")


class OutputError(OSError):
    """``output.path`` cannot be used; the message says why in one line."""


def conversion_entries(directory: Path) -> list[Path]:
    """The entries of a conversion directly under ``directory`` (what an overwrite replaces)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name in _NAMED or _RANK_FILE.fullmatch(p.name))


def check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and prove a file can be written in it.

    Raises:
        OutputError: naming the path and the reason (a regular file in the way,
            no permission, a read-only filesystem).
    """
    blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutputError(f"output.path={str(directory)!r}: {blocker} is a file, not a directory; choose another output.path")
    probe = directory / ".osdpipe-write-test"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"output.path={str(directory)!r} cannot be written ({exc.strerror or exc}); choose a directory you can write to") from None


def _move_all(entries: list[Path], into: Path) -> None:
    for entry in entries:
        os.replace(entry, into / entry.name)


def _finish_commit(directory: Path) -> None:
    """Steps 2 to 4 of the commit; each can be repeated after an interruption."""
    incoming, previous = directory / INCOMING, directory / PREVIOUS
    if not (previous / _COMPLETE).exists():
        previous.mkdir(exist_ok=True)
        _move_all(conversion_entries(directory), previous)  # step 3 has not begun: every entry here is old
        (previous / _COMPLETE).touch()
    names = sorted(p.name for p in incoming.iterdir())
    names.sort(key=lambda n: n == "manifest.json")  # the manifest last: it names a complete conversion
    _move_all([incoming / n for n in names], directory)
    shutil.rmtree(previous)
    incoming.rmdir()


def recover(directory: Path) -> None:
    """Bring an interrupted run's directory back to one whole conversion (see the module docstring)."""
    if (directory / INCOMING).is_dir():
        _finish_commit(directory)
    shutil.rmtree(directory / PREVIOUS, ignore_errors=True)
    shutil.rmtree(directory / STAGING, ignore_errors=True)


def begin(directory: Path) -> Path:
    """Prepare ``directory`` for a run: writable, recovered, with an empty ``.staging``; returns the staging path."""
    check_writable(directory)
    recover(directory)
    staging = directory / STAGING
    staging.mkdir()
    return staging


def commit(directory: Path) -> None:
    """Replace the conversion in ``directory`` by the one staged in ``.staging``, as a whole."""
    os.replace(directory / STAGING, directory / INCOMING)
    _finish_commit(directory)


def abort(directory: Path) -> None:
    """Drop what a failed run staged; the previous conversion stays as it was."""
    shutil.rmtree(directory / STAGING, ignore_errors=True)
