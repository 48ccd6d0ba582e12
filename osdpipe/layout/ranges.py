"""Pure layout math: where every element of every parameter lives on every rank.

A *layout* says, for each rank, which local tensors its optimizer holds and,
for each local tensor, which contiguous ranges of which parameters' flattened
views it is made of (*segments*), with zero padding everywhere else. Every
layout in scope (FSDP1 flat parameters with or without ``use_orig_params``,
NO_SHARD, whole parameters, dim-0 chunks) is a list of such segments, so any
conversion is one generic copy: for each target segment, read the same range
from the source. This module holds what every kind shares (segments, chunks,
which modules are units); each kind's own math is in :mod:`osdpipe.layout.kinds`.

Nothing here touches ``torch.distributed`` or a file: a layout is computed from
the :class:`~osdpipe.layout.tree.ModuleTree` of a ``meta`` model, the wrapping and the
world size. Tests hold these functions against the ``FlatParameter`` metadata
of real FSDP.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from osdpipe.layout.boxes import Box, flat_runs

if TYPE_CHECKING:  # annotations only: the spec's names of the strategies; the tree imports torch
    from osdpipe.layout.tree import ModuleTree, ParamInfo
    from osdpipe.spec.config import ShardingStrategy

#: Strategies that shard within a group of ranks and replicate across groups.
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


@dataclass(frozen=True)
class LayoutSpec:
    """How a model is wrapped: everything that decides its layout."""

    kind: str = "fsdp1"  # a name in osdpipe.layout.kinds.KINDS
    world_size: int = 1
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    use_orig_params: bool = False
    wrap: tuple[str, ...] = ()
    wrap_root: bool = True
    #: Mixed precision's forward/backward parameter dtype (``MixedPrecision.param_dtype``),
    #: ``None``: the parameters' own.
    param_dtype: str | None = None
    #: Ranks that shard one replica (FSDP1 HYBRID_SHARD, FSDP2 HSDP); ``None``: one group of every data-parallel rank.
    shard_group_size: int | None = None
    #: Tensor-parallel ranks: the innermost mesh dimension (FSDP2); the world is replicas x shard group x ``tp_size``.
    tp_size: int = 1
    #: Module FQN pattern (fnmatch) -> tensor-parallel style, in the order given (see :mod:`osdpipe.layout.tp`).
    tp_plan: tuple[tuple[str, str], ...] = ()
    #: Each parameter's mesh and placements under ``tp_plan``, as PyTorch
    #: lays them (:func:`osdpipe.layout.tp.read_placements`); filled in
    #: by the plan, since only the model and PyTorch can say them.
    tp_placements: tuple[tuple[str, Placement], ...] | None = None
    #: Pipeline stages, and model chunks per stage (virtual pipeline stages): the world is ``tp_size`` x
    #: ``pp_size`` x data-parallel ranks (Megatron-Core's grid).
    pp_size: int = 1
    vpp_size: int = 1
    #: Expert-parallel ranks (a mixture of experts): each (PP, TP) rank's data-parallel ranks split into ``ep_size``
    #: groups of experts (Megatron-Core's grid).
    ep_size: int = 1
    #: How a distributed optimizer saves its state where the kind has more than one way (Megatron's
    #: ``dp_reshardable``, ``fully_reshardable``); ``None``: the kind's only way, or the source's.
    state_sharding: str | None = None
    #: What the kind's :meth:`~osdpipe.layout.kinds.base.LayoutKind.settle` works out of the model for its layout and
    #: only it reads (Megatron's :class:`~osdpipe.layout.megatron_grid.Grid`); ``None``: nothing.
    grid: Any = None

    @property
    def data_parallel(self) -> int:
        """The ranks that hold different data: every rank but the tensor-parallel ones of each group (and the
        pipeline's stages)."""
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def replica_span(self) -> int:
        """How many consecutive ranks make one replica: a shard group times the tensor-parallel ranks."""
        return (self.shard_group_size or self.data_parallel) * self.tp_size

    @property
    def replicas(self) -> int:
        """How many replica groups hold the same shards (1 without hybrid sharding)."""
        return self.world_size // self.replica_span

    def first_replica(self, rank: int) -> int:
        """The rank of the first replica group that holds what ``rank`` holds (itself without hybrid sharding)."""
        return rank % self.replica_span


def shard_group(spec: LayoutSpec, rank: int) -> tuple[int, int]:
    """``(size, index)``: the group of ranks a parameter is sharded over, and ``rank``'s place in it.

    Ranks are laid out as a (replicate, shard) mesh, row-major, as
    ``init_device_mesh`` lays them out: with hybrid sharding rank ``r`` holds
    shard ``r % shard_group_size``, the same as every rank of its column.
    """
    size = spec.shard_group_size or spec.world_size
    return size, rank % size


@dataclass(frozen=True)
class Placement:
    """How a parameter that is a DTensor (FSDP2) is laid over its device mesh.

    ``mesh`` is the mesh's shape and ``placements`` one placement per mesh
    dimension, as ``str(placement)`` writes them (``"S(0)"``, ``"R"``,
    ``"_S(0, 2)"``). ``names`` are the mesh dimensions' names, which say
    where a sub-mesh lies in the job's whole mesh (a parameter tensor
    parallelism leaves alone lies on the ``dp`` dimension only); ``None``
    where no job's mesh is meant (how a DCP checkpoint's chunks are cut).
    """

    mesh: tuple[int, ...]
    placements: tuple[str, ...]
    names: tuple[str, ...] | None = None

    def describe(self, shape: tuple[int, ...]) -> dict[str, list[Any]]:
        """The entry of :data:`DTENSOR_TABLE` for a parameter of global ``shape``."""
        out = {"shape": list(shape), "mesh": list(self.mesh), "placements": list(self.placements)}
        return out if self.names is None else {**out, "mesh_dim_names": list(self.names)}


def same_placement(saved: Any, expected: dict[str, Any]) -> bool:
    """Whether two entries of :data:`DTENSOR_TABLE` describe the same layout: the same shape, mesh and placements.

    The mesh's names are recorded for people and tools, not compared: a job
    names its mesh as it likes, and the shape and placements already say
    where each piece lies (every FSDP2 parameter lies on the data-parallel
    dimensions, tensor parallelism adds the innermost one).
    """
    return isinstance(saved, dict) and all(saved.get(k) == expected.get(k) for k in ("shape", "mesh", "placements"))


#: The state name a whole checkpoint's model weights travel under, beside the optimizer's own (``exp_avg``...):
#: :mod:`osdpipe.io.weights`. A layout names it where a tensor holds the weights alone (:attr:`LocalTensor.states`).
WEIGHTS = "weights"

#: The top-level key of a param-ID keyed file that lists, per param ID, how its
#: DTensor state lies on the mesh (:meth:`Placement.describe`): the file holds
#: plain local tensors, so it loads with ``torch.load(weights_only=True)``.
DTENSOR_TABLE = "dtensor"


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
        placement: for a DTensor parameter (FSDP2), its mesh and placements;
            ``None`` for a plain tensor.
        states: the states of its parameters it holds (``None``: every one). A layout that keeps a parameter's
            weights apart from its optimizer's state (Megatron's model boxes beside its distributed optimizer's
            buckets) holds each in a tensor of its own.
    """

    key: str
    fqns: tuple[str, ...]
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    flat: bool
    placement: Placement | None = None
    states: tuple[str, ...] | None = None

    def holds(self, state: str) -> bool:
        """Whether this tensor holds its parameters' state ``state``."""
        return self.states is None or state in self.states

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def has_elements(self) -> bool:
        """Whether this rank holds any element of the parameter."""
        return self.numel > 0

    @property
    def stepped(self) -> bool:
        """Whether the optimizer gets a gradient, and so state, for this tensor.

        An empty ``use_orig_params`` shard gets neither. A DTensor parameter
        does even when its local shard is empty: its state is then empty
        tensors and a ``step``, as FSDP2 keeps them.
        """
        return self.has_elements or self.placement is not None


