"""Where a rank was when native code killed it, and what it printed: the Python stacks ``faulthandler`` writes as the
process dies, and the rank's standard error.

A rank killed by SIGSEGV or SIGABRT (a heap check in ``malloc``, an abort in
a C++ library) raises nothing and sends nothing, so its launcher knows only
the signal and the stage (:mod:`osdpipe.run.whereabouts`). Each rank of a
local world therefore arms ``faulthandler`` into a file of its own
(:func:`arm`); when the launcher finds the rank dead, it reads the file
(:func:`innermost`) and the one-line error names the code it was in, the
innermost frame and the innermost of osdpipe's own. ``runtime.debug`` prints
the whole dump (:func:`read`). A rank that ends normally leaves an empty file,
removed with the world's folder.

A rank's standard error goes to a file of its own too (:func:`capture_stderr`),
not to the user's terminal: native code writes there as it dies (glibc's
"free(): invalid pointer", a C++ "terminate called after throwing"), and so
does a surviving rank whose library trips over a peer's death as it shuts
down, after the run's one error line is decided. The dead rank's last line
(:func:`last_words`) joins its error line; the whole of it is in ``report.json``'s
``traceback`` (printed with ``runtime.debug``).
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
from pathlib import Path
from typing import IO

#: ``  File "/x/y.py", line 12 in name``: one frame of a faulthandler dump.
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')
#: The header of the stack of the thread that received the signal.
_CURRENT = re.compile(r"^Current thread 0x[0-9a-f]+")

#: The osdpipe package's folder: a frame in a file under it is osdpipe's own.
_PACKAGE = Path(__file__).resolve().parents[1]

_armed: IO[str] | None = None  # kept open for the life of the process: faulthandler writes to its descriptor


def dump_path(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` of a local world writes its dump."""
    return folder / f"rank-{rank}.stacks"


def stderr_path(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` of a local world writes its standard error."""
    return folder / f"rank-{rank}.stderr"


def arm(path: Path) -> None:
    """Dump every thread's Python stack into ``path`` if this process is killed by a fatal signal."""
    global _armed
    _armed = path.open("w")
    faulthandler.enable(file=_armed, all_threads=True)


def capture_stderr(path: Path) -> None:
    """Send this process's standard error (its descriptor 2, where C and C++ code write too) into ``path``."""
    sys.stderr.flush()
    with path.open("ab") as file:
        os.dup2(file.fileno(), 2)


def read(path: Path) -> str:
    """The dump, or the standard error, a dead rank wrote (``""``: none)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


#: The most of a dead rank's last line that its one-line error carries.
_LAST_WORDS_CHARS = 200


def last_words(printed: str) -> str | None:
    """The last line a dead rank printed (``None``: nothing), cut to :data:`_LAST_WORDS_CHARS` characters."""
    lines = [line.strip() for line in printed.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    return last if len(last) <= _LAST_WORDS_CHARS else last[: _LAST_WORDS_CHARS - 3] + "..."


def _ours(path: str) -> bool:
    return Path(path).is_relative_to(_PACKAGE)


def _shown(path: str, line: str, name: str) -> str:
    """A frame as a user reads it: an installed package's path from the package on (``osdpipe/...``,
    ``torch/...``), any other file's whole."""
    parts = Path(path).parts
    marks = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
    if _ours(path):
        parts = Path(path).relative_to(_PACKAGE.parent).parts
    elif marks:
        parts = parts[marks[-1] + 1 :]
    else:
        return f"{path}:{line} in {name}"
    return f"{'/'.join(parts)}:{line} in {name}"


def innermost(dump: str) -> str | None:
    """The code the dying thread was in, from a faulthandler ``dump``: its innermost frame, and the innermost
    frame of osdpipe's own where that is another (``"torch/x.py:3 in f, called from osdpipe/y.py:9 in g"``).

    ``None`` when the dump holds no stack of the dying thread (it was not written, or died with the process).
    """
    frames: list[tuple[str, str, str]] = []
    current = False
    for text in dump.splitlines():
        if _CURRENT.match(text):
            current, frames = True, []
        elif current and (frame := _FRAME.match(text)):
            frames.append((frame["path"], frame["line"], frame["name"]))
        elif current and frames:
            break  # the end of the dying thread's stack
    if not frames:
        return None
    first = _shown(*frames[0])
    ours = next((f for f in frames if _ours(f[0])), None)
    if ours is None or ours == frames[0]:
        return first
    return f"{first}, called from {_shown(*ours)}"
