"""A source read by another model's names: each parameter of the run's model as the source ranges it is made of.

A checkpoint of one framework's model (Megatron's GPT) converts for another's (its Hugging Face or torchtitan model)
through a map (:mod:`osdpipe.layout.maps`): which ranges of which source parameters each target parameter's elements
are. :class:`MappedReader` is the source's own reader seen through that map: the stage loop asks it for a range of a
target parameter's state, as it asks any reader, and it reads the ranges of the source's that the range is made of,
no more (a transposed block, a layer's Conv1D weight, whole). So a conversion across frameworks is one more source of
the loop: under ``runtime.memory_budget``, over ``runtime.workers``, with every check.

A framework names the states differently too: :class:`ModelMap` says which source state each target state is
(Megatron's fp32 master ``param`` is a PyTorch job's weights), and which param-group keys the target's optimizer does
not take.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from osdpipe.io.formats.base import InputError, SourceMeta, SourceReader, TensorRef, read_parts
from osdpipe.layout.maps import Map, Piece, Transposed, read_through
from osdpipe.layout.ranges import Segment


@dataclass(frozen=True)
class ModelMap:
    """How a checkpoint's own model becomes the run's: the parameters' map, and the states'.

    Attributes:
        pieces: each target parameter -> the pieces of the source's it is made of (:data:`osdpipe.layout.maps.Map`).
        states: each target state -> the source state it is, for every state the target holds (``step`` included);
            a state of the source named nowhere here is not read.
        hidden: the target states read through the map but left out of the metadata: a state the target's weights
            are read from (its model part), which its optimizer does not hold.
        group_keys: the source's param-group keys the target's optimizer does not take (a Megatron scheduler's).
        model: the ``model.factory`` and ``model.kwargs`` of the checkpoint's own model, whose names the source's
            reader answers to.
        dtypes: a target state -> the dtype it is written in where that is not the source's: its elements cast as
            torch casts (round to nearest even), a Hugging Face folder's weights in the job's dtype.
        optimizer: whether the target holds an optimizer (its param groups); ``False``: its weights alone.
        state_dtype: the dtype the target keeps its floating state in where that is not its parameters' (fp32
            masters and moments beside a bf16 Megatron job's weights; a folder's weights cast): ``None``, the
            source's (:attr:`~osdpipe.io.formats.base.SourceMeta.state_dtype`).
    """

    pieces: Map
    states: Mapping[str, str]
    model: tuple[str, dict[str, Any]]
    hidden: tuple[str, ...] = ()
    group_keys: tuple[str, ...] = field(default=())
    dtypes: Mapping[str, str] = field(default_factory=dict)
    optimizer: bool = True
    state_dtype: str | None = None
    #: What the run warns where the source holds one param group for every parameter and the target's job groups them
    #: otherwise (Megatron's two groups: no weight decay for the 1-D norms); ``None``: nothing to say.
    one_group: str | None = None

    def members(self, group: Iterable[str], targets: Iterable[str]) -> list[str]:
        """The parameters of ``targets`` (in their order) a param group of the source's (its parameters' names) holds
        in the target: each where its first piece is read from (a fused parameter's parts are in one group)."""
        held = set(group)
        return [t for t in targets if self.pieces[t][0].fqn in held]


class MappedReader:
    """``reader`` (keyed by the source model's names) read by the target model's: a
    :class:`~osdpipe.io.formats.base.SourceReader` of the target's parameters (``shapes``), through ``mapping``."""

    def __init__(self, reader: SourceReader, mapping: ModelMap, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.reader, self.mapping, self.shapes = reader, mapping, dict(shapes)
        missing = sorted(set(shapes) - set(mapping.pieces))
        if missing:
            raise InputError(f"the map of {mapping.model[0]} to the run's model holds no {missing[0]} "
                             f"({len(missing)} parameters): the run's model is not the one the checkpoint converts to")
        self._dtypes: dict[str, torch.dtype] = {}
        self._block: tuple[tuple[str, str, int], torch.Tensor] | None = None

    def meta(self) -> SourceMeta:
        inner = self.reader.meta()
        if inner.names:
            raise InputError(f"{next(iter(inner.names.values()))}: a checkpoint read through another model's names "
                             "keeps its parameters under their own; re-save it without a wrapper's prefix")
        listed = {t: s for t, s in self.mapping.states.items() if t not in self.mapping.hidden}
        state: dict[str, dict[str, Any]] = {}
        for target in self.shapes:  # in the run's model's order
            held = inner.state.get(self.mapping.pieces[target][0].fqn)
            if held is None:  # a parameter the optimizer never stepped: no state of its own, weights aside
                continue
            state[target] = {t: self._described(target, t, held[s]) for t, s in listed.items() if s in held}
        groups = None
        if inner.param_groups is not None and self.mapping.optimizer:
            groups = []
            for group in inner.param_groups:
                members = set(group["params"])
                kept = {k: v for k, v in group.items() if k not in self.mapping.group_keys}
                groups.append({**kept, "params": self.mapping.members(members, self.shapes)})
        notes = list(inner.notes)
        if self.mapping.one_group is not None and groups is not None and len(groups) == 1:
            notes.append(self.mapping.one_group)
        return SourceMeta(state=state, param_groups=groups, extra=inner.extra, buffers=inner.buffers,
                          carried=inner.carried, notes=notes,
                          state_dtype=self.mapping.state_dtype or inner.state_dtype)

    def _described(self, target: str, name: str, value: Any) -> Any:
        """A source state's description as state ``name`` of the target parameter ``target``: its shape, the source's
        dtype or the one it is cast to."""
        if torch.is_tensor(value) and value.dim() > 0:
            value = TensorRef(tuple(value.shape), str(value.dtype).removeprefix("torch."))
        if isinstance(value, TensorRef):
            return TensorRef(self.shapes[target], self.mapping.dtypes.get(name, value.dtype))
        return value

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        out = {}
        for fqn, name in items:
            numel = _numel(self.shapes[fqn])
            parts = self.read_parts(fqn, name, 0, numel)
            out[(fqn, name)] = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(self.shapes[fqn])
        return out

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        parts = self.read_parts(fqn, name, start, stop)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_parts(self, fqn: str, name: str, start: int, stop: int) -> list[torch.Tensor]:
        """Elements ``[start, stop)`` of ``fqn``'s state ``name`` as the source's ranges it is made of, in order
        (what no piece holds, a padding row, as zeros)."""
        source = self.mapping.states.get(name, name)
        out: list[torch.Tensor] = []
        at, length = 0, stop - start
        for piece in read_through(self.mapping.pieces[fqn], start, stop):
            lo = max(piece.dest, 0)
            if lo > at:
                out.append(self._zeros(fqn, source, lo - at))
            if isinstance(piece, Transposed):
                hi = min(piece.dest + piece.length, length)
                out.append(self._transposed(piece, source)[lo - piece.dest: hi - piece.dest])
                at = hi
            else:
                out += read_parts(self.reader, piece.fqn, source, piece.start, piece.start + piece.length)
                at = piece.dest + piece.length
        if at < length:
            out.append(self._zeros(fqn, source, length - at))
        if name in self.mapping.dtypes:
            cast = getattr(torch, self.mapping.dtypes[name])
            return [part.to(cast) for part in out]
        return out

    def _transposed(self, block: Transposed, source: str) -> torch.Tensor:
        """A transposed block, read whole and laid out as the target holds it, flattened; the last one is kept, as
        the ranges of one target parameter cross it one after another."""
        key = (block.fqn, source, block.start)
        if self._block is not None and self._block[0] == key:
            return self._block[1]
        parts = read_parts(self.reader, block.fqn, source, block.start, block.start + block.length)
        held = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(block.rows, block.cols)
        if block.before is not None:
            held = held[list(block.before)]
        held = held.t()
        if block.after is not None:
            held = held[list(block.after)]
        flat = held.contiguous().reshape(-1)
        self._block = (key, flat)
        return flat

    def _zeros(self, fqn: str, source: str, count: int) -> torch.Tensor:
        """``count`` padding elements of target parameter ``fqn``'s state (source state ``source``): zeros, as the
        framework pads, in the dtype of the source's state (one element of it read to learn it)."""
        if source not in self._dtypes:
            first = self.mapping.pieces[fqn][0]
            self._dtypes[source] = read_parts(self.reader, first.fqn, source, first.start, first.start + 1)[0].dtype
        return torch.zeros(count, dtype=self._dtypes[source])

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        source = self.mapping.states.get(name, name)
        for piece in _segments(self.mapping.pieces[fqn], start, stop):
            self.reader.release(piece.fqn, source, piece.start, piece.start + piece.length)
        self._block = None

    def expect(self, reads: Iterable[tuple[str, str, int, int]]) -> None:
        from osdpipe.io.formats.base import expect

        expect(self.reader, [(p.fqn, self.mapping.states.get(name, name), p.start, p.start + p.length)
                             for fqn, name, start, stop in reads
                             for p in _segments(self.mapping.pieces[fqn], start, stop)])


def _segments(pieces: tuple[Piece, ...], start: int, stop: int) -> list[Segment]:
    """The source ranges elements ``[start, stop)`` of a target parameter read: a transposed block whole."""
    return [p if isinstance(p, Segment) else Segment(p.fqn, p.start, p.length, 0)
            for p in read_through(pieces, start, stop)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