def box_segments(fqn: str, shape: tuple[int, ...], box: Box) -> tuple[Segment, ...]:
    """A rank's box of parameter ``fqn`` as segments:
    each run of its row-major elements (:func:`osdpipe.layout.boxes.flat_runs`), packed in order.

    A box is what a rank of a mesh holds; a segment is what the copy plan
    moves. Dim-0 boxes are one segment; a box that cuts a later dimension
    (a rowwise tensor-parallel weight) is one segment per row it spans.
    """
    out, dest = [], 0
    for start, stop in flat_runs(shape, box):
        out.append(Segment(fqn, start, stop - start, dest))
        dest += stop - start
    return tuple(out)


def chunk_bounds(total: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s chunk of ``total`` elements as ``torch.chunk`` cuts it.

    Returns ``(start, end, chunk_size)``: the rank holds ``[start, end)`` padded
    to ``chunk_size``. ``torch.chunk`` makes chunks of ``ceil(total / ws)``, so
    trailing ranks may hold fewer elements, or none.
    """
    chunk = -(-total // world_size) if total else 0
    start = min(rank * chunk, total)
    return start, min(start + chunk, total), chunk


def uncovered(start: int, end: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` outside every interval of ``covered``
    (intervals may overlap, repeat or reach outside it)."""
    out, cursor = [], start
    for lo, hi in sorted(covered):
        if hi <= cursor or lo >= end:
            continue
        if lo > cursor:
            out.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < end:
        out.append((cursor, end))
    return out


def batches(segments: Iterable[Segment], limit: int | None) -> list[tuple[Segment, ...]]:
    """The segments in ``dest`` order, cut into parts of at most ``limit`` elements and packed,
    in order, into batches of at most ``limit``.

    A batch is what one read, one message or one comparison holds at once, so
    ``limit`` is how ``runtime.memory_budget`` bounds the bytes in flight.
    ``limit=None``: one batch of every segment, uncut. Empty segments are dropped.
    """
    ordered = [s for s in sorted(segments, key=lambda s: s.dest) if s.length > 0]
    if limit is None:
        return [tuple(ordered)] if ordered else []
    if limit < 1:
        raise ValueError(f"a batch holds at least one element, not {limit}")
    out: list[tuple[Segment, ...]] = []
    current: list[Segment] = []
    size = 0
    for seg in ordered:
        done = 0
        while done < seg.length:
            take = min(seg.length - done, limit - size)
            current.append(Segment(seg.fqn, seg.start + done, take, seg.dest + done))
            size, done = size + take, done + take
            if size == limit:
                out.append(tuple(current))
                current, size = [], 0
    if current:
        out.append(tuple(current))
    return out


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


def whole(p: ParamInfo) -> LocalTensor:
    """A parameter held whole, in its own shape."""
    return LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=p.shape, segments=(Segment(p.fqn, 0, p.numel, 0),), flat=False)


