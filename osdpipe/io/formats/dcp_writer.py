"""Writing ``dcp`` output: every target rank's dim-0 pieces as one DCP checkpoint, with or without a process group.

``dcp.save`` plans collectively: each rank describes what it holds (a local
plan), a coordinator merges the plans (one rank keeps each replicated item,
each rank gets a file name, the metadata is made), every rank writes its
items, and the coordinator writes ``.metadata``. Only the writing needs a
rank's data; a plan needs shapes and offsets, which the layout gives. So here
every rank's plan is computed from the layout by whoever writes: online each
rank computes the same global plan with no collective, offline the one
process computes it once and writes each rank's file in turn. Same planner,
same writer, same items in the same order: online and offline files are
byte-identical.

The pieces are described to DCP as ``Shard(0)`` DTensors describe themselves
(:class:`RowShard` implements the hooks DCP's planner calls), so the
checkpoint holds what ``get_optimizer_state_dict`` + ``dcp.save`` writes for
the same state, item for item, and ``dcp.load`` reshards it onto any target
world. The rank files are laid out as DCP's file writer lays them out, but
written by osdpipe (:func:`write_rank`, at the disk's speed); their bytes
differ from ``dcp.save``'s only where ``torch.save``'s do from
:mod:`osdpipe.io.torchfile`'s (a storage's CRC-32, the serialization id). DCP's
``.metadata`` normally records the save's directory and a random save ID;
osdpipe records neither, so the file depends on the conversion only.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from osdpipe.io import torchfile
from osdpipe.io.digest import HashingFile
from osdpipe.layout.ranges import chunk_bounds
from osdpipe.layout.tree import ModuleTree


@dataclass(frozen=True)
class RowShard:
    """One rank's blocks of rows of a tensor of ``shape``, as DCP sees a ``Shard(0)`` DTensor's local piece.

    A block is ``(first row, rows)``. A DTensor's local piece is one block;
    a key that a model's state-dict hook makes of interleaved rows of a
    parameter (torchtitan's ``wq`` of ``wqkv``) is several on a rank: each is
    one chunk of the checkpoint, and ``dcp.load`` reads any chunking.
    ``local`` holds each block's rows on the rank that writes them, ``None``
    where only the plan is needed.
    """

    shape: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]
    dtype: torch.dtype
    local: tuple[torch.Tensor, ...] | None = None

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """One write item per block, as DCP's planner makes one for a DTensor's local piece (offsets: its first row)."""
        items = []
        for first, rows in self.blocks:
            offsets = torch.Size((first, *(0 for _ in self.shape[1:])))
            sizes = torch.Size((rows, *self.shape[1:]))
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=self.dtype),
                        size=torch.Size(self.shape),
                    ),
                )
            )
        return items

    def block_at(self, offsets: torch.Size) -> torch.Tensor:
        """The rows of the block that starts at ``offsets`` (a write item's), on the rank that writes them."""
        assert self.local is not None
        return next(piece for (first, _), piece in zip(self.blocks, self.local) if first == offsets[0])


@dataclass(frozen=True)
class BoxShard:
    """One rank's boxes of a tensor of ``shape`` (a ``[start, stop)`` per dimension each), each one chunk of a
    checkpoint: what a tensor-parallel rank holds of a stacked weight (one box a layer; Megatron's column blocks), or
    a range of a flat buffer. ``local`` holds each box's values on the rank that writes them, ``None`` where only the
    plan is needed."""

    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, int], ...], ...]
    dtype: torch.dtype
    local: tuple[torch.Tensor, ...] | None = None

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        items = []
        for box in self.boxes:
            offsets = torch.Size(a for a, _ in box)
            sizes = torch.Size(b - a for a, b in box)
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties(dtype=self.dtype),
                    size=torch.Size(self.shape),
                ),
            ))
        return items

    def box_at(self, offsets: torch.Size) -> torch.Tensor:
        """The values of the box that starts at ``offsets`` (a write item's), on the rank that writes them."""
        assert self.local is not None
        return next(v for box, v in zip(self.boxes, self.local) if tuple(a for a, _ in box) == tuple(offsets))


