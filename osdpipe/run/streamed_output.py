"""A rank's output made as it is written, so that ``runtime.memory_budget`` bounds everything a rank holds.

Without it, shard fills every state tensor of a rank, verify compares them
with the source and save writes them: the rank holds its whole output from
shard to save, whatever the budget (12.5 GB a rank for 25 GB of Adam state
converted 4 -> 2). When nothing between shard and save needs those bytes in
memory (:func:`why_held` says when), shard leaves each state tensor a
*placeholder* instead: anonymous memory that is mapped but never touched, so
it reads as zeros and holds no pages. Save then writes the rank's files as
always, and :mod:`osdpipe.io.torchfile` asks this module for a placeholder's
bytes as it reaches its record (:meth:`StreamedOutput.windows`). Batch by
batch, in the plan shard would have filled it by, the placeholder is filled
from the source, compared with the source's bytes as ``roundtrip`` compares
them (the same function; the bytes read for the copy, still mapped or in
memory, so the disk is read once), looked through for NaN and Inf, handed to
the file, and its pages let go (``MADV_DONTNEED``: they read as zeros again).

A rank then holds one batch of its output at a time, at most half the budget,
beside the reader's piece: the budget, output included. The bytes written are
those the in-memory path writes (the same records, the same file), and the
failures are the same ones (a roundtrip difference or NaN in the source fails
the run; nothing is committed), found during save instead of before it.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.core.compare import differing_segments, nonfinite_segments
from osdpipe.core.sizes import show_size
from osdpipe.io.formats import SourceMeta, TensorRef, own_copy
from osdpipe.io.torchfile import placeholder
from osdpipe.layout.ranges import LocalTensor, Segment
from osdpipe.run import progress
from osdpipe.run.transfer import Batch, Source, place

if TYPE_CHECKING:
    from osdpipe.run.context import Context
    from osdpipe.run.products import Described

#: The checks that can run on a rank's output while it is written: ``roundtrip`` compares batch by batch.
#: Every other check steps an optimizer over the state, or hashes it, and needs it in memory.
STREAMING_CHECKS = ("roundtrip",)


def why_held(ctx: Context, source: Described) -> str | None:
    """Why this rank must hold its whole output in memory from shard to save
    (``None``: it can be made as it is written).

    Asked only under ``runtime.memory_budget``. Each reason names what to
    change, for the warning a large output gets (:func:`held_warning`).
    """
    stages = ctx.plan.stages
    if "save" not in stages:
        return "no save stage writes it: the state itself is the result"
    if not source.reads_itself(ctx.rank):
        return (
            "its ranges are sent to it (runtime.transfer=scatter), in the order its reading rank sends them; "
            "runtime.transfer=shared reads them as they are written"
        )
    if ctx.plan.checkpoint.whole and not ctx.plan.output_checkpoint.made_as_written:
        return (
            f"a whole checkpoint ({ctx.plan.output_checkpoint.name}) is written "
            "with its model weights beside the optimizer's state"
        )
    if not ctx.output_format.writes(ctx.rank):
        return (
            f"output.format={ctx.output_format.name} is written by rank 0 alone, "
            "and this rank's copy is checked in memory"
        )
    if not ctx.output_format.made_as_written:
        return f"output.format={ctx.output_format.name} is written from memory"
    needing = [name for name in ctx.spec.pipeline.checks if name not in STREAMING_CHECKS] if "verify" in stages else []
    if needing:
        return (
            f"check(s) {', '.join(needing)} need it in memory; "
            f"pipeline.checks=[{', '.join(STREAMING_CHECKS)}] writes it as it is made"
        )
    return None


def held_warning(why: str, budget: int) -> str:
    """The warning for a rank that holds an output larger than the budget, and why:
    one line, the same for every rank (``report.json``'s ``output_bytes`` says how much each held)."""
    return f"a rank held its whole output in memory, more than runtime.memory_budget={show_size(budget)}: {why}"


@dataclass
class _Placeholder:
    """One state tensor of the output, not yet filled:
    its layout tensor, state name, flat memory and the batches that fill it."""

    tensor: LocalTensor
    name: str
    flat: torch.Tensor
    region: mmap.mmap | None
    work: list[Batch]


class StreamedOutput:
    """This rank's placeholders and how to fill them: a :class:`osdpipe.io.torchfile.Filler` for save.

    ``compare``: run ``roundtrip``'s comparison on each batch as it is
    filled. What the windows found is kept for save to act on once the files
    are written: ``differences`` (roundtrip's) and ``nonfinite`` (NaN and Inf
    in the source, as shard names them).
    """

    def __init__(self, source: Source, *, compare: bool) -> None:
        self.source, self.compare = source, compare
        self._pending: dict[int, _Placeholder] = {}
        self._split: dict[int, _Placeholder] = {}  # placeholders written as their parts (:meth:`part`)
        self._parts: dict[tuple[int, int, int], torch.Tensor] = {}
        self._written: progress.Counter | None = None  # placeholders written, on the progress line
        self._told = False  # whether the reader was told every batch the windows will read (_fetch_ahead)
        self.differences: list[str] = []
        self.nonfinite: list[str] = []
        self.filled = 0  # bytes copied from the source

    def allocate(
        self, tensor: LocalTensor, entry: dict[str, Any], meta: SourceMeta, work: list[Batch]
    ) -> dict[str, Any]:
        """The state of ``tensor`` as shard hands it on:
        scalars copied, each tensor a placeholder that :meth:`windows` fills."""
        out: dict[str, Any] = {}
        for name, value in entry.items():
            if not isinstance(value, TensorRef):
                out[name] = own_copy(value)
                continue
            flat, region = placeholder(tensor.numel, value.torch_dtype)
            self._pending[flat.untyped_storage()._cdata] = _Placeholder(
                tensor, name, flat, region, [b for b in work if b.name == name]
            )
            out[name] = flat.view(tensor.shape)
        return out

    def holds(self, state: dict[str, Any], name: str) -> bool:
        """Whether ``state[name]`` is a placeholder not yet written (its bytes are not in memory to check)."""
        value = state.get(name)
        return torch.is_tensor(value) and self.fills(value.untyped_storage())

    @property
    def unwritten(self) -> list[str]:
        """The placeholders no file has been written from: ``<layout key>.<state name>``."""
        return [f"{p.tensor.key}.{p.name}" for p in self._pending.values()]

    def fills(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._pending

    def part(self, flat: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        """Elements ``[start, stop)`` of the placeholder ``flat`` as a placeholder of its own, filled by the batches of
        ``flat``'s that go there (cut to the range); ``flat`` is then written as its parts alone, never whole. The same
        range asked again is the same placeholder (a writer that looks at what it wrote, for its digests); ``None``:
        ``flat`` is no placeholder of this output's."""
        held = flat.untyped_storage()._cdata
        if held not in self._pending and held not in self._split:
            return None
        if (held, start, stop) in self._parts:
            return self._parts[(held, start, stop)]
        whole = self._split[held] = self._pending.pop(held, None) or self._split[held]
        work = [Batch(b.name, b.dtype, cut) for b in whole.work if (cut := _within(b.segments, start, stop))]
        part, region = placeholder(stop - start, whole.flat.dtype)
        self._pending[part.untyped_storage()._cdata] = _Placeholder(
            replace(whole.tensor, key=f"{whole.tensor.key}[{start}:{stop}]"), whole.name, part, region, work)
        self._parts[(held, start, stop)] = part
        return part

    def windows(self, storage: torch.UntypedStorage) -> Iterator[memoryview]:
        """The placeholder's bytes, front to back:
        up to the end of each batch once it is filled and checked, then the zeros after the last.

        Its pages are let go once each window has been written (the caller
        asks for the next only then).
        """
        if self._written is None:
            self._written = progress.Counter(len(self._pending))
        p = self._pending.pop(storage._cdata)
        self._fetch_ahead(p)
        size = p.flat.element_size()
        data = memoryview(p.region) if p.region is not None else memoryview(b"")
        label = f"{p.tensor.key}.{p.name}"
        written = 0  # elements handed to the file
        for batch in p.work:
            first, last = batch.segments[0], batch.segments[-1]
            if bool(p.flat[written : first.dest].any()):
                self.differences.append(
                    f"{label}: holds non-zero elements where no source state goes (before flat {first.dest})"
                )
            stored, pieces = self.source.parts(batch)
            place(p.flat, stored, pieces)
            if self.compare:
                self.differences += differing_segments(label, p.flat, stored.segments, pieces)
            self.source.done(batch)
            del stored, pieces  # a piece read as a copy of its own (a column block's rows) goes before the next read
            self.filled += batch.numel * batch.dtype.itemsize
            self.nonfinite += nonfinite_segments(p.name, p.flat, batch.segments)
            end = last.dest + last.length
            yield data[written * size : end * size]
            _let_go(p.region, written * size, end * size)  # everything before ``end`` is written
            written = end
        if bool(p.flat[written:].any()):
            self.differences.append(
                f"{label}: holds non-zero elements where no source state goes (after flat {written})"
            )
        yield data[written * size :]
        _let_go(p.region, written * size, len(data))
        self._written.advance()
        if not self._pending:
            self._written.finish()
            self.close()

    def _fetch_ahead(self, first: _Placeholder) -> None:
        """Tell the reader, once, every batch the windows will read: ``first``'s, then the other placeholders' in the
        order shard allocated them (the order the writers ask for them).

        A source in object storage then fetches them ahead, several requests at once and neighbours as one,
        within half the budget (:class:`osdpipe.io.remote_input.Prefetch`), instead of one request per piece, each
        waited for. A window asked for out of that order is still read, on its own. Local readers ignore it.
        """
        if not self._told:
            self._told = True
            self.source.expect([*first.work, *(b for q in self._pending.values() for b in q.work)])

    def close(self) -> None:
        """Let go of what was fetched ahead and not read (a save that failed part way)."""
        if self._told:
            self._told = False
            self.source.expect([])


def _within(segments: tuple[Segment, ...], start: int, stop: int) -> tuple[Segment, ...]:
    """The parts of ``segments`` (of a flat tensor) that fall in ``[start, stop)``, their ``dest`` from ``start``."""
    out = []
    for s in segments:
        lo, hi = max(start, s.dest), min(stop, s.dest + s.length)
        if lo < hi:
            out.append(Segment(s.fqn, s.start + lo - s.dest, hi - lo, lo - start))
    return tuple(out)


def _let_go(region: mmap.mmap | None, start: int, end: int) -> None:
    """Give the pages of ``region[start:end]`` back to the kernel,
    the one ``start`` falls in too (what lies before it is written); they read as zeros again."""
    if region is None:
        return
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    hi = end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        region.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
