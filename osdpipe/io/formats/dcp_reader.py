"""``dcp``: a ``torch.distributed.checkpoint`` directory with the optimizer state under one key.

FSDP1's SHARDED_STATE_DICT optimizer state saved with DCP lands here as
``<key>.state.<fqn>.<name>`` entries; the metadata's planner data maps each
flat key back to its path, so FQNs with dots are never guessed from strings.

Nothing here runs code from the checkpoint. torch 2.13's ``FileSystemReader``
unpickles ``.metadata`` with plain :mod:`pickle`, and its default planner
loads non-tensor items (param groups) with ``torch.load(weights_only=False)``;
both would run whatever a crafted file names. :class:`SafeFileSystemReader`
reads the metadata with an allow-list unpickler
(:class:`~osdpipe.io.formats.safe_load.DcpMetadataUnpickler`) and checks every
item's bytes before torch loads them; :class:`SafeLoadPlanner` loads
non-tensor items with ``weights_only=True``. The directory's structure is
checked when the reader opens (:func:`check_structure`), so a damaged
checkpoint fails before any process reads a tensor.

A checkpoint in object storage (``input.path=s3://bucket/prefix``, :mod:`osdpipe.io.remote_input`) is read the same
way, by byte ranges: ``.metadata`` whole, then the items a read plan needs (or that a rank's reads will need, told
ahead through :meth:`DcpCheckpoint.expect`), each object's neighbours as one ranged request, several in flight
(:class:`~osdpipe.io.remote_input.Prefetch`); a ``.distcp`` file is never downloaded whole for a part of it. A local
directory is read as before, never through fsspec.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from osdpipe.core.memory import drop_mapped_pages
from osdpipe.core.seekable import ViewFile
from osdpipe.core.state_paths import put_at
from osdpipe.io.formats.base import InputError, SourceMeta, TensorRef
from osdpipe.io.formats.safe_load import (
    Window,
    check_torch_zip,
    damaged,
    first_line,
    read_dcp_metadata,
    torch_load_error,
)
from osdpipe.io.remote_input import Prefetch, RemotePath, as_path
from osdpipe.layout.boxes import BoxSpans, flat_overlap, intersect, range_boxes, relative, volume

#: What to do about a damaged DCP directory.
RECOPY_DIR = "re-copy the checkpoint directory or point input.path at the directory dcp.save wrote"
_ZIP_START, _ZIP_END, _ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that runs no code from the checkpoint and names the file it finds damaged.

    Args:
        path: the checkpoint directory (a :class:`~osdpipe.io.remote_input.RemotePath` in object storage: its items
            are fetched by ranged requests, several in flight).
        metadata: its metadata, already read and checked (:func:`read_dcp_metadata`
            and :func:`check_structure`); ``None``: read it when asked.
    """

    def __init__(self, path: str | os.PathLike[str] | RemotePath, metadata: Metadata | None = None) -> None:
        remote = isinstance(path, RemotePath)
        super().__init__(str(path) if remote else path)
        if remote:
            self.path, self.fs = path, _RemoteStreams()
        self._prefetch: Prefetch | None = None
        self._metadata = metadata
        self._item: _StorageInfo | None = None
        #: The :class:`InputError` this reader raised last: DCP wraps it on its way out.
        self.error: InputError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata, unpickled by the allow-list unpickler;
        as torch's, with a ``storage_meta`` carrying this load's ID."""
        rank = kwargs.get("rank")
        try:
            if rank is None and self._metadata is not None:
                metadata = self._metadata
            else:
                metadata = read_dcp_metadata(self.path / (".metadata" if rank is None else f"__{rank}.metadata"))
        except InputError as exc:
            self.error = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> Any:
        # Every item is a torch.save archive of its own (unless a storage transform, e.g. compression, wrapped it).
        self._item = sinfo
        if isinstance(file, RemotePath):  # its bytes, fetched ahead by the plan's prefetch (with its neighbours)
            take = self._prefetch.take if self._prefetch is not None else _read_range
            data = take(file, sinfo.offset, sinfo.length)
            if len(data) != sinfo.length:
                raise InputError(
                    f"{file} is truncated: the item at bytes {sinfo.offset}..{sinfo.offset + sinfo.length} "
                    f"is cut at {len(data)} bytes; {RECOPY_DIR}"
                )
            if not sinfo.transform_descriptors:
                check_torch_zip(ViewFile(data), sinfo.length, self._where(sinfo), RECOPY_DIR)
            return ViewFile(data)
        if not sinfo.transform_descriptors:
            check_torch_zip(Window(file, sinfo.offset, sinfo.length), sinfo.length, self._where(sinfo), RECOPY_DIR)
        return super()._slice_file(file, sinfo)

    def _where(self, sinfo: _StorageInfo) -> str:
        return (
            f"the item at bytes {sinfo.offset}..{sinfo.offset + sinfo.length} "
            f"of {self.path / sinfo.relative_path}"
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._item = None
        if isinstance(self.path, RemotePath):
            self._prefetch = Prefetch(self._ranges(plan))
        try:
            return super().read_data(plan, planner)
        except InputError as exc:
            self.error = exc
            raise
        except Exception as exc:  # torch.load of an item, or the planner refusing one
            where = self._where(self._item) if self._item is not None else str(self.path)
            self.error = torch_load_error(where, exc, RECOPY_DIR)
            raise self.error from exc
        finally:
            if self._prefetch is not None:
                self._prefetch.close()
                self._prefetch = None

    def _ranges(self, plan: LoadPlan) -> list[tuple[RemotePath, int, int]]:
        """The byte ranges ``plan`` reads, in the order ``FileSystemReader.read_data`` asks for them: file by file in
        the order each first appears, each file's items in the plan's order."""
        per_file: dict[str, list[_StorageInfo]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(info)
        return [(self.path / rel, i.offset, i.length) for rel, infos in per_file.items() for i in infos]


def _read_range(path: RemotePath, start: int, length: int) -> bytes:
    return path.read_range(start, length)


class _RemoteStreams:
    """What ``FileSystemReader.read_data`` opens files through, for a checkpoint in object storage: each "stream" is
    the object's :class:`RemotePath`, whose items :meth:`SafeFileSystemReader._slice_file` fetches by range."""

    def concat_path(self, path: RemotePath, suffix: str) -> RemotePath:
        return path / suffix

    @contextmanager
    def create_stream(self, path: RemotePath, mode: str) -> Iterator[RemotePath]:
        if mode != "rb":
            raise ValueError(f"{path}: a checkpoint in object storage is read only here")
        yield path


