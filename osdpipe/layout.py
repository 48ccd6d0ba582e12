"""Pure layout math: where every element of every parameter lives on every rank.

A *layout* says, for each rank, which local tensors its optimizer holds and,
for each local tensor, which contiguous ranges of which parameters' flattened
views it is made of (*segments*), with zero padding everywhere else. Every
layout in scope (FSDP1 flat parameters with or without ``use_orig_params``,
NO_SHARD, whole parameters, dim-0 chunks) is a list of such segments, so any
conversion is one generic copy: for each target segment, read the same range
from the source.

Nothing here touches ``torch.distributed`` or a file: a layout is computed from
the :class:`~osdpipe.tree.ModuleTree` of a ``meta`` model, the wrapping and the
world size. Tests hold these functions against the ``FlatParameter`` metadata
of real FSDP.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Literal

from osdpipe.tree import ModuleTree, ParamInfo

Kind = Literal["fsdp1", "none"]
ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]

#: FSDP1 with ``use_orig_params=True`` starts every parameter at an address
#: aligned to this many bytes (a TorchInductor requirement).
ALIGNMENT_BYTES = 16
FLAT_PARAM = "_flat_param"


@dataclass(frozen=True)
class LayoutSpec:
    """How a model is wrapped: everything that decides its layout."""

    kind: Kind = "fsdp1"
    world_size: int = 1
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    use_orig_params: bool = False
    wrap: tuple[str, ...] = ()
    wrap_root: bool = True

    @property
    def shards(self) -> bool:
        """Whether flat parameters are cut across ranks."""
        return self.kind == "fsdp1" and self.sharding_strategy != "NO_SHARD" and self.world_size > 1


@dataclass(frozen=True)
class Segment:
    """``length`` elements of parameter ``fqn``'s flattened view from ``start``, at ``dest`` in the local tensor."""

    fqn: str
    start: int
    length: int
    dest: int


@dataclass(frozen=True)
class LocalTensor:
    """One tensor of a rank's optimizer, and what it is made of.

    Attributes:
        key: the name of the optimizer's parameter: a parameter FQN, or
            ``<unit>._flat_param`` for an FSDP1 flat parameter.
        fqns: every original parameter the tensor stands for, in flat order,
            also those with no element on this rank; their optimizer state is
            flattened together and must agree in scalar state.
        shape: the local tensor's shape (1-D for flat shards).
        segments: where its elements come from; the rest is padding.
        flat: whether its state is flat (1-D) rather than parameter-shaped.
    """

    key: str
    fqns: tuple[str, ...]
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    flat: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def has_elements(self) -> bool:
        """Whether this rank holds any element (an empty ``use_orig_params`` shard holds none, and no state)."""
        return self.numel > 0


@dataclass(frozen=True)
class FlatParamLayout:
    """The unsharded flat parameter of one FSDP1 unit.

    ``entries`` are ``(fqn or None for padding, numel)`` in flat order, as
    FlatParameter's ``_fqns`` interleaved with ``_numels_with_padding``.
    """

    unit: str
    fqns: tuple[str, ...]
    entries: tuple[tuple[str | None, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.entries)


def chunk_bounds(total: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s chunk of ``total`` elements as ``torch.chunk`` cuts it.

    Returns ``(start, end, chunk_size)``: the rank holds ``[start, end)`` padded
    to ``chunk_size``. ``torch.chunk`` makes chunks of ``ceil(total / ws)``, so
    trailing ranks may hold fewer elements, or none.
    """
    chunk = -(-total // world_size) if total else 0
    start = min(rank * chunk, total)
    return start, min(start + chunk, total), chunk


def dim0_chunk_bounds(shape: tuple[int, ...], world_size: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s dim-0 chunk of a tensor, as a range of its flattened view.

    Returns ``(start, end, rows)`` in elements, and the number of rows held.
    """
    if not shape:
        return (0, 1, 1) if rank == 0 else (0, 0, 0)
    row = 1
    for d in shape[1:]:
        row *= d
    first, last, _ = chunk_bounds(shape[0], world_size, rank)
    return first * row, last * row, last - first


def _matches(name: str, cls: str, wrap: tuple[str, ...]) -> bool:
    return cls in wrap or name in wrap


def wrapped_modules(tree: ModuleTree, spec: LayoutSpec) -> tuple[str, ...]:
    """FQNs of the modules that become FSDP units, in pre-order (the root is ``""``)."""
    units = [name for name, cls in tree.modules if (name == "" and spec.wrap_root) or _matches(name, cls, spec.wrap)]
    unknown = set(spec.wrap) - {n for n, _ in tree.modules} - {c for _, c in tree.modules}
    if unknown:
        raise ValueError(
            f"wrap names {sorted(unknown)} match no module class or module FQN of the model; "
            f"classes are {sorted({c for _, c in tree.modules})}"
        )
    return tuple(units)


def _nearest_unit(module: str, units: set[str]) -> str | None:
    while True:
        if module in units:
            return module
        if not module:
            return None
        module = module.rpartition(".")[0]


def unit_of(tree: ModuleTree, spec: LayoutSpec) -> dict[str, str | None]:
    """Map each canonical parameter FQN to the unit that flattens it (``None``: not managed by FSDP).

    A parameter belongs to its nearest wrapped ancestor module. A tied parameter
    must land in one unit under all its names, as FSDP1 requires.
    """
    units = set(wrapped_modules(tree, spec))
    out: dict[str, str | None] = {}
    for p in tree.params:
        owners = {_nearest_unit(o, units) for o in (p.owner, *p.alias_owners)}
        if len(owners) > 1:
            # FSDP1 flattens a tied parameter into the unit wrapped first; if its
            # names lie in different units, the other unit sees a stale view.
            raise ValueError(
                f"tied parameter {p.fqn} (also {', '.join(p.aliases)}) spans FSDP units "
                f"{sorted(repr(u) for u in owners)}; wrap its users in one unit"
            )
        out[p.fqn] = owners.pop()
    return out


def flat_param_layouts(tree: ModuleTree, spec: LayoutSpec) -> tuple[FlatParamLayout, ...]:
    """The unsharded flat parameter of every unit, in pre-order of the units.

    Parameters are flattened in ``named_parameters()`` order of the unit, tied
    ones once. With ``use_orig_params`` each parameter starts aligned to
    :data:`ALIGNMENT_BYTES` and the total is padded to a multiple of the world
    size; without it there is no padding until sharding.
    """
    owner = unit_of(tree, spec)
    out = []
    for unit in wrapped_modules(tree, spec):
        params = [p for p in tree.params if owner[p.fqn] == unit]
        if not params:
            continue
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"FSDP unit {unit or '<root>'!r} mixes dtypes {sorted(dtypes)}; FSDP1 needs one dtype per unit")
        aligned = ALIGNMENT_BYTES // params[0].itemsize if spec.use_orig_params else 0
        entries: list[tuple[str | None, int]] = []
        total = 0
        for p in params:
            if aligned and total % aligned:
                entries.append((None, aligned - total % aligned))
                total += entries[-1][1]
            entries.append((p.fqn, p.numel))
            total += p.numel
        if aligned and total % spec.world_size:
            entries.append((None, spec.world_size - total % spec.world_size))
        out.append(FlatParamLayout(unit=unit, fqns=tuple(p.fqn for p in params), entries=tuple(entries)))
    return tuple(out)


def flat_param_key(unit: str) -> str:
    return f"{unit}.{FLAT_PARAM}" if unit else FLAT_PARAM


def _segments_in(flat: FlatParamLayout, start: int, end: int) -> tuple[Segment, ...]:
    """Segments of the parameters that fall inside ``[start, end)`` of the flat parameter."""
    segments, offset = [], 0
    for fqn, numel in flat.entries:
        lo, hi = max(offset, start), min(offset + numel, end)
        if fqn is not None and lo < hi:
            segments.append(Segment(fqn=fqn, start=lo - offset, length=hi - lo, dest=lo - start))
        offset += numel
    return tuple(segments)


def whole(p: ParamInfo) -> LocalTensor:
    """A parameter held whole, in its own shape."""
    return LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=p.shape, segments=(Segment(p.fqn, 0, p.numel, 0),), flat=False)


