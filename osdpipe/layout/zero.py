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

from osdpipe.layout.flat_buffer import FlatBuffer, Held, held_by, pack, rank_slice, segments
from osdpipe.layout.ranges import Segment

#: ZeRO 1/2 pads each group's flat buffer to a multiple of this many times the world size.
STAGE12_ALIGNMENT = 2


def group_buffers(numels: Sequence[tuple[str, int]], world_size: int, stage: int, paddings: Sequence[int] = ()
                  ) -> list[FlatBuffer]:
    """One group's flat buffers (:mod:`osdpipe.layout.flat_buffer`), each cut into ``world_size`` equal slices: stage
    1/2's one, of the group's parameters with the padding after each and the end padded to a multiple of
    :data:`STAGE12_ALIGNMENT` x ``world_size``; stage 3's one per parameter, padded to a multiple of ``world_size``
    (a rank's partition is its slice of each, one after another)."""
    if stage == 3:
        return [pack([entry], multiple=world_size) for entry in numels]
    return [pack(numels, gaps=paddings, multiple=STAGE12_ALIGNMENT * world_size)]


def partition_size(numels: Sequence[int], world_size: int, stage: int, paddings: Sequence[int] = ()) -> int:
    """How many elements each rank's partition of a group of parameters of ``numels`` holds, padding included
    (``paddings``: stage 1/2's after each parameter, where the save lists them)."""
    named = [(str(i), n) for i, n in enumerate(numels)]
    return sum(b.numel // world_size for b in group_buffers(named, world_size, stage, paddings))


def saved_lengths(
    numels: Sequence[int], world_size: int, stage: int, rank: int, paddings: Sequence[int] = ()
) -> tuple[int, int]:
    """How many elements rank ``rank``'s file holds of a group's partition: the moments
    (padding included), and the fp32 master weights, which stage 1/2 save without the
    group's padding at the end (stage 3, and DeepSpeed's bf16 optimizer, with it)."""
    size = partition_size(numels, world_size, stage, paddings)
    if stage == 3:
        return size, size
    (buffer,) = group_buffers([(str(i), n) for i, n in enumerate(numels)], world_size, stage, paddings)
    return size, min(size, max(0, buffer.data_end - rank * size))


def rank_segments(
    numels: Sequence[tuple[str, int]], world_size: int, stage: int, rank: int, paddings: Sequence[int] = ()
) -> tuple[Segment, ...]:
    """Rank ``rank``'s partition of one group (``numels``: each parameter's name and numel, in ``param_shapes`` order;
    ``paddings``: stage 1/2's after each parameter), as segments: its slice of each of the group's buffers, one
    after another."""
    out: list[Segment] = []
    dest = 0
    for buffer in group_buffers(numels, world_size, stage, paddings):
        start, stop, size = rank_slice(buffer, world_size, rank)
        out += [Segment(s.fqn, s.start, s.length, s.dest + dest) for s in segments(buffer, start, stop)]
        dest += size
    return tuple(out)


def pieces_by_parameter(
    groups: Sequence[Sequence[tuple[str, int]]], world_size: int, stage: int, paddings: Sequence[Sequence[int]] = ()
) -> dict[str, list[Held]]:
    """Where every parameter's elements are: name -> its pieces, each held in ``(rank, group)``'s partition, in the
    order of its flattened view (``paddings``: per group, stage 1/2's after each parameter, where the save lists
    them)."""
    return held_by(
        ((rank, g), rank_segments(numels, world_size, stage, rank, paddings[g] if g < len(paddings) else ()))
        for g, numels in enumerate(groups)
        for rank in range(world_size)
    )
