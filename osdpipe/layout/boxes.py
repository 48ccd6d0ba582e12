"""Boxes: a rank's piece of a tensor as a ``[start, stop)`` range per dimension, and where pieces meet.

Every sharding seen so far leaves each rank a box of the whole tensor: FSDP2
keeps a ``torch.chunk`` of dimension 0; tensor parallelism keeps a chunk of
one dimension (rows for a colwise weight, columns for a rowwise one); DCP's
chunk metadata are boxes too. On a 2-D mesh the cuts nest: TP cuts the whole
tensor first, then FSDP2 cuts dimension 0 of TP's piece, so a rank's box is
the dp-th chunk of the tp-th chunk, not the ``dp * tp_size + tp``-th chunk of
the tensor (PyTorch prints the outer one ``_StridedShard``). Uneven sizes
follow ``torch.chunk`` at each level: 33 rows over tp=2 are 17 + 16, and
each part is then chunked over dp. FSDP1 keeps ranges of the flattened
tensor instead; :func:`flat_runs` and :func:`flat_overlap` meet a box with
those.

Pure functions of shapes and indices: no torch, no process group.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, product
from typing import Any

#: One ``[start, stop)`` range per dimension of a tensor.
Box = tuple[tuple[int, int], ...]


def chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """The range ``torch.chunk`` gives piece ``index`` of ``parts`` over ``size`` elements
    (empty past the last piece it makes).

    ``torch.chunk`` cuts pieces of ``ceil(size / parts)``, so 10 over 4 is
    3, 3, 3, 1 and 5 over 4 is 2, 2, 1 and an empty fourth.
    """
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


@dataclass(frozen=True)
class Cut:
    """One level of sharding: dimension ``dim`` split into ``parts`` as ``torch.chunk`` splits it;
    the rank keeps piece ``index``."""

    dim: int
    parts: int
    index: int


def whole(shape: Sequence[int]) -> Box:
    """The box of the whole tensor."""
    return tuple((0, n) for n in shape)


def local_box(shape: Sequence[int], cuts: Sequence[Cut]) -> Box:
    """The box a rank keeps of a tensor of ``shape`` after ``cuts``,
    each applied to the piece the ones before it left."""
    box = list(whole(shape))
    for cut in cuts:
        lo, hi = box[cut.dim]
        start, stop = chunk(hi - lo, cut.parts, cut.index)
        box[cut.dim] = (lo + start, lo + stop)
    return tuple(box)


def mesh_coordinates(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Rank ``rank``'s index along each mesh dimension:
    meshes number their ranks row-major, the last dimension fastest."""
    coords = []
    for size in reversed(mesh_shape):
        rank, index = divmod(rank, size)
        coords.append(index)
    return tuple(reversed(coords))


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` hold, or ``None`` when they share no element."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def flat_runs(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """The elements of ``box`` as ranges of the row-major flattened tensor, in order, each as long as it can be.

    The trailing dimensions the box spans whole are one run per index of the
    dimensions before them; runs that touch are merged.
    """
    if not shape:
        return [(0, 1)]
    if volume(box) == 0:
        return []
    inner = len(shape)  # the dimensions from `inner` on are spanned whole: their elements are contiguous
    while inner > 0 and box[inner - 1] == (0, shape[inner - 1]):
        inner -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    if inner == 0:
        return [(0, math.prod(shape))]
    # the innermost dimension the box cuts: each of its ranges is a run (with the whole dimensions after it)
    last = inner - 1
    length = (box[last][1] - box[last][0]) * strides[last]
    runs: list[tuple[int, int]] = []
    for outer in product(*(range(start, stop) for start, stop in box[:last])):
        begin = sum(i * s for i, s in zip(outer, strides)) + box[last][0] * strides[last]
        if runs and runs[-1][1] == begin:
            runs[-1] = (runs[-1][0], begin + length)
        else:
            runs.append((begin, begin + length))
    return runs


def flat_overlap(shape: Sequence[int], box: Box, start: int, stop: int) -> list[tuple[int, int]]:
    """The elements of ``box`` that the flat range ``[start, stop)`` of the tensor also holds,
    as flat ranges (an FSDP1 segment against a box): :func:`flat_runs` cut to the range.

    Only the box's runs the range reaches are walked (a dimension's indices outside it are skipped by arithmetic): a
    short range of a column block of a large weight costs its few rows, not the block's every row.
    """
    if not shape or volume(box) == 0 or start >= stop:
        return [] if shape or start >= stop else [(0, 1)][: int(start <= 0 < stop)]
    inner = len(shape)
    while inner > 0 and box[inner - 1] == (0, shape[inner - 1]):
        inner -= 1
    if inner == 0:
        lo, hi = max(0, start), min(math.prod(shape), stop)
        return [(lo, hi)] if lo < hi else []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    last = inner - 1
    first, length = box[last][0] * strides[last], (box[last][1] - box[last][0]) * strides[last]
    out: list[tuple[int, int]] = []

    def walk(dim: int, offset: int) -> None:
        if dim == last:
            lo, hi = max(offset + first, start), min(offset + first + length, stop)
            if lo < hi:
                if out and out[-1][1] == lo:
                    out[-1] = (out[-1][0], hi)
                else:
                    out.append((lo, hi))
            return
        step = strides[dim]
        for i in range(max(box[dim][0], (start - offset) // step), min(box[dim][1], (stop - 1 - offset) // step + 1)):
            walk(dim + 1, offset + i * step)

    walk(0, 0)
    return out


class BoxSpans:
    """Boxes of one tensor of ``shape`` (each with what it stands for), found by the flat ranges they reach: each box
    spans its tensor's flattened view from its first element to its last, and the boxes are kept sorted by where
    that span starts, so the ones a range reaches are found by bisection, not by looking at every box (a Megatron
    bucket's chunks: a hundred and more; a column-split weight's blocks: one a layer and TP rank)."""

    def __init__(self, shape: Sequence[int], boxes: Iterable[tuple[Box, Any]]) -> None:
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        spans = []
        for box, held in boxes:
            first = sum(lo * s for (lo, _), s in zip(box, strides))
            last = sum((hi - 1) * s for (_, hi), s in zip(box, strides))
            spans.append((first, last + 1, box, held))
        spans.sort(key=lambda span: span[0])
        self._starts = [span[0] for span in spans]
        self._spans = spans
        self._reach = list(accumulate((span[1] for span in spans), max))  # the furthest any span up to each reaches

    def reaching(self, start: int, stop: int) -> list[tuple[Box, Any]]:
        """``(box, what it stands for)`` of each box whose span meets ``[start, stop)``, by where it starts."""
        out = []
        i = bisect_left(self._starts, stop) - 1
        while i >= 0 and self._reach[i] > start:
            first, end, box, held = self._spans[i]
            if end > start:
                out.append((box, held))
            i -= 1
        out.reverse()
        return out


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """The slices that take box ``inner`` out of a tensor holding box ``outer`` (``inner`` within it)."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(inner, outer, strict=True))


def range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The flat range ``[start, stop)`` of a tensor of ``shape`` as boxes, in order, each one contiguous run of the
    flattened tensor: a partial row block at each end, whole ones between (at most two a dimension, and one).

    So a range can be copied box by box with N-d slicing, however many rows of a column block it crosses.
    """
    if not shape:
        return [()] if start <= 0 < stop else []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    start, stop = max(0, start), min(stop, math.prod(shape))
    out: list[Box] = []

    def cut(dim: int, prefix: Box, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` of the sub-tensor ``prefix`` fixes (offsets within it)."""
        if lo >= hi:
            return
        rest = tuple((0, n) for n in shape[dim + 1 :])
        step = strides[dim]
        if lo % step == 0 and hi % step == 0:
            out.append((*prefix, (lo // step, hi // step), *rest))
            return
        first, last = lo // step, (hi - 1) // step
        if first == last:
            cut(dim + 1, (*prefix, (first, first + 1)), lo - first * step, hi - first * step)
            return
        whole_from = first
        if lo % step:
            cut(dim + 1, (*prefix, (first, first + 1)), lo - first * step, step)
            whole_from = first + 1
        whole_to = hi // step
        if whole_from < whole_to:
            out.append((*prefix, (whole_from, whole_to), *rest))
        if hi % step:
            cut(dim + 1, (*prefix, (whole_to, whole_to + 1)), 0, hi - whole_to * step)

    cut(0, (), start, stop)
    return out


_SHARD = re.compile(r"S\((\d+)\)")
_STRIDED = re.compile(r"_S\((\d+), (\d+)\)")


def parse_placement(text: str) -> tuple[int | None, int | None]:
    """``(dim, split_factor)`` of a placement as ``str()`` writes PyTorch's:
    ``"R"`` is ``(None, None)``, ``"S(1)"`` is ``(1, None)``, ``"_S(0, 2)"`` is ``(0, 2)``.

    Raises:
        ValueError: for a placement that holds no box of the tensor (``P(sum)``, a partial sum) or one not recognized.
    """
    if text == "R":
        return None, None
    if shard := _SHARD.fullmatch(text):
        return int(shard[1]), None
    if strided := _STRIDED.fullmatch(text):
        return int(strided[1]), int(strided[2])
    raise ValueError(f"placement {text!r} holds no box of the tensor; only S(d), _S(d, f) and R do")


def placement_cuts(placements: Sequence[str], mesh_shape: Sequence[int], coords: Sequence[int]) -> tuple[Cut, ...]:
    """The cuts a DTensor's placements make, for the rank at mesh ``coords``, in the order they apply.

    ``placements`` are written as ``str()`` writes PyTorch's (``"S(0)"``,
    ``"R"``, ``"_S(0, 2)"``), one per mesh dimension, outermost first. A
    plain shard cuts in mesh order: the outer mesh dimension's chunk first,
    then the inner one's chunk of it. A strided shard (``_S(dim, factor)``)
    is the outer shard of a tensor an inner mesh dimension cut first (FSDP2
    over TP): it applies after the inner cuts of the same tensor dimension,
    whose sizes multiply to ``factor``.

    Raises:
        ValueError: for a placement that holds no box of the tensor (``P(sum)``, a partial sum), one not recognized,
            or a strided shard whose factor the inner cuts do not make.
    """
    now: list[Cut] = []
    later: list[Cut] = []
    for mesh_dim, (text, size, index) in enumerate(zip(placements, mesh_shape, coords, strict=True)):
        try:
            dim, factor = parse_placement(text)
        except ValueError as exc:
            raise ValueError(f"{exc} (mesh dimension {mesh_dim})") from None
        if dim is None:
            continue
        if factor is None:
            now.append(Cut(dim, size, index))
            continue
        inner = math.prod(s for p, s in zip(placements[mesh_dim + 1 :], mesh_shape[mesh_dim + 1 :]) if p == f"S({dim})")
        if inner != factor:
            raise ValueError(
                f"placement {text} on mesh dimension {mesh_dim}: "
                f"the inner mesh dimensions cut dim {dim} into {inner} piece(s), not {factor}"
            )
        later.append(Cut(dim, size, index))
    return (*now, *later)


def box_range_runs(shape: Sequence[int], box: Box, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Elements ``[start, stop)`` of ``box`` taken in its own row-major order (a local tensor that is the box), as
    runs of the whole tensor's flattened view: ``(tensor start, length, offset from start)`` each, in order."""
    out, at = [], 0
    for run_start, run_stop in flat_runs(shape, box):
        length = run_stop - run_start
        lo, hi = max(start, at), min(stop, at + length)
        if lo < hi:
            out.append((run_start + lo - at, hi - lo, lo - start))
        at += length
        if at >= stop:
            break
    return out