@dataclass(frozen=True)
class Stored:
    """An item carried over from another DCP checkpoint as it is stored there:
    its bytes written as they are, never unpickled.

    DCP stores a non-tensor value as a ``torch.save`` archive of it and loads
    it back with ``torch.load``; copying the archive's bytes gives a target
    that loads exactly what the source held, whatever it holds, without
    osdpipe running any of it. ``raw`` is ``None`` where only the plan is needed.
    """

    raw: bytes | None = None


class _RowShardPlanner(DefaultSavePlanner):
    """DCP's default planner, which also hands the writer a
    :class:`RowShard`'s or a :class:`BoxShard`'s local piece and a :class:`Stored` item's bytes."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, (RowShard, BoxShard)) and obj.local is None:
            raise ValueError(f"{index.fqn}: this rank's piece is not at hand; only its plan is")
        if isinstance(obj, RowShard):
            return obj.block_at(index.offset)
        if isinstance(obj, BoxShard):
            return obj.box_at(index.offset)
        if isinstance(obj, Stored) and obj.raw is None:
            raise ValueError(f"{index.fqn}: the stored bytes are not at hand; only its plan is")
        return super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if isinstance(object, Stored):
            return io.BytesIO(object.raw)  # as stored: torch.save of it again would store the archive inside another
        return super().transform_object(write_item, object)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, keeping the sha256 of every file written through it
    (by name), taken as it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.sha256: dict[str, str] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingFile(stream)
            yield hashing
        self.sha256[Path(path).name] = hashing.sha256.hexdigest()


class _Writer(FileSystemWriter):
    """DCP's file writer, for its plan and ``.metadata``:
    minus what varies between runs of the same conversion (the directory, a random save ID), hashing what it writes.

    It syncs nothing: the commit syncs the conversion as a whole, or, under
    ``output.fsync=false``, nothing is synced at all.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.fs = _HashingFileSystem()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()


def row_shard(
    shape: tuple[int, ...], dtype: torch.dtype, world_size: int, rank: int, local: torch.Tensor | None
) -> RowShard:
    """Rank ``rank``'s dim-0 rows of a tensor of ``shape``, as ``torch.chunk`` cuts dim 0 for ``world_size`` ranks."""
    first, last, _ = chunk_bounds(shape[0], world_size, rank)
    return RowShard(shape, ((first, last - first),), dtype, None if local is None else (local,))


def rank_state(result: dict[str, Any], tree: ModuleTree, world_size: int, rank: int, *, local: bool) -> dict[str, Any]:
    """Rank ``rank``'s FQN-keyed optimizer state as DCP is to save it:
    each parameter-shaped tensor as a :class:`RowShard`.

    ``result`` is any target rank's FQN-keyed output (its non-tensor state is
    the same on every rank); with ``local`` it is rank ``rank``'s own, and the
    shards carry its pieces.
    """
    state: dict[str, Any] = {}
    for fqn, entries in result["state"].items():
        if not (isinstance(entries, dict) and tree.has_param(fqn) and tree.param(fqn).shape):
            state[fqn] = entries
            continue
        shape = tuple(tree.param(fqn).shape)
        state[fqn] = {
            name: row_shard(shape, value.dtype, world_size, rank, value if local else None)
            if torch.is_tensor(value) and value.dim() > 0
            else value
            for name, value in entries.items()
        }
    return {**result, "state": state}


@dataclass
class GlobalPlan:
    """Every rank's final write plan and the checkpoint's metadata (storage entries are added at :func:`finish`)."""

    plans: list[SavePlan]
    metadata: Metadata