class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
    """Builds the state dict from the checkpoint's metadata,
    as its base does, but loads non-tensor items with ``weights_only=True``.

    torch 2.13's ``DefaultLoadPlanner.load_bytes`` unpickles them with
    ``weights_only=False``, so a crafted param group value would run code.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # the planner keeps the nested dict the caller gets and each flat key's path in it
            put_at(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def check_structure(metadata: Metadata, directory: Path | RemotePath, key: str | None) -> None:
    """Check that the directory holds everything ``metadata`` names, without reading a tensor.

    Checked: the metadata's own shape (types, paths that stay inside the
    directory, tensor chunks in bounds and covering each tensor, a storage
    entry for every chunk and every non-tensor item); every file the storage
    entries name exists and is long enough for them; each item under ``key``
    (``None``: every item) begins and ends as a torch.save archive does.

    Raises:
        InputError: naming the ``.metadata`` or the ``.distcp`` file that is wrong.
    """
    where = directory / ".metadata"

    def bad(reason: str) -> InputError:
        return damaged(str(where), reason, RECOPY_DIR, what="DCP metadata")

    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise bad("it has no state_dict_metadata or storage_data tables")
    if not isinstance(metadata.planner_data, dict):
        raise bad("it has no planner data; osdpipe reads DCP checkpoints dcp.save wrote with its default planner")
    for flat, path in metadata.planner_data.items():
        if not isinstance(flat, str) or not isinstance(path, (tuple, list)) or flat not in metadata.state_dict_metadata:
            raise bad(f"its planner data names {flat!r}, which its state_dict_metadata does not hold")
    needed: dict[str, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"its storage table holds a {type(info).__name__} where DCP keeps storage entries")
        rel = info.relative_path
        if not isinstance(rel, str) or not _inside(rel):
            raise bad(f"it names the storage file {rel!r}, which is not a file inside the checkpoint directory")
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            raise bad(f"the storage entry of {index.fqn} has offset {info.offset!r} and length {info.length!r}")
        needed[rel] = max(needed[rel], info.offset + info.length)
    for flat, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(flat) not in metadata.storage_data:
                raise bad(f"it has no storage entry for {flat}")
        elif isinstance(md, TensorStorageMetadata):
            _check_tensor(flat, md, metadata.storage_data, bad)
        else:
            raise bad(f"the entry of {flat} is a {type(md).__name__}, not a DCP storage description")
    for rel, size in sorted(needed.items()):
        path = directory / rel
        if not path.is_file():
            users = sum(1 for i in metadata.storage_data.values() if i.relative_path == rel)
            raise InputError(f"{path} is missing (the metadata keeps {users} item(s) in it); {RECOPY_DIR}")
        have = path.stat().st_size
        if have < size:
            raise InputError(f"{path} is truncated: {have} bytes, the metadata needs {size}; {RECOPY_DIR}")
    if not isinstance(directory, RemotePath):
        # In object storage each item's ends are checked as the item is fetched (_slice_file): two ranged requests per
        # item here cost a request's latency each, and a store that reads the whole object to serve a range (moto,
        # some gateways) the whole file each.
        _check_item_bounds(metadata, directory, key)


def _inside(rel: str) -> bool:
    """Whether ``rel`` is a relative path that stays inside the directory (no ``..``, not absolute)."""
    pure = PurePosixPath(rel)
    return bool(rel) and not pure.is_absolute() and ".." not in pure.parts and "\\" not in rel and ":" not in rel


def _check_tensor(flat: str, md: TensorStorageMetadata, storage: dict[Any, Any], bad: Any) -> None:
    """A tensor's description: a dtype, a size, chunks inside it that cover it, each with a storage entry."""
    if not isinstance(md.properties, TensorProperties) or not isinstance(md.properties.dtype, torch.dtype):
        raise bad(f"the entry of {flat} has no tensor dtype")
    size = tuple(md.size) if isinstance(md.size, (tuple, list)) else None
    if size is None or not all(isinstance(d, int) and d >= 0 for d in size) or not isinstance(md.chunks, list):
        raise bad(f"the entry of {flat} has no valid size or chunk list")
    covered = 0
    for chunk in md.chunks:
        offsets, sizes = tuple(getattr(chunk, "offsets", ())), tuple(getattr(chunk, "sizes", ()))
        fits = len(offsets) == len(sizes) == len(size) and all(
            isinstance(o, int) and isinstance(s, int) and 0 <= o and 0 <= s and o + s <= d
            for o, s, d in zip(offsets, sizes, size, strict=False)
        )
        if not fits:
            raise bad(f"a chunk of {flat} (offsets {offsets}, sizes {sizes}) lies outside its size {size}")
        if MetadataIndex(flat, torch.Size(offsets)) not in storage:
            raise bad(f"it has no storage entry for the chunk of {flat} at {offsets}")
        covered += math.prod(sizes)
    if covered != math.prod(size):
        raise bad(f"the chunks of {flat} hold {covered} of its {math.prod(size)} elements")


