"""Pure layout math of DeepSpeed ZeRO: where each element of each parameter sits in each rank's flat partitions.

ZeRO keeps, per param group, one flat fp32 partition per rank, and the
optimizer's state of that partition (Adam's moments) has the same layout.
How the group is cut is all a reader needs, and it is the range model of
the rest of osdpipe (:class:`~osdpipe.layout.ranges.Segment`):

* **Stage 1 and 2**: the group's parameters, flattened and concatenated in
  the order ``param_shapes`` lists them, padded at the end to a multiple of
  ``2 * world_size`` (``nccl_start_alignment_factor`` times the data-parallel
  world), and with ``zero_optimization.parameter_alignment`` each parameter
  but the last followed by the padding the file lists
  (``param_alignment_paddings``); rank r holds ``[r P, (r + 1) P)`` of it, ``P`` the padded total
  over the world size. Only the last rank holds padding.
* **Stage 3**: each parameter is cut on its own in ``ceil(numel / W)``
  pieces; rank r holds ``[r c, (r + 1) c)`` of it (clipped to ``numel``:
  the rest of its piece is padding), and a rank's partition of the group is
  its pieces of the group's parameters, concatenated in ``param_shapes``
  order.

Nothing here reads a file: the readers (:mod:`osdpipe.io.formats.deepspeed`)
give it the names and sizes from the checkpoint's ``param_shapes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from osdpipe.layout.ranges import Segment

#: ZeRO 1/2 pads each group's flat buffer to a multiple of this many times the world size.
STAGE12_ALIGNMENT = 2


@dataclass(frozen=True)
class Piece:
    """``length`` elements of a parameter's flattened view from ``start``,
    at ``offset`` in rank ``rank``'s partition of group ``group``."""

    rank: int
    group: int
    start: int
    length: int
    offset: int


def partition_size(numels: Sequence[int], world_size: int, stage: int, paddings: Sequence[int] = ()) -> int:
    """How many elements each rank's partition of a group of parameters of ``numels`` holds, padding included
    (``paddings``: stage 1/2's after each parameter, where the save lists them)."""
    if stage == 3:
        return sum(-(-n // world_size) for n in numels)
    align = STAGE12_ALIGNMENT * world_size
    return -(-(sum(numels) + sum(paddings)) // align) * align // world_size


def saved_lengths(
    numels: Sequence[int], world_size: int, stage: int, rank: int, paddings: Sequence[int] = ()
) -> tuple[int, int]:
    """How many elements rank ``rank``'s file holds of a group's partition: the moments
    (padding included), and the fp32 master weights, which stage 1/2 save without the
    group's padding at the end (stage 3, and DeepSpeed's bf16 optimizer, with it)."""
    size = partition_size(numels, world_size, stage, paddings)
    if stage == 3:
        return size, size
    data = sum(numels) + sum(paddings)
    return size, min(size, max(0, data - rank * size))


def rank_segments(
    numels: Sequence[tuple[str, int]], world_size: int, stage: int, rank: int, paddings: Sequence[int] = ()
) -> tuple[Segment, ...]:
    """Rank ``rank``'s partition of one group (``numels``: each parameter's name and numel, in ``param_shapes`` order;
    ``paddings``: stage 1/2's after each parameter), as segments."""
    out = []
    if stage == 3:
        dest = 0
        for fqn, numel in numels:
            piece = -(-numel // world_size)
            start, stop = min(rank * piece, numel), min((rank + 1) * piece, numel)
            if stop > start:
                out.append(Segment(fqn, start, stop - start, dest))
            dest += piece
        return tuple(out)
    size = partition_size([n for _, n in numels], world_size, stage, paddings)
    low, high, offset = rank * size, (rank + 1) * size, 0
    for i, (fqn, numel) in enumerate(numels):
        start, stop = max(low, offset), min(high, offset + numel)
        if stop > start:
            out.append(Segment(fqn, start - offset, stop - start, start - low))
        offset += numel + (paddings[i] if i < len(paddings) else 0)
    return tuple(out)


def pieces_by_parameter(
    groups: Sequence[Sequence[tuple[str, int]]], world_size: int, stage: int, paddings: Sequence[Sequence[int]] = ()
) -> dict[str, list[Piece]]:
    """Where every parameter's elements are: name -> its pieces across ranks and groups, in the order of its flattened
    view (``paddings``: per group, stage 1/2's after each parameter, where the save lists them)."""
    out: dict[str, list[Piece]] = {}
    for g, numels in enumerate(groups):
        for rank in range(world_size):
            for s in rank_segments(numels, world_size, stage, rank, paddings[g] if g < len(paddings) else ()):
                out.setdefault(s.fqn, []).append(Piece(rank, g, s.start, s.length, s.dest))
    for pieces in out.values():
        pieces.sort(key=lambda p: p.start)
    return out


def pieces_in(pieces: Sequence[Piece], start: int, stop: int) -> list[Piece]:
    """The parts of ``pieces`` (one parameter's) that hold elements ``[start, stop)``, cut to that range."""
    out = []
    for p in pieces:
        low, high = max(start, p.start), min(stop, p.start + p.length)
        if high > low:
            out.append(Piece(p.rank, p.group, low, high - low, p.offset + low - p.start))
    return out
