"""``rank_local`` as an input: each rank's own ``optim.state_dict()``, one file per rank.

A directory holds ``rank_0.pt`` .. ``rank_<N-1>.pt``, N the source world
size; file ``r`` is what rank ``r``'s optimizer returned from ``state_dict()``
over the wrapped model. Its state is keyed by param ID (the position in
the optimizer's param groups over ``model.parameters()`` of the wrapped model)
and holds local tensors: a flat parameter's chunk, a ``use_orig_params``
shard, a whole parameter, or an FSDP2 parameter's dim-0 chunk (a DTensor's
local tensor; the file's ``dtensor`` table says how each lies on the mesh). Nothing in the files says what those tensors
are, so the source layout (``source.*``) and the groups the IDs follow
(``input.param_groups``, else ``optim.param_groups``) must be given; every
state tensor is checked against the shape that layout gives it.

The reader presents the files as a full FQN-keyed state, as
``FSDP.optim_state_dict`` with FULL_STATE_DICT would: every original
parameter gets its state in its own shape, assembled from the segments the
source ranks hold. Where two ranks hold the same element (NO_SHARD, or a
parameter FSDP does not manage), the lowest rank's copy is read, as FSDP's
full state dict reports rank 0's. Ranks whose local tensor is empty (a
``use_orig_params`` shard with no element of the parameter) have no state and
are skipped, as FSDP skips them. An element held only by ranks without state
for it is an error, never zeros: FSDP's own gather refuses such a state too.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from osdpipe.core.compare import diff
from osdpipe.io import fetched_memory
from osdpipe.io.formats.base import (
    Format,
    IdGroups,
    InputError,
    RankFiles,
    Shown,
    SourceMeta,
    SourceReader,
    TensorRef,
    mapped_range,
    own_copy,
    release_mapped,
    write_torch_file,
)
from osdpipe.io.formats.fsdp_full import check_optim_state_dict
from osdpipe.io.formats.safe_load import load_torch_file
from osdpipe.io.remote_input import as_path
from osdpipe.layout.kinds import find, rank_layout
from osdpipe.layout.kinds.fsdp2 import to_rank_local
from osdpipe.layout.optim import pattern_members
from osdpipe.layout.ranges import DTENSOR_TABLE, LayoutSpec, LocalTensor, same_placement, uncovered
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

@dataclass(frozen=True)
class RankFileNaming:
    """How a job names each rank's file of its optimizer's state: ``rank_<r>.pt`` (osdpipe's, ``load_rank_local``'s),
    ``optim_world_size_<W>_rank_<r>.pt`` (veRL's). ``template`` holds ``{rank}``, and ``{world_size}`` where the
    name says the world that saved it (a file of another world is then no file of this one)."""

    template: str

    def name(self, rank: int, world_size: int | None = None) -> str:
        return self.template.format(rank=rank, world_size="<W>" if world_size is None else world_size)

    def rank_of(self, name: str, world_size: int | None = None) -> int | None:
        """The rank whose file ``name`` is (``None``: not one of these files, or of another world size)."""
        world = r"[1-9]\d*" if world_size is None else str(world_size)
        pattern = re.escape(self.template).replace(r"\{rank\}", r"(?P<rank>0|[1-9]\d*)")
        found = re.fullmatch(pattern.replace(r"\{world_size\}", world), name)
        return None if found is None else int(found.group("rank"))

    def present(self, directory: Path, world_size: int | None = None) -> dict[int, Path]:
        """The files of ``directory`` named so, by rank."""
        return {r: p for p in directory.iterdir() if (r := self.rank_of(p.name, world_size)) is not None}


#: osdpipe's rank files, and those of a job that ``torch.save``s its optimizer's state per rank.
RANK_LOCAL = RankFileNaming("rank_{rank}.pt")

_GROUPS_KEY = "input.param_groups (or optim.param_groups)"
_HINT = (
    "are source.kind, source.wrap, source.world_size, source.sharding_strategy, source.shard_group_size, "
    "source.use_orig_params, source.tp_size, source.tp_plan and input.param_groups those of the job that saved it?"
)


def rank_files(path: str | Path, world_size: int, naming: RankFileNaming = RANK_LOCAL) -> list[Path]:
    """The files ``rank_0.pt`` .. ``rank_<world_size-1>.pt`` of directory ``path`` (as ``naming`` names them).

    Raises:
        InputError: when one is missing, or the directory holds rank files
            beyond the world size. Changing ``source.world_size`` is suggested
            only where the files say what it is: they are exactly
            ``rank_0.pt`` .. ``rank_<K-1>.pt``, or some lie beyond the world size.
    """
    directory = as_path(path)
    if not directory.is_dir():
        raise InputError(
            f"{directory} is not a directory; a rank_local input is the directory of rank_0.pt .. rank_<N-1>.pt"
        )
    present = naming.present(directory, world_size if "{world_size}" in naming.template else None)
    missing = [r for r in range(world_size) if r not in present]
    extra = [r for r in sorted(present) if r >= world_size]
    if not missing and not extra:
        return [present[r] for r in range(world_size)]
    expected = naming.name(0, world_size)
    if world_size > 1:
        expected += f" .. {naming.name(world_size - 1, world_size)}"
    if not present:
        raise InputError(
            f"{directory} holds no {naming.template.format(rank='<r>', world_size=world_size)} files "
            f"(expected {expected} for source.world_size={world_size}); "
            "point input.path at the directory of each rank's torch.save(optim.state_dict())"
        )
    found = _ranks(sorted(present), naming, world_size)
    contiguous = sorted(present) == list(range(len(present)))
    if extra:
        what = "; ".join(
            [f"missing {_ranks(missing, naming, world_size)}"] * bool(missing)
            + [f"unexpected {_ranks(extra, naming, world_size)}"]
        )
        fix = _world_size_fix(len(present)) if contiguous else (
            "set source.world_size to the number of ranks that saved it, and copy every rank's file"
        )
        raise InputError(
            f"{directory}: expected {expected} for source.world_size={world_size}, found {found} ({what}); {fix}"
        )
    if contiguous:  # rank_0.pt .. rank_<K-1>.pt, K < N: most likely a world size of K
        raise InputError(
            f"{directory / naming.name(missing[0], world_size)} is missing: "
            f"source.world_size={world_size} needs {expected} but the directory holds {found} "
            f"(missing {_ranks(missing, naming, world_size)}); {_world_size_fix(len(present))}"
        )
    also = f"; also missing {_ranks(missing[1:], naming, world_size)}" if len(missing) > 1 else ""
    raise InputError(
        f"{directory / naming.name(missing[0], world_size)} is missing "
        f"(found {found} for source.world_size={world_size}{also}); "
        "copy every rank's file from the job that saved it"
    )


def _world_size_fix(count: int) -> str:
    return f"if {count} rank{'s' * (count != 1)} saved it, set source.world_size={count}"


def rank_file_name(rank: int) -> str:
    """Rank ``rank``'s file of a ``rank_local`` checkpoint."""
    return RANK_LOCAL.name(rank)


def _ranks(ranks: Any, naming: RankFileNaming = RANK_LOCAL, world_size: int | None = None) -> str:
    """Rank files, short: runs of three or more as ``rank_0.pt .. rank_5.pt``."""
    name = lambda r: naming.name(r, world_size)  # noqa: E731
    ranks = list(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{name(ranks[i])} .. {name(ranks[j])}")
        else:
            parts.extend(name(r) for r in ranks[i : j + 1])
        i = j + 1
    return ", ".join(parts)


@dataclass(frozen=True)
class _Piece:
    """``length`` elements of a parameter from ``start``, read from ``rank``'s state of param ``pid`` at ``offset``."""

    rank: int
    pid: int
    start: int
    length: int
    offset: int


class RankLocalReader:
    """Reads a directory of per-rank ``optim.state_dict()`` files saved under the ``source`` layout.

    Args:
        path: the directory.
        tree: the model's module tree.
        source: the layout the files were saved under (its world size is the number of files).
        id_groups: the FQN patterns of each param group of the optimizer that
            saved them; ``None``: one group over all of ``model.parameters()``.
        naming: how the files are named.
    """

    def __init__(
        self, path: str, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups, naming: RankFileNaming = RANK_LOCAL,
    ) -> None:
        self.path, self.tree, self.source = path, tree, source
        self.files = rank_files(path, source.world_size, naming)
        self.layouts = [rank_layout(tree, source, r) for r in range(source.world_size)]
        members = pattern_members(id_groups, self.layouts[0], where=_GROUPS_KEY)
        self.group_ids: list[list[int]] = []
        self.order: list[int] = []  # param ID -> index into a rank's layout (the same on every rank)
        for group in members:
            self.group_ids.append(list(range(len(self.order), len(self.order) + len(group))))
            self.order.extend(group)
        self._osds: dict[int, dict[str, Any]] = {}
        self._index: dict[str, dict[str, Any]] | None = None

    def tensor(self, rank: int, pid: int) -> LocalTensor:
        """The local tensor that param ID ``pid`` names on rank ``rank``."""
        return self.layouts[rank][self.order[pid]]

    def _osd(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s state dict, memory-mapped and checked against the source layout (loaded once)."""
        if rank not in self._osds:
            path = self.files[rank]
            osd = load_torch_file(path)
            check_optim_state_dict(osd, path, "rank_local")
            osd = local_tensors(osd)
            self._check(rank, osd)
            self._osds[rank] = osd
        return self._osds[rank]

    def _check(self, rank: int, osd: dict[str, Any]) -> None:
        """The file's groups hold the IDs the groups give;
        every ID names a local tensor of the source layout, with state of its shape."""
        groups = osd.get("param_groups")
        if groups is not None:
            ids = [list(g.get("params", [])) if isinstance(g, dict) else [] for g in groups]
            if sum(map(len, ids)) != len(self.order):
                raise InputError(
                    f"{self.files[rank]}: rank {rank}: its optimizer holds {sum(map(len, ids))} parameter(s) "
                    f"in {len(ids)} group(s), but the source layout "
                    f"gives it {len(self.order)} in {len(self.group_ids)}; {_HINT}"
                )
            if ids != self.group_ids:
                raise InputError(
                    f"{self.files[rank]}: rank {rank}: the file's param groups hold IDs {_show(ids)} "
                    f"but the groups of input.param_groups, else optim.param_groups, hold {_show(self.group_ids)}; "
                    "set input.param_groups to the FQN patterns of the groups of the optimizer that saved it, "
                    "in its order"
                )
        self._check_placements(rank, osd)
        for pid, state in osd["state"].items():
            if not isinstance(pid, int):
                continue  # not a parameter's state: passed through as extra state (rank 0's)
            if not 0 <= pid < len(self.order):
                raise InputError(
                    f"{self.files[rank]}: rank {rank}, param ID {pid}: "
                    f"the source layout gives the optimizer {len(self.order)} parameter(s) "
                    f"(IDs 0..{len(self.order) - 1}); {_HINT}"
                )
            tensor = self.tensor(rank, pid)
            for name, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tensor.shape:
                    raise InputError(
                        f"{self.files[rank]}: rank {rank}, param ID {pid}: "
                        f"state {name} has shape {tuple(value.shape)} but the source layout says "
                        f"{tensor.shape} ({tensor.key}); {_HINT}"
                    )

    def _check_placements(self, rank: int, osd: dict[str, Any]) -> None:
        """A file of DTensor state (FSDP2) lists each parameter's placement; it must be the source layout's."""
        table = osd.get(DTENSOR_TABLE)
        if table is None:
            return
        if not isinstance(table, dict):
            raise InputError(
                f"{self.files[rank]}: its {DTENSOR_TABLE!r} entry is a {type(table).__name__}, "
                "not a table of placements per param ID"
            )
        for pid, saved in table.items():
            tensor = self.tensor(rank, pid) if isinstance(pid, int) and 0 <= pid < len(self.order) else None
            if tensor is None or tensor.placement is None:
                raise InputError(
                    f"{self.files[rank]}: rank {rank} holds DTensor state (param ID {pid}), "
                    f"which source.kind={self.source.kind} does not have; "
                    "set source.kind=fsdp2 (and source.shard_group_size for HSDP)"
                )
            expected = tensor.placement.describe(self.tree.param(tensor.key).shape)
            if not same_placement(saved, expected):
                raise InputError(
                    f"{self.files[rank]}: rank {rank}, param ID {pid} ({tensor.key}) lies as {saved}, "
                    f"but the source layout says {expected}; {_HINT}"
                )

    def _holders(self, pid: int) -> list[int]:
        """The ranks that hold state of param ``pid``: a non-empty local tensor, and state for it.

        An empty ``use_orig_params`` shard gets no gradient, hence no state; FSDP skips such ranks too.
        """
        return [
            r
            for r in range(self.source.world_size)
            if self.tensor(r, pid).has_elements and self._osd(r)["state"].get(pid)
        ]

    def _build_index(self) -> dict[str, dict[str, Any]]:
        """FQN -> its param ID, state names, scalar state, and where each state tensor's elements are read."""
        index: dict[str, dict[str, Any]] = {}
        for pid in range(len(self.order)):
            holders = self._holders(pid)
            if holders:  # a flat parameter's original parameters all share its state names and scalar state
                for fqn in self.tensor(0, pid).fqns:
                    index[fqn] = self._entry(pid, fqn, holders)
        return index

    def _entry(self, pid: int, fqn: str, holders: list[int]) -> dict[str, Any]:
        states = {r: self._osd(r)["state"][pid] for r in holders}
        first = holders[0]
        names = list(states[first])
        for r in holders[1:]:
            if set(states[r]) != set(names):
                raise InputError(
                    f"{self.path}: {fqn} (param ID {pid}): "
                    f"rank {first} has state {sorted(names)} but rank {r} has {sorted(states[r])}"
                )
        values: dict[str, Any] = {}
        pieces: dict[str, list[_Piece]] = {}
        for name in names:
            value = states[first][name]
            if torch.is_tensor(value) and value.dim() > 0:
                odd = [r for r in holders if not (torch.is_tensor(states[r][name]) and states[r][name].dim() > 0)]
                if odd:
                    raise InputError(
                        f"{self.files[odd[0]]}: {fqn} (param ID {pid}): state {name} is a tensor on rank {first} but a "
                        f"{type(states[odd[0]][name]).__name__} on rank {odd[0]}; "
                        "the ranks of one job agree on it, so these files are not from one checkpoint"
                    )
                dtypes = {str(states[r][name].dtype) for r in holders}
                if len(dtypes) > 1:
                    raise InputError(
                        f"{self.path}: {fqn} (param ID {pid}): "
                        f"state {name} has dtypes {sorted(dtypes)} on different ranks"
                    )
                values[name] = TensorRef(self.tree.param(fqn).shape, str(value.dtype).removeprefix("torch."))
                pieces[name] = self._pieces(pid, fqn, name, holders)
                continue
            for r in holders[1:]:
                if diff(states[r][name], value):
                    raise InputError(
                        f"{self.files[r]}: {fqn} (param ID {pid}): "
                        f"scalar state {name} is {states[r][name]!r} on rank {r} but {value!r} on rank {first}; "
                        "the ranks of one job agree on it, so these files are not from one checkpoint"
                    )
            values[name] = own_copy(value)
        return {"pid": pid, "values": values, "pieces": pieces}

    def _pieces(self, pid: int, fqn: str, name: str, holders: list[int]) -> list[_Piece]:
        """Where each element of ``fqn``'s state ``name`` is read: the lowest rank holding it."""
        covered: list[tuple[int, int]] = []
        pieces = []
        for r in holders:
            for seg in self.tensor(r, pid).segments:
                if seg.fqn != fqn:
                    continue
                for lo, hi in uncovered(seg.start, seg.start + seg.length, covered):
                    pieces.append(_Piece(r, pid, lo, hi - lo, seg.dest + lo - seg.start))
                    covered.append((lo, hi))
        numel = self.tree.param(fqn).numel
        gaps = uncovered(0, numel, covered)
        if gaps:
            lo, hi = gaps[0]
            owners = [
                r
                for r in range(self.source.world_size)
                for s in self.tensor(r, pid).segments
                if s.fqn == fqn and s.start < hi and s.start + s.length > lo
            ]
            raise InputError(
                f"{self.path}: {fqn} state {name}: elements {lo}..{hi} (of {numel}) "
                f"lie on rank(s) {owners} under the source layout, "
                f"which have no state for param ID {pid}; FSDP cannot gather this state either. {_HINT}"
            )
        return pieces

    @property
    def index(self) -> dict[str, dict[str, Any]]:
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def meta(self) -> SourceMeta:
        state = {fqn: dict(e["values"]) for fqn, e in self.index.items()}
        rank0 = self._osd(0)
        extra = {k: v for k, v in rank0["state"].items() if not isinstance(k, int)}
        groups = None
        if rank0.get("param_groups") is not None:
            groups = []
            for group, ids in zip(rank0["param_groups"], self.group_ids):
                fqns = [f for pid in ids for f in self.tensor(0, pid).fqns]
                groups.append({**copy.deepcopy({k: v for k, v in group.items() if k != "params"}), "params": fqns})
        return SourceMeta(state=state, param_groups=groups, extra=extra)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        out = {}
        for fqn, name in items:
            ref = self._ref(fqn, name)
            out[(fqn, name)] = self.read_range(fqn, name, 0, math.prod(ref.shape)).view(ref.shape)
        return out

    def _ref(self, fqn: str, name: str) -> TensorRef:
        entry = self.index.get(self.tree.canonical(fqn))
        ref = entry["values"].get(name) if entry else None
        if not isinstance(ref, TensorRef):
            raise KeyError(f"the rank_local input has no tensor state {name!r} for {fqn}")
        return ref

    def _overlaps(self, fqn: str, name: str, start: int, stop: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """``(local tensor, offset, lo, hi)`` for each stored piece
        that holds elements ``[lo, hi)`` of ``[start, stop)``."""
        self._ref(fqn, name)
        out = []
        for p in self.index[self.tree.canonical(fqn)]["pieces"][name]:
            lo, hi = max(start, p.start), min(stop, p.start + p.length)
            if lo < hi:
                out.append((self._osd(p.rank)["state"][p.pid][name], p.offset + lo - p.start, lo, hi))
        return out

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        ref = self._ref(fqn, name)
        # Every element is written below: the index proved the pieces cover the parameter.
        flat = torch.empty(stop - start, dtype=ref.torch_dtype)
        for local, offset, lo, hi in self._overlaps(fqn, name, start, stop):
            flat[lo - start : hi - start] = mapped_range(local, offset, offset + hi - lo)
        return flat

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        for local, offset, lo, hi in self._overlaps(fqn, name, start, stop):
            release_mapped(local, offset, offset + hi - lo)

    def expect(self, reads: list[tuple[str, str, int, int]]) -> None:
        """The reads to come, told ahead: files in object storage fetch their pages ahead."""
        fetched_memory.plan(
            [
                (local, offset, offset + hi - lo)
                for fqn, name, start, stop in reads
                for local, offset, lo, hi in self._overlaps(fqn, name, start, stop)
            ]
        )


def local_tensors(osd: dict[str, Any]) -> dict[str, Any]:
    """An FSDP2 rank's ``torch.save(optim.state_dict())`` holds DTensors: take their local tensors and placements.

    What :func:`osdpipe.to_rank_local` would have saved, so both ways of
    saving an FSDP2 rank's state read alike.
    """
    # torch.distributed.tensor is heavy: only where a rank_local file is read
    from torch.distributed.tensor import DTensor

    if any(
        isinstance(v, DTensor)
        for entry in osd["state"].values()
        if isinstance(entry, dict)
        for v in entry.values()
    ):
        return to_rank_local(osd)
    return osd


def replica_mismatches(
    path: str | Path, source: LayoutSpec, ranks: list[int], naming: RankFileNaming = RANK_LOCAL,
) -> list[str]:
    """Where each of ``ranks``' files differs from the file of the same shard in the first replica group.

    A hybrid-sharded job (HYBRID_SHARD, HSDP) holds every shard once per
    replica group and the conversion reads the first group's; the others must
    hold the same bytes, else the checkpoint is not one state.
    """
    files = rank_files(path, source.world_size, naming)
    problems = []
    for r in ranks:
        first = source.first_replica(r)
        if first == r:
            continue
        found = diff(  # whole files: a remote file's bytes fetched
            fetched_memory.fetch_all(local_tensors(load_torch_file(files[r]))),
            fetched_memory.fetch_all(local_tensors(load_torch_file(files[first]))),
            path=f"rank {r} vs rank {first}",
            limit=1,
        )
        problems.extend(f"{files[r].name}: {line}" for line in found)
    return problems


def _show(ids: list[Any]) -> str:
    """Param ID groups, short: ``[0..4], [5..9]``."""
    parts = []
    for g in ids:
        if isinstance(g, list) and g and g == list(range(g[0], g[0] + len(g))):
            parts.append(f"[{g[0]}..{g[-1]}]")
        else:
            parts.append(repr(g))
    return ", ".join(parts) or "none"


class RankLocal(Format):
    """Each rank's own ``optim.state_dict()``, keyed by param ID,
    one ``rank_<r>.pt`` per rank (FSDP2's and ``load_rank_local``'s)."""

    name = "rank_local"
    keyed_by_id = True
    directory = True
    holds_replicas = True
    local_state = True
    generated_name = "rank_local"
    looks_like = "a directory of rank_<r>.pt"
    made_as_written = True
    found_by = "rank_<r>.pt files"
    #: How the files of each rank are named.
    naming: ClassVar[RankFileNaming] = RANK_LOCAL

    def output_path(self, directory: Path, rank: int) -> Path:
        return directory / rank_file_name(rank)

    def refuses_source(self, kind: Any) -> str | None:
        if "local" in kind.state_dict_types:  # a job whose ranks save their own optimizer's state
            return None
        return (
            "input.format=rank_local needs the source's layout; "
            "set source.kind (fsdp1, ddp) and its world_size and wrap"
        )

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        return RankLocalReader(path, tree, source, id_groups, self.naming)

    def found_in(self, directory: Path) -> bool:
        return bool(self.naming.present(directory))

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        """Every rank's file, loaded memory-mapped;
        what they show is told by :func:`~osdpipe.io.formats.rank_local_facts.describe_ranks`."""
        # imported here: it imports osdpipe.io.loading, which imports the formats package, which imports this module
        from osdpipe.io.formats.rank_local_facts import describe_ranks

        count = len(self.naming.present(path)) if path.is_dir() else 0
        # refuses gaps and an empty directory, naming the missing file
        files = rank_files(path, max(count, 1), self.naming)
        osds = []
        for f in files:
            osd = load_torch_file(f)
            check_optim_state_dict(osd, f, self.name)
            osds.append(osd)
        describe_ranks(facts, path, osds, [local_tensors(o).get(DTENSOR_TABLE) for o in osds])

    def files_per_rank(self, world_size: int) -> str | None:
        return f"{self.naming.name(0, world_size)} .. {self.naming.name(world_size - 1, world_size)}"

    def replica_mismatches(self, path: str, source: Any, ranks: list[int]) -> list[str]:
        return replica_mismatches(path, source, ranks, self.naming)

    def shows(self, facts: Facts, kind: Any) -> list[Shown]:
        """The world size, and for DTensor state the kind that keeps it and its mesh."""
        shown = super().shows(facts, kind)
        saved_by = find(facts.kind)
        if saved_by is not None and saved_by.dtensor_state:
            shown += [
                Shown(
                    "source.kind",
                    facts.kind,
                    f"{facts.path} holds DTensor state ({'; '.join(facts.placements[:2])}): an FSDP2 job's",
                ),
                Shown(
                    "source.shard_group_size",
                    facts.shard_group_size,
                    f"{facts.path}'s DTensors lie on a mesh of {facts.placements[:1]}",
                ),
            ]
        return shown

    def id_groups(self, given: IdGroups, configured: IdGroups, generated: bool) -> IdGroups:
        return given if given is not None else configured or None

    def write(
        self,
        result: dict[str, Any],
        staging: Path,
        rank: int,
        *,
        key: str,
        tree: ModuleTree,
        world_size: int,
        shared: dict[str, Any],
    ) -> RankFiles:
        return write_torch_file(result, staging / rank_file_name(rank))

    def load_as_a_user_does(self, model: Any, optim: Any, path: Path, written: dict[str, Any], kind: Any) -> None:
        # imported here: loading imports the formats package, which imports this module
        from osdpipe.io.loading import load_rank_local

        load_rank_local(optim, path, model=model)