def _check_item_bounds(metadata: Metadata, directory: Path, key: str | None) -> None:
    """Each item under ``key`` (``None``: every item) begins with a zip
    header and ends with a zip index end, as a torch.save archive does.

    Two small reads per item: they catch offsets that point astray and item
    boundaries that were overwritten, before any rank loads a tensor.
    """
    prefix = f"{key}."
    by_file: dict[str, list[_StorageInfo]] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        if (key is None or index.fqn == key or index.fqn.startswith(prefix)) and not info.transform_descriptors:
            by_file[info.relative_path].append(info)
    for rel, infos in by_file.items():
        path = directory / rel
        for info, start, end in _item_ends(path, sorted(infos, key=lambda i: i.offset)):
            if start != _ZIP_START or end != _ZIP_END:
                raise damaged(
                    f"the item at bytes {info.offset}..{info.offset + info.length} of {path}",
                    "it does not begin and end as a torch.save archive: "
                    "the file is overwritten or the metadata's offsets are wrong",
                    RECOPY_DIR,
                )


def _item_ends(path: Path, infos: list[_StorageInfo]) -> Iterator[tuple[_StorageInfo, bytes, bytes]]:
    """Each item's first 4 bytes and the 4 where its zip index end begins."""
    with open(path, "rb") as f:
        for info in infos:
            f.seek(info.offset)
            start = f.read(4)
            f.seek(info.offset + info.length - _ZIP_END_SIZE)
            end = f.read(4) if info.length >= _ZIP_END_SIZE else b""
            yield info, start, end


def _cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException``, else ``exc``."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