def full_layout(tree: ModuleTree) -> tuple[LocalTensor, ...]:
    """Every parameter whole: the layout of a full (FQN-keyed) optimizer state dict."""
    return tuple(whole(p) for p in tree.params)


def dim0_layout(tree: ModuleTree, world_size: int, rank: int) -> tuple[LocalTensor, ...]:
    """Each parameter cut along dim 0 as ``torch.chunk`` does: how a DCP checkpoint is written across ranks.

    Every rank holds a piece of every parameter, empty or not, as every rank
    of a ``Shard(0)`` DTensor does; a 0-dim parameter is rank 0's alone.
    """
    out = []
    placement = Placement(mesh=(world_size,), placements=("S(0)",))
    for p in tree.params:
        start, end, rows = dim0_chunk_bounds(p.shape, world_size, rank)
        shape = (rows, *p.shape[1:]) if p.shape else (() if rows else (0,))
        segs = (Segment(p.fqn, start, end - start, 0),) if end > start else ()
        placed = placement if p.shape else None
        out.append(LocalTensor(key=p.fqn, fqns=(p.fqn,), shape=shape, segments=segs, flat=False, placement=placed))
    return tuple(out)


def select_params(keys: list[LocalTensor], patterns: list[str]) -> list[LocalTensor]:
    """The local tensors any of whose FQNs match one of ``patterns`` (``fnmatch``), in pattern order."""
    chosen: list[LocalTensor] = []
    for pattern in patterns:
        for t in keys:
            if t not in chosen and any(fnmatch.fnmatchcase(f, pattern) for f in t.fqns):
                chosen.append(t)
    return chosen