def plan(state_of: Callable[[int], dict[str, Any]], world_size: int) -> GlobalPlan:
    """The global plan of a checkpoint whose rank ``r`` saves ``state_of(r)``
    (its :class:`RowShard` pieces needing no bytes), across ``world_size`` ranks.

    Computed from shapes only, one rank at a time, by DCP's own planner:
    replicated items (``step``, param groups) are kept by one rank each, as
    ``dcp.save`` keeps them, and DCP validates that the chunks cover every tensor.
    """
    local_plans = []
    for rank in range(world_size):
        planner = _RowShardPlanner()
        planner.set_up_planner(state_of(rank), None, rank == 0)
        local_plans.append(planner.create_local_plan())
    plans, metadata = _RowShardPlanner().create_global_plan(local_plans)
    return GlobalPlan(_Writer(Path(".")).prepare_global_plan(plans), metadata)


def optimizer_plan(key: str, result: dict[str, Any], tree: ModuleTree, world_size: int) -> GlobalPlan:
    """The global plan of a checkpoint holding the FQN-keyed optimizer state ``result`` under ``key``."""
    return plan(lambda rank: {key: rank_state(result, tree, world_size, rank, local=False)}, world_size)


def write_rank(
    directory: Path, state: dict[str, Any], rank: int, global_plan: GlobalPlan
) -> tuple[list[WriteResult], dict[str, str], dict[int, str]]:
    """Write rank ``rank``'s items (``state``: what it saves, its pieces and stored bytes at hand) into ``directory``,
    as DCP's file writer lays them out.

    One file per rank, named as DCP names it: the byte items first, then each
    tensor as a ``torch.save`` archive of its own, in plan order, each
    recorded by offset and length. The bytes are osdpipe's
    (:mod:`osdpipe.io.torchfile`: around the page cache, hashed on the way), so
    a conversion's ``dcp`` output is written at the disk's speed, as its
    rank files are; DCP's reader loads any archive it finds at an item's
    offset. Not synced here: the commit syncs the conversion as a whole.

    Returns what it wrote where (for :func:`finish`), the digest of each file
    it wrote (by name, :class:`osdpipe.io.torchfile.PieceDigest`), and each tensor
    storage's sha256 (by ``UntypedStorage._cdata``), all from one pass over the bytes.
    """
    directory.mkdir(parents=True, exist_ok=True)
    planner = _RowShardPlanner()
    planner.set_up_planner(state, None, rank == 0)
    final = planner.finish_plan(global_plan.plans[rank])
    name = f"{final.storage_data.prefix}0{DEFAULT_SUFFIX}"  # what DCP calls a rank's one file
    ordered = [i for i in final.items if i.type == WriteItemType.BYTE_IO] + [
        i for i in final.items if i.type != WriteItemType.BYTE_IO
    ]
    results, pieces = [], {}
    with torchfile.written(directory / name, sync=False) as out:
        for item in ordered:
            offset = out.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                out.write(data.getbuffer())
            else:
                pieces.update(torchfile.write_archive(_own_storage(data), out))
            length = out.tell() - offset
            results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
            )
    return results, {name: out.digest}, torchfile.storage_digests(out, pieces)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it shares a larger storage:
    an archive holds a tensor's whole storage, an item only its own bytes."""
    tensor = tensor.detach().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def finish(directory: Path, global_plan: GlobalPlan, results: list[list[WriteResult]]) -> str:
    """Write ``.metadata`` once every rank has written (``results``: each rank's, in rank order); returns its sha256.

    Each rank's results are taken as a process group delivers them, through a
    pickle round trip. Pickle writes an object shared between two places once
    and refers back to it; results made in this process share objects with
    the plan, results that came from other ranks do not. Copied, they never
    do, so ``.metadata`` is the same bytes online and offline.
    """
    writer = _Writer(directory)
    writer.finish(global_plan.metadata, [pickle.loads(pickle.dumps(r)) for r in results])
    return next(iter(writer.fs.sha256.values()))  # the one file it wrote: .metadata (under a temporary name)
