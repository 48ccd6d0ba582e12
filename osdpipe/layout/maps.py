"""A model's parameters as ranges of another model's: the maps between two frameworks' names for one model, as data.

A map between Megatron's GPT and a Hugging Face model (or a torchtitan one) moves elements and computes nothing: each
element of a parameter of one side is one element of the other side's (the vocabulary's padding rows aside, which are
padding on the side that has them). So a parameter of the target model is a list of segments of the source model's
parameters (:class:`~osdpipe.layout.ranges.Segment`: a range of a source parameter's flattened view, at an offset in
the target's), the rest padding: the same model as a layout's local tensor, one level up. A reader of the source read
through the map (:class:`osdpipe.io.formats.mapped.MappedReader`) reads a range of a target parameter as the ranges of
the source's it is made of, so a conversion across frameworks reads what it copies, under a memory budget, as any
conversion does.

Pure functions: a family writes its map one way (:func:`invert` gives the other), and a map composes with another
(:func:`compose`: Megatron -> Hugging Face -> torchtitan).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from osdpipe.layout.ranges import Segment


@dataclass(frozen=True)
class Transposed:
    """Elements ``[dest, dest + rows x cols)`` of a target parameter are a block of a source parameter transposed:
    the ``rows x cols`` elements of ``fqn``'s flattened view from ``start``, in row-major order, their rows put in
    ``before`` first (``None``: as they are), then transposed, then the rows of that put in ``after``. A Conv1D of
    GPT-2 holds its weight so (``[in, out]``, where Megatron's linear holds ``[out, in]``): no run of it is a run of
    the other side's, so such a block is read whole, one parameter of one layer at a time."""

    fqn: str
    start: int
    rows: int
    cols: int
    dest: int
    before: tuple[int, ...] | None = None
    after: tuple[int, ...] | None = None

    @property
    def length(self) -> int:
        return self.rows * self.cols

    def inverse(self, target: str) -> Transposed:
        """The block the other way: the target's ``cols x rows`` elements from ``dest`` as this source block."""
        return Transposed(target, self.dest, self.cols, self.rows, self.start, _inverse(self.after),
                          _inverse(self.before))


def _inverse(order: Sequence[int] | None) -> tuple[int, ...] | None:
    if order is None:
        return None
    out = [0] * len(order)
    for i, j in enumerate(order):
        out[j] = i
    return tuple(out)


#: What an element range of a target parameter is made of: a range of a source parameter's, or a block of one
#: transposed.
Piece = Segment | Transposed
#: A map: each target parameter (by name) -> the pieces of the source's parameters it is made of, in its order.
Map = dict[str, tuple[Piece, ...]]


def invert(forward: Mapping[str, tuple[Piece, ...]]) -> Map:
    """The map the other way: each source parameter -> the pieces of the target's it went to (a source element
    that went nowhere, a padding row, is padding in the inverse)."""
    out: dict[str, list[Piece]] = {}
    for target, pieces in forward.items():
        for s in pieces:
            back = s.inverse(target) if isinstance(s, Transposed) else Segment(target, s.dest, s.length, s.start)
            out.setdefault(s.fqn, []).append(back)
    return {name: tuple(sorted(pieces, key=lambda s: s.dest)) for name, pieces in out.items()}


def read_through(pieces: tuple[Piece, ...], start: int, stop: int) -> list[Piece]:
    """Elements ``[start, stop)`` of a target parameter made of ``pieces``, as ranges of the source's parameters at
    their offset from ``start`` (what no piece holds is padding); a transposed block they cross whole, its ``dest``
    from ``start`` (negative where it begins before it: the reader takes its part)."""
    out: list[Piece] = []
    for s in pieces:
        lo, hi = max(start, s.dest), min(stop, s.dest + s.length)
        if lo >= hi:
            continue
        if isinstance(s, Transposed):
            out.append(Transposed(s.fqn, s.start, s.rows, s.cols, s.dest - start, s.before, s.after))
        else:
            out.append(Segment(s.fqn, s.start + lo - s.dest, hi - lo, lo - start))
    return out


def compose(first: Mapping[str, tuple[Piece, ...]], then: Mapping[str, tuple[Piece, ...]]) -> Map:
    """The map of ``then`` after ``first``: each parameter of ``then``'s target made of ranges of ``first``'s source
    (``then``'s segments name ``first``'s targets). Both maps are of runs alone (a transposed block composes with
    nothing here: GPT-2's map, the one that has them, is never composed)."""
    if any(isinstance(p, Transposed) for m in (first, then) for pieces in m.values() for p in pieces):
        raise ValueError("a map with transposed blocks does not compose")
    return {
        name: tuple(Segment(inner.fqn, inner.start, inner.length, outer.dest + inner.dest)
                    for outer in segments
                    for inner in read_through(first[outer.fqn], outer.start, outer.start + outer.length))
        for name, segments in then.items()
    }


def rows(name: str, first_row: int, count: int, row: int, at_row: int) -> Segment:
    """``count`` rows of ``row`` elements of parameter ``name`` from ``first_row``, at row ``at_row`` of the target."""
    return Segment(name, first_row * row, count * row, at_row * row)
