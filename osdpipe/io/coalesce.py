"""Which byte ranges of one object to fetch together: pure range math, no I/O.

A request to object storage costs a round trip and a GET's price whatever its size, and a store that reads the whole
object to serve a range (moto's server, some gateways) costs the whole object per request. The ranges a DCP read
needs are mostly back to back (a file's items are written one after another, and a reshard reads runs of them), so
fetching neighbours as one request turns a request per item into a few per file. Two bounds keep it honest: a gap
between two ranges is fetched (and thrown away) only while it is small (``max_gap``), and no request grows past
``max_bytes`` (what :mod:`osdpipe.io.remote_input` may hold in flight, from ``runtime.memory_budget``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One request: bytes ``[start, stop)`` of an object, fetched for the input ranges ``members`` (their indices)."""

    start: int
    stop: int
    members: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.stop - self.start


def coalesce(ranges: Sequence[tuple[int, int]], max_gap: int, max_bytes: int) -> list[Span]:
    """The requests that fetch ``ranges`` (``(start, length)`` of one object), in the order of their starts.

    Ranges are taken in order of their start; each joins the request before it when the bytes between them
    (``max_gap`` at most; ranges that touch or overlap have none) and the grown request (``max_bytes`` at most) both
    fit; else it starts a request of its own. A range longer than ``max_bytes`` is a request alone: it is needed
    whole. Empty ranges are members of no request.

    Args:
        ranges: ``(start, length)`` pairs, in any order, repeats allowed.
        max_gap: the most unwanted bytes fetched between two ranges of one request (0: only ranges that touch).
        max_bytes: the most bytes one request fetches, unless a single range is longer.

    Returns:
        Every non-empty range is a member of exactly one span, which covers it.
    """
    if max_gap < 0 or max_bytes < 1:
        raise ValueError(f"coalesce: max_gap must be >= 0 and max_bytes >= 1, not {max_gap} and {max_bytes}")
    order = sorted((i for i, (_, length) in enumerate(ranges) if length > 0), key=lambda i: ranges[i])
    spans: list[Span] = []
    for i in order:
        start, length = ranges[i]
        stop = start + length
        if spans:
            last = spans[-1]
            grown = max(last.stop, stop)
            if start - last.stop <= max_gap and grown - last.start <= max_bytes:
                spans[-1] = Span(last.start, grown, (*last.members, i))
                continue
        spans.append(Span(start, stop, (i,)))
    return spans
