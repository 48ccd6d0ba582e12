"""One flat buffer: entries concatenated with alignment padding, cut into equal slices, one per rank.

Three layouts keep a rank's state so, and each is this one mechanism with its own numbers:

* FSDP1's flat parameter: a unit's parameters in registration order, each start aligned (``use_orig_params``: 16
  bytes of the compute dtype), cut as ``torch.chunk`` cuts it over the shard group;
* DeepSpeed ZeRO 1/2's partition of a param group: its parameters with the padding its files list after each, the
  end padded to a multiple of twice the world, cut into equal parts;
* Megatron-Core's gradient bucket (the distributed optimizer's ``dp_reshardable`` state): a model chunk's local
  parameters in reverse order, each start aligned to 64 elements, the end to ``lcm(DP, 128)``, cut over DP.

A buffer (:func:`pack`) is where each entry lies; :func:`rank_slice` is a rank's equal slice of it; :func:`segments`
meets a slice with the entries (what a rank's local tensor is made of, as :class:`~osdpipe.layout.ranges.Segment`
of each entry's flattened view); :func:`held_by` turns the other way (where each entry's elements are, across the
containers that hold them: what a reader of such a save asks). Pure functions of sizes: no torch, no files.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from osdpipe.layout.ranges import Segment, chunk_bounds


@dataclass(frozen=True)
class FlatBuffer:
    """Entries laid end to end: each ``(name, start, stop)`` in the buffer; ``data_end``: where the data ends (what a
    save that cuts the padding off keeps); ``numel``: the padded size the slices are cut from."""

    entries: tuple[tuple[str, int, int], ...]
    data_end: int
    numel: int


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (1: itself)."""
    return -(-value // multiple) * multiple


def pack(
    sizes: Sequence[tuple[str, int]],
    *,
    align: int = 1,
    gaps: Sequence[int] = (),
    multiple: int = 1,
    data_end: int | None = None,
) -> FlatBuffer:
    """Entries ``sizes`` (name, numel) laid end to end, in order.

    Args:
        align: each entry starts on a multiple of this many elements (the padding before it stays zero).
        gaps: elements of padding after each entry, where a save lists them (ZeRO's ``param_alignment_paddings``).
        multiple: the buffer's end is padded to a multiple of this.
        data_end: where the data ends, where it is not the last entry's end (Megatron closes a bucket at the aligned
            start of the parameter that would come next).
    """
    entries: list[tuple[str, int, int]] = []
    at = 0
    for i, (name, numel) in enumerate(sizes):
        start = round_up(at, align)
        entries.append((name, start, start + numel))
        at = start + numel + (gaps[i] if i < len(gaps) else 0)
    end = at if data_end is None else data_end
    return FlatBuffer(tuple(entries), end, round_up(end, multiple))


def rank_slice(buffer: FlatBuffer, parts: int, index: int) -> tuple[int, int, int]:
    """Rank ``index``'s slice of ``parts`` equal slices of the buffer: ``(start, stop, size)``, as ``torch.chunk``
    cuts it (``ceil(numel / parts)`` each; a trailing rank may hold less, padded to ``size``)."""
    return chunk_bounds(buffer.numel, parts, index)


def segments(buffer: FlatBuffer, start: int, stop: int) -> tuple[Segment, ...]:
    """The entries' elements within ``[start, stop)`` of the buffer, as segments of each entry's flattened view at
    their offset from ``start``; the rest is padding."""
    out = []
    for name, first, last in buffer.entries:
        lo, hi = max(first, start), min(last, stop)
        if lo < hi:
            out.append(Segment(name, lo - first, hi - lo, lo - start))
    return tuple(out)


@dataclass(frozen=True)
class Held:
    """``length`` elements of an entry's flattened view from ``start``, at ``offset`` in container ``where`` (a rank's
    partition, a saved bucket)."""

    where: Hashable
    start: int
    length: int
    offset: int


def held_by(containers: Iterable[tuple[Hashable, Iterable[Segment]]]) -> dict[str, list[Held]]:
    """Where every entry's elements are: entry name -> its pieces across ``containers`` (each a container and the
    segments it holds, as :func:`segments` gives them), in the order of the entry's flattened view."""
    out: dict[str, list[Held]] = {}
    for where, held in containers:
        for s in held:
            out.setdefault(s.fqn, []).append(Held(where, s.start, s.length, s.dest))
    for pieces in out.values():
        pieces.sort(key=lambda p: p.start)
    return out


def held_in(pieces: Sequence[Held], start: int, stop: int) -> list[Held]:
    """The parts of ``pieces`` (one entry's, :func:`held_by`: in the order of its flattened view) that hold elements
    ``[start, stop)``, cut to that range; the first found by bisection (an entry may lie in many buckets' pieces)."""
    out = []
    for p in pieces[max(0, bisect_right(pieces, start, key=lambda held: held.start) - 1):]:
        if p.start >= stop:
            break
        low, high = max(start, p.start), min(stop, p.start + p.length)
        if high > low:
            out.append(Held(p.where, low, high - low, p.offset + low - p.start))
    return out
