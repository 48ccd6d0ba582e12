"""Read checkpoint bytes that nobody vouches for: no code runs, and damage is named in one line.

A checkpoint is data from somewhere else: a bucket, a colleague's directory, a
half-finished copy. Two things can go wrong, and both must end in one line
that names the file (:class:`~osdpipe.io.formats.InputError`), never in a
traceback or, worse, in code running:

* **Code.** ``torch.save`` files are zip archives whose ``data.pkl`` is a
  pickle; DCP's ``.metadata`` is a plain pickle. A pickle can name any
  callable. ``torch.load`` runs here only with ``weights_only=True``, and DCP
  metadata goes through :class:`DcpMetadataUnpickler`, which resolves only
  the classes DCP metadata is made of.
* **Damage.** A truncated copy or overwritten bytes give torch's internal
  messages (``[Errno 22] Invalid argument``, miniz advice, a hint about
  ``_use_new_zipfile_serialization``), or no message at all: torch ignores
  most of a zip's headers. :func:`check_torch_zip` checks the archive's
  structure first, cheaply: the index, every entry's header against it, and
  the CRC of the small records (the pickle, not the tensor bytes).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import pickle
import re
import struct
import zipfile
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath
from typing import IO, Any

import torch

from osdpipe.core.seekable import Seekable
from osdpipe.io.errors import InputError
from osdpipe.io.store import is_remote

#: What to do about a damaged file.
RECOPY = "re-copy it or point input.path at the right file"

#: The start of a file ``torch.save`` wrote in its legacy format (before torch 1.6, or with
#: ``_use_new_zipfile_serialization=False``): a protocol-2 pickle of torch's magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_DESCRIPTOR = b"PK\x07\x08"
_ZIP_END = b"PK\x05\x06"
_END_RECORD = struct.Struct("<4s4H2LH")  # signature, disk numbers, record counts, index size and offset, comment length
_ZIP64_LOCATOR, _ZIP64_END = b"PK\x06\x07", b"PK\x06\x06"
_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, offset of the zip64 end record, number of disks
# signature, record size, versions, disk numbers, record counts, index size and offset
_END64 = struct.Struct("<4sQ2H2L4Q")
# signature, version, flags, method, time, date, crc, sizes, name and extra lengths
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_DATA_DESCRIPTOR_FLAG = 0x08
_ZIP64_LIMIT = 0xFFFFFFFF
#: Records of a torch.save archive other than tensor bytes are small; their CRC is checked.
_SMALL_RECORD = 1 << 24


def first_line(exc: BaseException, limit: int = 160) -> str:
    """An exception's text cut to its first meaningful line (and sentence, when long).

    torch's messages go on for lines of advice (miniz errors, ``weights_only``);
    what a user needs is the first statement of what failed.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if "WeightsUnpickler error:" in str(exc):  # torch's advice first, the reason after it
        after = str(exc).split("WeightsUnpickler error:", 1)[1]
        text = next((line.strip() for line in after.splitlines() if line.strip()), text)
    if len(text) > limit and ". " in text[20:]:
        text = text[: text.index(". ", 20) + 1]
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if not text or isinstance(exc, (KeyError, IndexError, AttributeError, TypeError, EOFError, struct.error)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text


def damaged(where: str, reason: str, fix: str = RECOPY, *, what: str = "a torch.save file") -> InputError:
    """The one-line error for bytes that are not what they should be."""
    return InputError(f"{where} is damaged or not {what} ({reason}); {fix}")


def refused_global(exc: BaseException) -> str | None:
    """The global a ``weights_only`` load refused (``posix.system``), or ``None`` when it failed otherwise."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return None
    match = re.search(r"GLOBAL ([\w.]+)", text)
    return match.group(1) if match else None


def torch_load_error(where: str, exc: BaseException, fix: str = RECOPY) -> InputError:
    """``torch.load``'s failure on ``where`` as one line: a refused global (hostile or foreign objects), or damage."""
    name = refused_global(exc)
    if name is not None:
        return InputError(
            f"{where} holds objects torch.load refuses to load safely (GLOBAL {name}); "
            "refusing to run code from a checkpoint"
        )
    return damaged(where, first_line(exc), fix)


# ---------------------------------------------------------------- torch.save archives


def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


def _dos_time(date_time: tuple[int, ...]) -> tuple[int, int]:
    """``ZipInfo.date_time`` back to the raw DOS (time, date) fields it was parsed from."""
    year, month, day, hour, minute, second = date_time
    return (hour << 11) | (minute << 5) | (second // 2), ((year - 1980) << 9) | (month << 5) | day


def _entry_end(f: IO[bytes], info: zipfile.ZipInfo, where: str, fix: str) -> tuple[int, int]:
    """Check ``info``'s local header against the central directory; its data offset and where the entry ends."""

    name = info.filename
    raw = _read_at(f, info.header_offset, _LOCAL_HEADER.size)
    if len(raw) < _LOCAL_HEADER.size:
        raise damaged(
            where, f"the header of record {name} lies past its end: it is truncated or its zip index overwritten", fix
        )
    sig, version, flags, method, dos_time, dos_date, crc, csize, usize, nlen, elen = _LOCAL_HEADER.unpack(raw)
    if sig != _ZIP_LOCAL:
        raise damaged(where, f"the header of record {name} is overwritten", fix)
    encoded = name.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    expected = (info.extract_version, info.flag_bits, info.compress_type, *_dos_time(info.date_time), len(encoded))
    if (version, flags, method, dos_time, dos_date, nlen) != expected or (
        _read_at(f, info.header_offset + _LOCAL_HEADER.size, nlen) != encoded
    ):
        raise damaged(where, f"the header of record {name} disagrees with the zip index", fix)
    if method != zipfile.ZIP_STORED:
        raise damaged(where, f"record {name} is compressed, which torch.save never does", fix)
    # The crc and sizes are those of the index, or zero where a data descriptor after the data carries them.
    known = {(info.CRC, info.compress_size, info.file_size), (info.CRC, _ZIP64_LIMIT, _ZIP64_LIMIT)}
    if (crc, csize, usize) not in known | ({(0, 0, 0)} if flags & _DATA_DESCRIPTOR_FLAG else set()):
        raise damaged(where, f"the header of record {name} disagrees with the zip index", fix)
    start = info.header_offset + _LOCAL_HEADER.size + nlen + elen
    end = start + info.compress_size
    if flags & _DATA_DESCRIPTOR_FLAG:  # crc and sizes follow the data
        tail = _read_at(f, end, 28)
        body = tail[4:] if tail[:4] == _ZIP_DESCRIPTOR else tail
        short = (
            struct.pack("<3L", info.CRC, info.compress_size, info.file_size) if info.file_size <= _ZIP64_LIMIT else None
        )
        long = struct.pack("<L2Q", info.CRC, info.compress_size, info.file_size)
        if short is not None and body[:12] == short:
            end += len(tail) - len(body) + 12
        elif body[:20] == long:
            end += len(tail) - len(body) + 20
        else:
            raise damaged(where, f"the data descriptor of record {name} is overwritten or cut off", fix)
    return start, end


def _check_end_record(f: IO[bytes], size: int, count: int, where: str, fix: str) -> None:
    """The records that end a zip: torch.save writes them last (no comment), on one disk, counting every record.

    torch writes a zip64 end record and its locator too; a reader takes the
    index's place from either, so both must say the same: where the index
    starts, how long it is, and how many records it holds.
    """
    raw = _read_at(f, size - _END_RECORD.size, _END_RECORD.size)
    sig, disk, index_disk, here, total, index_size, index_offset, comment = _END_RECORD.unpack(raw)
    if sig != _ZIP_END or comment or disk or index_disk:
        raise damaged(where, "the end record of its zip index is overwritten", fix)
    expected = (count, count, index_size, index_offset)
    locator_at = size - _END_RECORD.size - _LOCATOR.size
    locator = _read_at(f, locator_at, _LOCATOR.size) if locator_at >= 0 else b""
    if locator[:4] == _ZIP64_LOCATOR:
        _, locator_disk, end64_at, disks = _LOCATOR.unpack(locator)
        end64 = _read_at(f, end64_at, _END64.size) if 0 <= end64_at <= locator_at - _END64.size else b""
        if locator_disk or disks != 1 or len(end64) < _END64.size:
            raise damaged(where, "the zip64 locator of its index is overwritten", fix)
        sig64, record, _, _, disk64, index_disk64, here64, total64, size64, offset64 = _END64.unpack(end64)
        if sig64 != _ZIP64_END or record != _END64.size - 12 or disk64 or index_disk64 or offset64 + size64 != end64_at:
            raise damaged(where, "the zip64 end record of its index is overwritten", fix)
        expected = (here64, total64, size64, offset64)
        if (here64, total64) != (count, count):
            raise damaged(where, "the zip64 end record of its index is overwritten", fix)
        sentinels = (0xFFFF, 0xFFFF, _ZIP64_LIMIT, _ZIP64_LIMIT)
        if any(
            v != e and v != s
            for v, e, s in zip((here, total, index_size, index_offset), expected, sentinels, strict=True)
        ):
            raise damaged(where, "the end record of its zip index disagrees with its zip64 end record", fix)
    elif (here, total) != (count, count) or index_offset + index_size != size - _END_RECORD.size:
        raise damaged(where, "the end record of its zip index is overwritten", fix)


def check_torch_zip(f: IO[bytes], size: int, where: str, fix: str = RECOPY) -> dict[str, tuple[int, int]]:
    """Check that ``f`` (``size`` bytes) is an intact ``torch.save`` archive, reading only its structure.

    Checked: the zip signature and index; every record's local header
    against the index, its data within the file and before the index, no two
    records overlapping; the CRC of every record but tensor bytes (the pickle
    above all); tensor records aligned as the archive says. Tensor bytes are
    not read: a flipped bit inside a tensor is beyond a cheap check.

    Returns:
        Each record's data, ``(start, end)`` in the file, by its name in the archive (what a reader of a file in
        object storage fetches: :mod:`osdpipe.io.remote_torchfile`).

    Raises:
        InputError: naming ``where``, what is wrong, and ``fix``.
    """

    if size == 0:
        raise damaged(where, "it is empty", fix)
    head = _read_at(f, 0, len(_LEGACY_MAGIC))
    if head == _LEGACY_MAGIC:
        raise InputError(
            f"{where} is a torch.save file in the legacy format "
            "(before torch 1.6, or _use_new_zipfile_serialization=False), which cannot be memory-mapped; "
            "re-save it with a current torch: torch.save(torch.load(f, weights_only=True), f)"
        )
    if head[:4] != _ZIP_LOCAL:
        if size < _LOCAL_HEADER.size and _ZIP_LOCAL.startswith(head[:4]):
            raise damaged(where, f"it is truncated to {size} bytes", fix)
        raise damaged(where, f"no zip signature at its start, it begins with {head[:8]!r}", fix)
    f.seek(0)
    try:
        archive = zipfile.ZipFile(f)
    except zipfile.BadZipFile as exc:
        if "not a zip file" in str(exc):
            raise damaged(
                where, "the zip index at its end is missing: the file is truncated or its end overwritten", fix
            ) from exc
        raise damaged(where, f"its zip index is unreadable: {first_line(exc)}", fix) from exc
    except Exception as exc:  # zipfile raises several types for a mangled index
        raise damaged(where, f"its zip index is unreadable: {first_line(exc)}", fix) from exc
    with archive:
        infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
        _check_end_record(f, size, len(infos), where, fix)
        names = [i.filename for i in infos]
        prefix = names[0].split("/", 1)[0] if names else ""
        if not any(n == f"{prefix}/data.pkl" for n in names) or not all(n.startswith(f"{prefix}/") for n in names):
            raise damaged(where, f"a zip archive without the records of torch.save (it holds {names[:3]})", fix)
        index_start = getattr(archive, "start_dir", size)
        align = _alignment(archive, f"{prefix}/.storage_alignment", where, fix)
        previous_end = 0
        spans: dict[str, tuple[int, int]] = {}
        for info in infos:
            if info.header_offset < previous_end:
                raise damaged(where, f"record {info.filename} overlaps the one before it", fix)
            start, end = _entry_end(f, info, where, fix)
            if end > index_start or end > size:
                raise damaged(
                    where,
                    f"record {info.filename} runs past the end of its data: "
                    "the file is truncated or its index overwritten",
                    fix,
                )
            previous_end = end
            spans[info.filename] = (start, start + info.file_size)
            if info.filename.startswith(f"{prefix}/data/"):  # tensor bytes: not read
                if align and start % align:
                    raise damaged(
                        where,
                        f"record {info.filename} is not aligned as torch.save aligns it: its header is overwritten",
                        fix,
                    )
            elif info.file_size <= _SMALL_RECORD or info.filename == f"{prefix}/data.pkl":
                _read_record(archive, info, where, fix)
    return spans


def _read_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str, fix: str) -> bytes:
    """A record's bytes, its CRC checked (zipfile checks it as the read ends)."""
    try:
        return archive.read(info)
    except Exception as exc:
        reason = "its CRC-32 does not match" if "CRC" in str(exc) else first_line(exc)
        raise damaged(where, f"record {info.filename} is overwritten: {reason}", fix) from exc


def _alignment(archive: zipfile.ZipFile, name: str, where: str, fix: str) -> int | None:
    """The alignment of tensor records that the archive declares (torch >= 2.x writes it), else ``None``."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        return None
    data = _read_record(archive, info, where, fix).strip()
    return int(data) if data.isdigit() and int(data) > 0 else None


def checked_torch_file(path: str | Path) -> Path:
    """``path``, once it is a readable file whose zip structure is a ``torch.save`` archive's (:func:`check_torch_zip`).

    Raises:
        InputError: one line naming the file: missing, not a file, unreadable or damaged.
    """
    if is_remote(str(path)):
        raise InputError(f"{path}: {NOT_READ_REMOTE}")
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p} is missing; point input.path at the checkpoint")
    if not p.is_file():
        raise InputError(f"{p} is not a file; point input.path at the checkpoint file")
    try:
        with open(p, "rb") as f:
            check_torch_zip(f, p.stat().st_size, str(p))
    except OSError as exc:
        raise InputError(f"{p} cannot be read ({first_line(exc)}); check that this user can read it") from exc
    return p


#: What a ``torch.save`` file in object storage that is not an optimizer's own (a framework's file) gets.
NOT_READ_REMOTE = (
    "this torch.save file in object storage is not read yet (an optimizer's: input.format=fsdp_full, plain, "
    "rank_local or dcp, is); copy it to a local path first"
)


def load_torch_file(path: Any) -> Any:
    """``torch.load`` a file that nobody vouches for: structure checked first, memory-mapped, ``weights_only``.

    A file in object storage (a URL, or a :class:`~osdpipe.io.remote_input.RemotePath`) is loaded without its tensor
    bytes, which its readers fetch by range as they read (:mod:`osdpipe.io.remote_torchfile`).

    Raises:
        InputError: one line naming the file: missing, unreadable, damaged,
            not a torch.save file, or holding objects that are not plain data.
    """
    if is_remote(str(path)):
        return _with_dtensors(lambda: load_remote(str(path)), str(path))
    p = checked_torch_file(path)
    return _with_dtensors(lambda: torch.load(p, map_location="cpu", mmap=True, weights_only=True), str(p))


def _with_dtensors(load: Any, where: str) -> Any:
    """``load()``, once more with DTensors readable where the file holds them; torch's failures in one line."""
    try:
        with meshes_quiet():
            try:
                return load()
            except pickle.UnpicklingError as exc:
                if "torch.distributed.tensor" not in str(exc):
                    raise
                # An FSDP2 rank's state holds DTensors, which weights_only reads once their module is imported (as
                # PyTorch allows); imported only then, as it costs most of a second that other files do not need.
                importlib.import_module("torch.distributed.tensor")
                return load()
    except InputError:
        raise
    except Exception as exc:  # torch raises several types for a bad file
        raise torch_load_error(where, exc) from exc


@contextlib.contextmanager
def meshes_quiet() -> Any:
    """Without the warning torch logs for each DeviceMesh unpickled before its process groups exist (a saved
    DTensor's mesh, read here as data: no process group of it is ever made)."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_remote(url: str, unpickler: Any = None) -> Any:
    """A ``torch.save`` file in object storage, its structure checked as a local file's is, loaded without its tensor
    bytes (:func:`osdpipe.io.remote_torchfile.load`, ``unpickler`` its unpickler).

    Raises:
        InputError: the object is missing or a folder; what the structure check raises.
    """
    from osdpipe.io import remote_torchfile
    from osdpipe.io.remote_input import as_path

    p = as_path(url)
    if not p.is_file():
        if p.is_dir():
            raise InputError(f"{p} is not a file; point input.path at the checkpoint file")
        raise InputError(f"{p} is missing; point input.path at the checkpoint")
    return remote_torchfile.load(p, lambda f, size: check_torch_zip(f, size, str(p)), unpickler)


class Window(Seekable):
    """``length`` bytes of ``base`` from ``offset``, as a seekable file of their own (one item of a DCP file)."""

    def __init__(self, base: IO[bytes], offset: int, length: int) -> None:
        super().__init__(length)
        self.base, self.offset, self.length = base, offset, length

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self.length - self.pos)
        size = left if size is None or size < 0 else min(size, left)
        self.base.seek(self.offset + self.pos)
        data = self.base.read(size)
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        size = min(len(view), max(0, self.length - self.pos))
        self.base.seek(self.offset + self.pos)
        got = self.base.readinto(view[:size])  # straight into the caller's buffer: a large tensor is not held twice
        self.pos += got
        return got


# ---------------------------------------------------------------- DCP metadata


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name

    @property
    def plausible(self) -> bool:
        """Whether the name reads as a real one (someone wrote it), rather than bytes that damage turned into a name."""
        return all(part.isidentifier() for part in f"{self.module}.{self.name}".split("."))


def _layout(name: str) -> torch.layout:
    """A ``torch.layout`` from the name it is pickled as (``torch.strided``):
    what torch's own reducer does, restricted to layouts."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def _dcp_classes() -> dict[tuple[str, str], Any]:
    """The globals DCP metadata is made of (``pickletools.dis`` of ``.metadata`` files dcp.save writes)."""
    from torch.distributed.checkpoint import filesystem, metadata  # DCP is heavy: only a dcp input needs it

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        # StorageMeta.checkpoint_id is the path dcp.save was given; a Windows path cannot be built on POSIX.
        ("pathlib", "PosixPath"): PosixPath,
        ("pathlib", "PurePosixPath"): PurePosixPath,
        ("pathlib", "WindowsPath"): PureWindowsPath,
        ("pathlib", "PureWindowsPath"): PureWindowsPath,
    }
    names = (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
    for name in names:
        if hasattr(metadata, name):
            allowed[(metadata.__name__, name)] = getattr(metadata, name)
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    # Megatron's dist_checkpointing keeps its ranks' save plans in the metadata (``mcore_data``): dataclasses and an
    # enum of DCP's planner, built by their constructors alone.
    from torch.distributed.checkpoint import planner

    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
        allowed[(planner.__name__, name)] = getattr(planner, name)
    # megatron-core up to 0.13 keeps there its own subclass, MCoreSavePlan: read as data, Megatron never imported.
    allowed[("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")] = MegatronSavePlan
    return allowed


class MegatronSavePlan:
    """megatron-core's ``MCoreSavePlan`` (up to 0.13: DCP's ``SavePlan`` and its ``mcore_data``) as plain data: made
    empty, its pickled fields set as attributes; nothing of Megatron is imported or run."""


class DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` resolving only the classes it is made of; any other global is refused.

    Allowed: the dataclasses of ``torch.distributed.checkpoint.metadata``, the
    storage info of ``torch.distributed.checkpoint.filesystem``,
    ``torch.Size``, torch dtypes, layouts and memory formats, paths (the
    checkpoint ID) and a few builtins containers. None of them runs anything
    but its own constructor.
    """

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if DcpMetadataUnpickler._allowed is None:
            DcpMetadataUnpickler._allowed = _dcp_classes()
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise RefusedGlobal(module, name)


def read_dcp_metadata(path: Path) -> Any:
    """The ``Metadata`` a DCP ``.metadata`` file holds, unpickled with :class:`DcpMetadataUnpickler`.

    Raises:
        InputError: the file is missing, damaged, not DCP metadata, or names a class DCP metadata never holds.
    """
    fix = "re-copy the checkpoint directory or point input.path at the directory dcp.save wrote"
    try:
        data = path.read_bytes()  # parsed from memory: a damaged length field cannot ask the file for more than it has
    except FileNotFoundError:
        raise InputError(
            f"{path} is missing: a DCP checkpoint directory holds .metadata and the .distcp files dcp.save wrote; "
            "point input.path at that directory"
        ) from None
    except OSError as exc:
        raise InputError(f"{path} cannot be read ({first_line(exc)}); check that this user can read it") from exc
    if not data:
        raise damaged(str(path), "it is empty", fix, what="DCP metadata")
    try:
        loaded = DcpMetadataUnpickler(io.BytesIO(data)).load()
    except RefusedGlobal as exc:
        if not exc.plausible:
            raise damaged(str(path), "it names no class DCP writes", fix, what="DCP metadata") from None
        raise InputError(
            f"{path} refers to {exc}, which a DCP checkpoint never holds; "
            "refusing to load it (not a checkpoint osdpipe can trust)"
        ) from None
    except Exception as exc:  # pickle raises many types for mangled bytes (EOFError, UnpicklingError, ValueError, ...)
        raise damaged(str(path), first_line(exc), fix, what="DCP metadata") from exc
    from torch.distributed.checkpoint.metadata import Metadata  # DCP is heavy: only a dcp input needs it

    if not isinstance(loaded, Metadata):
        raise damaged(str(path), f"it holds a {type(loaded).__name__}, not DCP Metadata", fix, what="DCP metadata")
    if loaded.planner_data is None and isinstance(loaded.state_dict_metadata, dict):
        # Megatron's dist_checkpointing saves through a planner of its own that records no planner data: each item
        # is a top-level key, named by its flat key, which is what every reader here takes planner data to say.
        loaded.planner_data = {flat: (flat,) for flat in loaded.state_dict_metadata}
    return loaded