def rank_layout(tree: ModuleTree, spec: LayoutSpec, rank: int) -> tuple[LocalTensor, ...]:
    """The local tensors of rank ``rank``'s optimizer, in ``model.parameters()`` order of the wrapped model.

    Without ``use_orig_params`` the wrapped model registers each unit's flat
    parameter on the unit module and keeps unmanaged parameters where they
    were, so the order is a pre-order walk of the modules. With it, the
    original parameters stay registered in their original order.
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} is outside a world of {spec.world_size}")
    if spec.kind == "none":
        return tuple(whole(p) for p in tree.params)
    owner = unit_of(tree, spec)
    flats = {f.unit: f for f in flat_param_layouts(tree, spec)}

    def shard(flat: FlatParamLayout) -> tuple[int, int, int]:
        if spec.shards:
            return chunk_bounds(flat.total, spec.world_size, rank)
        return 0, flat.total, flat.total

    if spec.use_orig_params:
        # Each parameter's part of this rank's chunk, as its own 1-D tensor (dest 0).
        in_shard = {
            seg.fqn: Segment(seg.fqn, seg.start, seg.length, 0)
            for flat in flats.values()
            for seg in _segments_in(flat, *shard(flat)[:2])
        }
        out = []
        for p in tree.params:
            if owner[p.fqn] is None or not spec.shards:
                out.append(whole(p))
            elif p.fqn in in_shard:
                seg = in_shard[p.fqn]
                out.append(LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=(seg.length,), segments=(seg,), flat=True))
            else:
                out.append(LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=(0,), segments=(), flat=True))
        return tuple(out)

    out = []
    for module, _cls in tree.modules:
        if module in flats:
            flat = flats[module]
            start, end, size = shard(flat)
            out.append(
                LocalTensor(key=flat_param_key(module), fqns=flat.fqns, shape=(size,), segments=_segments_in(flat, start, end), flat=True)
            )
        out.extend(whole(p) for p in tree.params if p.owner == module and owner[p.fqn] is None)
    return tuple(out)


def full_layout(tree: ModuleTree) -> tuple[LocalTensor, ...]:
    """Every parameter whole: the layout of a full (FQN-keyed) optimizer state dict."""
    return tuple(whole(p) for p in tree.params)


def dim0_layout(tree: ModuleTree, world_size: int, rank: int) -> tuple[LocalTensor, ...]:
    """Each parameter cut along dim 0 as ``torch.chunk`` does: how a DCP checkpoint is written across ranks."""
    out = []
    for p in tree.params:
        start, end, rows = dim0_chunk_bounds(p.shape, world_size, rank)
        shape = (rows, *p.shape[1:]) if p.shape else (() if rows else (0,))
        segs = (Segment(p.fqn, start, end - start, 0),) if end > start else ()
        out.append(LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=shape, segments=segs, flat=False))
    return tuple(out)


def select_params(keys: list[LocalTensor], patterns: list[str]) -> list[LocalTensor]:
    """The local tensors any of whose FQNs match one of ``patterns`` (``fnmatch``), in pattern order."""
    chosen: list[LocalTensor] = []
    for pattern in patterns:
        for t in keys:
            if t not in chosen and any(fnmatch.fnmatchcase(f, pattern) for f in t.fqns):
                chosen.append(t)
    return chosen
