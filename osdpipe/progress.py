"""Progress on long work, on rank 0 only, through tqdm (quiet when output is not a terminal or CI is set).

tqdm rather than a bar of our own: rate, ETA and terminal-width handling are
solved there, it has no dependencies of its own, and it stays out of the way
of log output; rich would bring a rendering stack osdpipe does not otherwise need.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, *, enabled: bool = True) -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr when ``enabled`` and stderr is a terminal."""
    if not enabled or os.environ.get("CI") or not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, unit="tensor", leave=False)