def _flattened_part(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(("state.", "param_groups."))


def nested_paths(planner_data: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """Each stored item's path in the saved state dict, a flattened optimizer's as the nested one's.

    ``flatten_optimizer_state_dict=True`` (torchtitan) stores
    ``<key>.state.<fqn>.<name>`` as the path ``(key, "state.<fqn>.<name>")``;
    here it is ``(key, "state", fqn, name)``, as an optimizer state dict saved
    nested has it (the flat key, the dotted path, is the same string). State
    and hyperparameter names hold no dot, so the last part is the name and
    the rest the FQN, dots and all.
    """
    out = {}
    for flat, path in planner_data.items():
        if len(path) == 2 and _flattened_part(path[1]):
            section, _, rest = path[1].partition(".")
            fqn, _, name = rest.rpartition(".")
            path = (path[0], section, fqn, name)
        out[flat] = tuple(path)
    return out


def unflatten_optimizer(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict
    (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``) as the nested one.

    Flattening keeps each parameter's hyperparameters, not its group. Groups
    are rebuilt from consecutive parameters (in the order they were saved)
    with the same hyperparameters: where two groups next to each other had
    the same ones, they come back as one (``optim.param_groups`` then says
    how the target groups them).
    """
    state: dict[str, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if section == "state":
            state.setdefault(fqn, {})[name] = value
        elif section == "param_groups":
            per_param.setdefault(fqn, {})[name] = value
    groups: list[dict[str, Any]] = []
    for fqn, hyper in per_param.items():
        if groups and {k: v for k, v in groups[-1].items() if k != "params"} == hyper:
            groups[-1]["params"].append(fqn)
        else:
            groups.append({**hyper, "params": [fqn]})
    return {"state": state, "param_groups": groups} if groups else {"state": state}


class DcpCheckpoint:
    """A DCP checkpoint directory, opened once:
    its metadata read and checked, any stored item read by its flat key, without a process group.

    Opening it reads and checks the metadata and the directory's structure
    (:func:`check_structure`): no tensor is read until asked for. Views of
    its parts read through it: the optimizer's state (:class:`DcpReader`) and
    a whole checkpoint's model weights (:class:`DcpWeights`).

    Raises:
        InputError: from the constructor, for a directory that is not an intact DCP checkpoint.
    """

    def __init__(self, path: str, check: str | None) -> None:
        self.path = path
        #: The directory: a local :class:`~pathlib.Path`, or a :class:`~osdpipe.io.remote_input.RemotePath`.
        self.directory = directory = as_path(path)
        if not directory.is_dir():
            raise InputError(
                f"{path} is not a directory; a dcp input is the directory dcp.save wrote (it holds .metadata)"
            )
        self.metadata: Metadata = read_dcp_metadata(directory / ".metadata")
        check_structure(self.metadata, directory, check)
        #: Each stored item's path in the saved state dict,
        #: a flattened optimizer's as the nested one's (:func:`nested_paths`).
        self.paths: dict[str, tuple[Any, ...]] = nested_paths(self.metadata.planner_data)
        self._kept: tuple[MetadataIndex, torch.Tensor] | None = None  # read_range: the last chunk read
        self._whole_kept: tuple[str, torch.Tensor] | None = None  # read_range: the last tensor read whole
        self._prefetch: Prefetch | None = None  # read_range in object storage: the items expect() planned
        self._maps: dict[str, mmap.mmap] = {}  # a local checkpoint's files, mapped once each
        self._views: dict[MetadataIndex, torch.Tensor] = {}  # each chunk read, as a flat view of its mapped file
        self._mapped_items: dict[str, bool] = {}  # each item: whether its chunks are read as mapped views
        self._chunk_spans: dict[str, BoxSpans] = {}  # each item's chunks by where they lie in its flattened view
        #: Told the bytes of each stored tensor :meth:`read_range` reads (a chunk, or a tensor read whole), as it
        #: reads them: a long read's progress (``None``: nobody asks).
        self.on_read: Callable[[int], None] | None = None

    def tops(self) -> list[str]:
        """The top-level keys of the saved state dict."""
        return sorted({str(p[0]) for p in self.paths.values() if p})

    def load(self, flat_keys: set[str]) -> dict[str, Any]:
        """The items of ``flat_keys``, read as the nested state dict they were saved in."""
        if not flat_keys:
            return {}
        # no_dist: each rank reads its own keys when it needs them, with no
        # collective, so ranks never wait on each other here. The planner
        # builds the state dict from the checkpoint's own metadata. Both are
        # private in torch 2.13: they are what _load_state_dict_from_keys uses,
        # minus its collective when a process group exists.
        out: dict[str, Any] = {}
        reader = SafeFileSystemReader(self.directory, self.metadata)
        try:
            _load_state_dict(out, storage_reader=reader, planner=SafeLoadPlanner(keys=flat_keys), no_dist=True)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            if reader.error is not None:
                raise reader.error from None
            raise InputError(
                f"{self.path}: reading {len(flat_keys)} key(s) of the DCP checkpoint failed "
                f"({first_line(_cause(exc))}); {RECOPY_DIR}"
            ) from exc
        return out

    def is_tensor(self, flat: str) -> bool:
        """Whether item ``flat`` is a tensor of at least one dimension (else a 0-dim tensor or bytes: small state)."""
        md = self.metadata.state_dict_metadata[flat]
        return isinstance(md, TensorStorageMetadata) and len(md.size) > 0

    def ref(self, flat: str) -> TensorRef:
        """Item ``flat``, a tensor, described without its bytes."""
        md = self.metadata.state_dict_metadata[flat]
        return TensorRef(tuple(md.size), str(md.properties.dtype).removeprefix("torch."))

    def read_range(self, flat: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor item ``flat``'s flattened view, not to be written to:
        :meth:`read_parts` joined (a view where the range lies in one chunk)."""
        parts = self.read_parts(flat, start, stop)
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return torch.empty(0, dtype=self.metadata.state_dict_metadata[flat].properties.dtype)
        return torch.cat(parts)

    def read_parts(self, flat: str, start: int, stop: int) -> list[torch.Tensor]:
        """Elements ``[start, stop)`` of tensor item ``flat``'s flattened view as the stored chunks that hold them
        hold them: each chunk's share, in order, not to be written to.

        A local checkpoint's chunks are read in place: each a view of its file mapped into memory (:meth:`_mapped`),
        of any box (TP's column blocks, a flattened bucket's range), so a range reads what it needs and no more, and
        :meth:`release` lets its pages go. In object storage, or where an item's bytes are transformed (compressed),
        a chunk is read whole (DCP stores each as a ``torch.save`` archive of its own) and the last one kept; a share
        under half its chunk is a copy, so that the parts never hold more than twice their own bytes; where such a
        chunk does not span whole rows, the whole tensor is read once and kept until another is asked for.
        """
        if self._maps_chunks(flat):
            shares = self._mapped_parts(flat, start, stop, counted=False)
            if shares is None or len(shares) > _MOST_VIEWS:
                return [self._assembled(flat, start, stop)]
            if self.on_read is not None:
                self.on_read(sum(part.nbytes for _, part in shares))
            return [part for _, part in shares]
        chunks = self._row_chunks(flat)
        if chunks is None:
            return [self._whole(flat).view(-1)[start:stop]]
        row = math.prod(tuple(self.metadata.state_dict_metadata[flat].size)[1:])
        parts = []
        for c in chunks:
            base = c.offsets[0] * row
            lo, hi = max(start, base), min(stop, base + c.sizes[0] * row)
            if lo < hi:
                share = self._chunk(flat, c).view(-1)[lo - base : hi - base]
                parts.append(share if 2 * (hi - lo) >= c.sizes[0] * row else share.clone())
        return parts

    def release(self, flat: str, start: int, stop: int) -> None:
        """Done with elements ``[start, stop)`` of ``flat``: the pages of a memory-mapped chunk under them let go
        (:func:`~osdpipe.core.memory.drop_mapped_pages`); a chunk read whole is dropped when the next is read."""
        if not self._maps_chunks(flat):
            return
        size = tuple(self.metadata.state_dict_metadata[flat].size)
        for box, chunk in self._spans(flat).reaching(start, stop):
            runs = flat_overlap(size, box, start, stop)
            if runs:  # the chunk's elements from the first of the range to its last: one stretch of its file
                first, last = _local_index(size, box, runs[0][0]), _local_index(size, box, runs[-1][1] - 1)
                drop_mapped_pages(_stretch(self._mapped(flat, chunk), first, last))

    def _assembled(self, flat: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of a memory-mapped item as one tensor of their own, copied a box at a time
        (:func:`~osdpipe.layout.boxes.range_boxes` against each chunk's box): what a range that crosses many rows of
        column blocks (a TP-split weight's) is read as, rather than a view per row.

        Raises:
            InputError: the chunks do not hold every element of the range.
        """
        md = self.metadata.state_dict_metadata[flat]
        size = tuple(md.size)
        out = torch.empty(stop - start, dtype=md.properties.dtype)
        at = covered = 0
        for box in range_boxes(size, start, stop):
            count = volume(box)
            held = out[at : at + count].view(tuple(hi - lo for lo, hi in box))
            for chunk_box, chunk in self._spans(flat).reaching(start + at, start + at + count):
                both = intersect(box, chunk_box)
                if both is not None:
                    held[relative(both, box)] = self._mapped(flat, chunk)[relative(both, chunk_box)]
                    covered += volume(both)
            at += count
        if self.on_read is not None:
            self.on_read(out.nbytes)
        if covered != stop - start:
            raise InputError(f"{self.path}: the chunks of {flat} hold {covered} of elements [{start}, {stop}); "
                             f"{RECOPY_DIR}")
        return out

    def _spans(self, flat: str) -> BoxSpans:
        """``flat``'s chunks by the flat ranges their boxes reach (each chunk stands for itself)."""
        if flat not in self._chunk_spans:
            md = self.metadata.state_dict_metadata[flat]
            self._chunk_spans[flat] = BoxSpans(tuple(md.size), (
                (tuple((o, o + n) for o, n in zip(c.offsets, c.sizes)), c) for c in md.chunks))
        return self._chunk_spans[flat]

    def read_chunk(self, flat: str, offsets: tuple[int, ...]) -> torch.Tensor:
        """The stored chunk of ``flat`` whose box starts at ``offsets``, shaped as stored, not to be written to (what
        a check holds against the chunk a rank wrote).

        Raises:
            InputError: the checkpoint has no such chunk.
        """
        md = self.metadata.state_dict_metadata.get(flat)
        chunk = next((c for c in getattr(md, "chunks", ()) if tuple(c.offsets) == tuple(offsets)), None)
        if chunk is None:
            raise InputError(f"{self.path} holds no chunk of {flat} at {tuple(offsets)}; {RECOPY_DIR}")
        if self._maps_chunks(flat):
            return self._mapped(flat, chunk)
        return self._chunk(flat, chunk)

    def _maps_chunks(self, flat: str) -> bool:
        """Whether ``flat``'s chunks are read as memory-mapped views: a local checkpoint's, stored as they are."""
        if flat not in self._mapped_items:
            md = self.metadata.state_dict_metadata[flat]
            self._mapped_items[flat] = not isinstance(self.directory, RemotePath) and not any(
                self.metadata.storage_data[MetadataIndex(flat, c.offsets)].transform_descriptors for c in md.chunks)
        return self._mapped_items[flat]

    def _mapped_parts(
        self, flat: str, start: int, stop: int, counted: bool = True
    ) -> list[tuple[int, torch.Tensor]] | None:
        """Each chunk's share of elements ``[start, stop)`` of ``flat``, as ``(where it starts in the flattened
        tensor, view)``, in order: a chunk of a box that cuts a later dimension gives one share per row it holds;
        ``None`` where a chunk it reaches is stored strided (no run of it is a view: :meth:`_assembled` copies)."""
        size = tuple(self.metadata.state_dict_metadata[flat].size)
        out = []
        for box, chunk in self._spans(flat).reaching(start, stop):
            runs = flat_overlap(size, box, start, stop)
            if not runs:
                continue
            local = self._mapped(flat, chunk)
            if not local.is_contiguous():
                return None
            local = local.view(-1)
            for lo, hi in runs:
                at = _local_index(size, box, lo)
                out.append((lo, local[at : at + hi - lo]))
                if counted and self.on_read is not None:
                    self.on_read((hi - lo) * local.element_size())
        out.sort(key=lambda part: part[0])
        return out

    def _mapped(self, flat: str, chunk: Any) -> torch.Tensor:
        """One stored chunk of ``flat`` as a view of its file mapped into memory (not to be written to), shaped and
        strided as it was saved, its archive checked once (:func:`~osdpipe.io.formats.safe_load.check_torch_zip`) and
        its tensor described by torch's own loader without its bytes (``torch.serialization.skip_data``)."""
        index = MetadataIndex(flat, torch.Size(chunk.offsets))
        if index in self._views:
            return self._views[index]
        info = self.metadata.storage_data[index]
        path = Path(self.path) / info.relative_path
        where = f"the item at bytes {info.offset}..{info.offset + info.length} of {path}"
        dtype = self.metadata.state_dict_metadata[flat].properties.dtype
        if info.relative_path not in self._maps:
            with open(path, "rb") as f:
                self._maps[info.relative_path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        mapped = self._maps[info.relative_path]
        try:
            window = Window(_MappedFile(mapped), info.offset, info.length)
            records = check_torch_zip(window, info.length, where, RECOPY_DIR)
            window.seek(0)
            with torch.serialization.skip_data():
                skeleton = torch.load(window, map_location="cpu", weights_only=True)
        except InputError:
            raise
        except Exception as exc:  # torch.load raises several types for a damaged item
            raise torch_load_error(where, exc, RECOPY_DIR) from exc
        data = [span for name, span in records.items() if "/data/" in name]
        if (
            not torch.is_tensor(skeleton) or tuple(skeleton.shape) != tuple(chunk.sizes) or skeleton.dtype != dtype
            or len(data) != 1 or data[0][1] - data[0][0] != skeleton.untyped_storage().nbytes()
        ):
            raise damaged(
                where, f"it does not hold the {tuple(chunk.sizes)} chunk of {flat} the metadata describes", RECOPY_DIR
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only map: nothing writes through the view
            storage = torch.frombuffer(mapped, dtype=dtype, count=(data[0][1] - data[0][0]) // dtype.itemsize,
                                       offset=info.offset + data[0][0])
        # as stored: a chunk saved as a strided view of a larger tensor stays one (a flat copy of it would be held for
        # the rest of the run); its ranges are copied out of it box by box (:meth:`_assembled`)
        self._views[index] = view = storage.as_strided(skeleton.shape, skeleton.stride(), skeleton.storage_offset())
        return view

    def _row_chunks(self, flat: str) -> list[Any] | None:
        """Tensor item ``flat``'s stored chunks in order, where each spans whole rows and is stored as it is (a
        ``torch.save`` archive); ``None`` where :meth:`read_range` reads the whole tensor instead."""
        md = self.metadata.state_dict_metadata[flat]
        size = tuple(md.size)
        chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
        rows_only = all(
            tuple(c.offsets[1:]) == (0,) * (len(size) - 1) and tuple(c.sizes[1:]) == size[1:] for c in chunks
        )
        if not rows_only or any(
            self.metadata.storage_data[MetadataIndex(flat, c.offsets)].transform_descriptors for c in chunks
        ):
            return None
        return chunks

    def expect(self, reads: Iterable[tuple[str, int, int]]) -> None:
        """The element ranges (flat key, start, stop) :meth:`read_range` is about to be asked for, in that order.

        In object storage the items holding them are fetched ahead, each object's neighbours as one request
        (:class:`~osdpipe.io.remote_input.Prefetch`): the shard stage and the roundtrip check know a rank's reads
        before they make them, and a request per item costs a round trip each (on a store that reads the whole
        object to serve a range, the whole object each). Replaces what an earlier call planned; no reads: the
        bytes fetched and not read are let go. A local directory is read as before: nothing happens.
        """
        if not isinstance(self.directory, RemotePath):
            return
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        self._kept = None  # a kept chunk would be used, not taken, and its request held until the next call
        wanted = []
        for flat, start, stop in reads:
            chunks = self._row_chunks(flat)
            if chunks is None:  # read whole, through DCP's reader and its own prefetch
                continue
            row = math.prod(tuple(self.metadata.state_dict_metadata[flat].size)[1:])
            for c in chunks:
                if max(start, c.offsets[0] * row) < min(stop, (c.offsets[0] + c.sizes[0]) * row):
                    info = self.metadata.storage_data[MetadataIndex(flat, c.offsets)]
                    wanted.append((self.directory / info.relative_path, info.offset, info.length))
        if wanted:
            self._prefetch = Prefetch(wanted)

    def stored(self, flat: str) -> bytes | None:
        """The bytes non-tensor item ``flat`` is stored as (a ``torch.save`` archive of its value), unread;
        ``None`` where they are transformed (compressed) and mean nothing without DCP's transform."""
        info = self.metadata.storage_data[MetadataIndex(flat)]
        if info.transform_descriptors:
            return None
        if isinstance(self.directory, RemotePath):
            raw = (self.directory / info.relative_path).read_range(info.offset, info.length)
        else:
            with open(Path(self.path) / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
        if len(raw) != info.length:
            raise InputError(
                f"{self.directory / info.relative_path} is truncated: "
                f"the item {flat} needs bytes up to {info.offset + info.length}; {RECOPY_DIR}"
            )
        return raw

    def read_item(self, flat: str) -> Any:
        """Item ``flat``'s value, read whole:
        a tensor, or the object a non-tensor item was saved as (unpickled by DCP's reader)."""
        loaded: Any = self.load({flat})
        for part in self.metadata.planner_data[flat]:  # the path it was saved under (a flattened optimizer's, as saved)
            loaded = loaded[part]
        return loaded

    def _chunk(self, flat: str, chunk: Any) -> torch.Tensor:
        """One stored chunk of ``flat``, read from its item (the last one read is kept)."""
        index = MetadataIndex(flat, torch.Size(chunk.offsets))
        if self._kept is not None and self._kept[0] == index:
            return self._kept[1]
        self._kept = None  # freed before the next is read: one chunk in memory at a time
        info = self.metadata.storage_data[index]
        where = (
            f"the item at bytes {info.offset}..{info.offset + info.length} of {self.directory / info.relative_path}"
        )
        try:
            if isinstance(self.directory, RemotePath):  # fetched ahead (expect), else one ranged request for the item
                path = self.directory / info.relative_path
                take = self._prefetch.take if self._prefetch is not None else _read_range
                data = take(path, info.offset, info.length)
                tensor = torch.load(ViewFile(data), map_location="cpu", weights_only=True)
            else:
                with open(Path(self.path) / info.relative_path, "rb") as f:
                    tensor = torch.load(Window(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises several types for a damaged item
            raise torch_load_error(where, exc, RECOPY_DIR) from exc
        if (
            not torch.is_tensor(tensor)
            or tuple(tensor.shape) != tuple(chunk.sizes)
            or tensor.dtype != self.metadata.state_dict_metadata[flat].properties.dtype
        ):
            raise damaged(
                where, f"it does not hold the {tuple(chunk.sizes)} chunk of {flat} the metadata describes", RECOPY_DIR
            )
        self._kept = (index, tensor.contiguous())
        if self.on_read is not None:
            self.on_read(tensor.nbytes)
        return self._kept[1]

    def _whole(self, flat: str) -> torch.Tensor:
        """The whole tensor, read once and kept until another is asked for."""
        if self._whole_kept is None or self._whole_kept[0] != flat:
            self._whole_kept = None
            self._whole_kept = (flat, self.read_item(flat).contiguous())
            if self.on_read is not None:
                self.on_read(self._whole_kept[1].nbytes)
        return self._whole_kept[1]


class _MappedFile:
    """A file mapped into memory, read as a file is (what :class:`~osdpipe.io.formats.safe_load.Window` reads)."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self.mapped, self.pos = mapped, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.mapped) + pos
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = len(self.mapped) if size is None or size < 0 else min(len(self.mapped), self.pos + size)
        data, self.pos = self.mapped[self.pos : end], max(self.pos, end)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)


#: The most views of its chunks a range of a memory-mapped item is read as; a range that would take more (the rows of
#: a column block) is copied into one tensor instead (:meth:`DcpCheckpoint._assembled`).
_MOST_VIEWS = 8


def _stretch(view: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """The stored bytes of ``view`` (a chunk as saved, maybe strided) from its element ``first`` to ``last`` (in its
    row-major order), as one flat view of its storage: what a range of it read lies in."""
    def at(index: int) -> int:
        offset = view.storage_offset()
        for n, stride in zip(reversed(view.shape), reversed(view.stride())):
            index, i = divmod(index, n)
            offset += i * stride
        return offset

    lo, hi = at(first), at(last)
    storage = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())
    return storage[min(lo, hi) : max(lo, hi) + 1]


def _local_index(size: tuple[int, ...], box: tuple[tuple[int, int], ...], flat: int) -> int:
    """Where element ``flat`` of a tensor of ``size`` (inside ``box``) is in the box's own row-major order."""
    coords = []
    for n in reversed(size):
        flat, index = divmod(flat, n)
        coords.append(index)
    local = 0
    for c, (lo, hi) in zip(reversed(coords), box):
        local = local * (hi - lo) + c - lo
    return local


class DcpReader:
    """The optimizer state under ``key`` of a DCP checkpoint (:class:`DcpCheckpoint`),
    as a :class:`~osdpipe.io.formats.base.SourceReader`.

    Raises:
        InputError: from the constructor, for a directory that is not an intact DCP checkpoint with ``key``.
    """

    def __init__(self, path: str, key: str, checkpoint: DcpCheckpoint | None = None) -> None:
        self.path, self.key = path, key
        self.checkpoint = checkpoint or DcpCheckpoint(path, key)
        self.metadata: Metadata = self.checkpoint.metadata
        self.paths = self.checkpoint.paths
        #: The optimizer state was saved flattened (``flatten_optimizer_state_dict=True``, as torchtitan saves it).
        self.flattened = any(
            len(p) == 2 and _flattened_part(p[1]) for p in self.metadata.planner_data.values() if p[:1] == (key,)
        )
        if not any(p[:1] == (key,) for p in self.paths.values()):
            raise InputError(
                f"DCP checkpoint {path} has no top-level key {key!r} (it has {self.checkpoint.tops()}); set input.key"
            )

    def _under_key(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """What ``load`` read under the key,
        as the nested optimizer state dict (``state``, ``param_groups``) however it was saved."""
        under = loaded.get(self.key, {})
        return unflatten_optimizer(under) if self.flattened else under

    def _flat_key(self, *path: Any) -> str:
        return ".".join(str(p) for p in (self.key, *path))

    def meta(self) -> SourceMeta:
        if not any(p[:2] == (self.key, "param_groups") for p in self.paths.values()):
            held = sorted({".".join(map(str, p[1:3])) for p in self.paths.values() if p[:1] == (self.key,)})[:4]
            raise InputError(
                f"DCP checkpoint {self.path} holds no optimizer state under {self.key!r} "
                f"(no param_groups; it holds {held}); "
                "a dcp input is an optimizer state dict (FSDP.optim_state_dict or get_optimizer_state_dict) "
                "saved under input.key"
            )
        small = {k for k, p in self.paths.items() if p[:1] == (self.key,) and not self.checkpoint.is_tensor(k)}
        loaded = self._under_key(self.checkpoint.load(small))
        state: dict[str, dict[str, Any]] = {}
        for flat, path in self.paths.items():
            if path[:2] != (self.key, "state") or len(path) != 4:
                continue
            fqn, name = path[2], path[3]
            if self.checkpoint.is_tensor(flat):
                state.setdefault(fqn, {})[name] = self.checkpoint.ref(flat)
            else:
                state.setdefault(fqn, {})[name] = loaded["state"][fqn][name]
        groups = loaded.get("param_groups")
        if isinstance(groups, dict):  # flattened lists come back keyed by index
            groups = [groups[i] for i in sorted(groups)]
        if groups is not None and not (
            isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        ):
            raise InputError(
                f"{self.path}: {self.key}.param_groups is not a list of groups with 'params' lists; "
                "a dcp input holds an optimizer state dict (FSDP.optim_state_dict or get_optimizer_state_dict) "
                "under input.key"
            )
        return SourceMeta(state=state, param_groups=groups)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        wanted = {self._flat_key("state", fqn, name): (fqn, name) for fqn, name in items}
        loaded = self._under_key(self.checkpoint.load(set(wanted))).get("state", {})
        return {(fqn, name): loaded[fqn][name] for fqn, name in wanted.values()}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        """The range, read from the stored chunks that hold it (see :meth:`DcpCheckpoint.read_range`)."""
        return self.checkpoint.read_range(self._flat_key("state", fqn, name), start, stop)

    def read_parts(self, fqn: str, name: str, start: int, stop: int) -> list[torch.Tensor]:
        """The range as the stored chunks that hold it hold it (see :meth:`DcpCheckpoint.read_parts`)."""
        return self.checkpoint.read_parts(self._flat_key("state", fqn, name), start, stop)

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        """Done with the range (see :meth:`DcpCheckpoint.release`)."""
        self.checkpoint.release(self._flat_key("state", fqn, name), start, stop)

    def expect(self, reads: Iterable[tuple[str, str, int, int]]) -> None:
        """The ranges ``(fqn, name, start, stop)`` about to be read, in order (see :meth:`DcpCheckpoint.expect`)."""
        self.checkpoint.expect((self._flat_key("state", fqn, name), start, stop) for fqn, name, start, stop in reads)
