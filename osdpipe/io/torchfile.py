"""Writing a ``torch.save`` file at the disk's speed:
torch's own records, in an archive written front to back around the page cache.

``torch.save`` copies every byte into the page cache, and on a fresh file
the kernel must first find pages for them: on the machines this runs on
that costs more than the disk itself (about 0.4 GB/s into new pages against
about 2 GB/s to the disk). So osdpipe writes the archive itself:

* the records are torch's own: ``torch.serialization._save`` pickles the
  object and hands each record (the pickle, the tensors' storages) to
  :class:`Archive` as it hands them to its own zip writer, so ``torch.load``
  (``weights_only``, ``mmap``) reads the file as any ``torch.save`` file;
* the archive is a zip file as torch writes one: stored records, each
  record's data at a multiple of 64 bytes (padding in its header's extra
  field), ZIP64 where a size or an offset needs it. Sizes are known before
  a record is written, so each header is written once, in front of its
  data, with no data descriptor and no seek back. The small records carry
  their CRC-32; a storage record carries 0, as ``torch.save`` writes it when
  ``torch.utils.serialization.config.save.compute_crc32`` is off, since
  ``torch.load`` never checks it and the manifest's sha256 guards the bytes;
* the file is written through :class:`DirectFile`: bytes go from the
  tensor's memory through a page-aligned buffer straight to the disk
  (``O_DIRECT``), the buffer written by a second thread while the next is
  filled, and hashed by a third as it passes, once.

Every byte is hashed once, and that one pass gives both digests the manifest
records: the file is cut into pieces, each storage record's data a piece of
its own and the bytes between them the others, and each piece's sha256 is
taken. A storage's digest is its piece's; the file's is a
:class:`PieceDigest`, the sha256 of its pieces' digests, one hex line each
(:func:`pieces_digest` says it in full, and checks a file by it).

Same object, same bytes: the file depends on its content only.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pickle
import struct
import sys
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol

import torch

#: What torch aligns a storage's bytes to in the archive (``_get_storage_alignment``).
ALIGNMENT = 64
#: The block ``O_DIRECT`` writes in: offsets, lengths and the buffer's address are multiples of it.
BLOCK = 4096
#: How many bytes each buffer holds: large writes, few calls.
BUFFER_BYTES = 16 << 20
#: How many buffers: one filling, one being hashed while an earlier one is written,
#: one to spare for the slower of the two.
BUFFERS = 3
#: The name torch gives an archive written to a file object, and every record's directory in it.
ARCHIVE = "archive"

# signature, version, flags, method, time, date, crc, sizes, name and extra lengths
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_UTF8 = 0x0800
#: What a 32-bit size or offset field holds where the ZIP64 extra field has the value.
_ZIP64_MARK = 0xFFFFFFFF
#: From which size or offset on a record needs ZIP64 (a test lowers it to see those structures on small files).
ZIP64_FROM = 0xFFFFFFFF
_PAD_ID = 0x4246  # "FB": the extra field torch pads a header with


class PieceDigest(str):
    """A file's digest made of its pieces' (the hex string itself), with the pieces' lengths in ``pieces``.

    A ``str``, so it travels wherever a file's sha256 does; the commit
    writes its ``pieces`` into the manifest, where a reader needs them to
    check the file (:func:`pieces_digest`).
    """

    pieces: tuple[int, ...]

    def __new__(cls, hexdigest: str, pieces: tuple[int, ...]) -> PieceDigest:
        made = super().__new__(cls, hexdigest)
        made.pieces = pieces
        return made

    def __reduce__(self) -> tuple[Any, ...]:  # gathered from other ranks: keep the pieces
        return (PieceDigest, (str(self), self.pieces))


def digest_of_pieces(piece_digests: list[str]) -> str:
    """The file's digest from its pieces' sha256 (hex, in file order): the sha256 of one ``<hex>\n`` line per piece."""
    return hashlib.sha256("".join(f"{d}\n" for d in piece_digests).encode()).hexdigest()


def pieces_digest(path: Path, pieces: list[int]) -> str:
    """A file's digest as :class:`DirectFile` takes it, read back:
    the sha256 of each of its ``pieces`` (lengths, in order), then :func:`digest_of_pieces`.

    What a person checking a file by hand does (``manifest.json``'s
    ``pieces``): cut the file at those lengths, ``sha256sum`` each piece, and
    ``sha256sum`` the hex digests, one per line.
    """
    digests = []
    with open(path, "rb") as f:
        for length in pieces:
            h, left = hashlib.sha256(), length
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    raise ValueError(f"{path} is shorter than its pieces say")
                h.update(chunk)
                left -= len(chunk)
            digests.append(h.hexdigest())
        if f.read(1):
            raise ValueError(f"{path} is longer than its pieces say")
    return digest_of_pieces(digests)


class Follower(Protocol):
    """Told how far a :class:`DirectFile` is written, as its bytes reach the file (see :func:`followed_as_written`):
    the bytes before ``end`` are the file's, written once and never again, so they may be read while it grows."""

    def grown(self, end: int) -> None:
        """The file holds its bytes up to ``end`` (from the writing thread, in order)."""
        ...

    def ended(self, length: int) -> None:
        """The file is whole: ``length`` bytes, closed."""
        ...

    def dropped(self) -> None:
        """The file was not finished: it is removed, and what was said of it is void."""
        ...


_FOLLOW: ContextVar[Callable[[Path], Follower | None] | None] = ContextVar("osdpipe_torchfile_follow", default=None)


@contextmanager
def followed_as_written(follow: Callable[[Path], Follower | None]) -> Iterator[None]:
    """Every file :func:`written` opens inside is followed as it is written: ``follow(path)`` gives its
    :class:`Follower` (or ``None``: not followed).

    So a rank file bound for object storage goes up in parts while it is made
    (:mod:`osdpipe.io.upload_queue`), rather than after its last byte: a
    :class:`DirectFile` is written front to back, so what it has written is
    final and can be read back while it grows.
    """
    token = _FOLLOW.set(follow)
    try:
        yield
    finally:
        _FOLLOW.reset(token)


def open_direct(path: Path, flags: int) -> tuple[int, bool]:
    """``path`` opened with ``flags`` around the page cache (``O_DIRECT``) where the filesystem takes it, else through
    it; the descriptor, and whether it is direct."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError:  # the filesystem does not take O_DIRECT: the page cache, then
            pass
    return os.open(path, flags, 0o644), False


class DirectFile:
    """A new file written front to back,
    around the page cache where the filesystem allows (``O_DIRECT``), hashed once on the way.

    Writes are copied into page-aligned buffers in turn; a full buffer is
    hashed by one thread and written by another while the next fills, so
    hashing costs no time on the way to the disk. The file is hashed in
    pieces: :meth:`cut` starts a new one at the current position (a storage
    record's data is a piece of its own), and the file's digest is made of
    the pieces' (:class:`PieceDigest`). The last block is padded to a whole
    block for ``O_DIRECT`` and the file cut back to its length. Where
    ``O_DIRECT`` is refused (``tmpfs``, some network filesystems), the same
    buffers are written through the page cache.
    """

    def __init__(self, path: Path, direct: bool = True, follower: Follower | None = None) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.fd, self.direct = open_direct(path, flags) if direct else (os.open(path, flags, 0o644), False)
        self.digest = PieceDigest("", ())  # the file's, once closed
        self._cuts = [0]  # where each piece starts; appended here, read by the hashing thread behind the writes
        self._piece = hashlib.sha256()  # the hashing thread's piece in progress, the ``_hashing``-th
        self._hashing = 0
        self._piece_digests: list[str] = []  # the pieces the hashing thread finished, in order
        # anonymous maps are page-aligned, as O_DIRECT needs
        self._buffers = [mmap.mmap(-1, BUFFER_BYTES) for _ in range(BUFFERS)]
        self._current, self._fill, self._flushed = 0, 0, 0
        # Hashing and writing each take a core's worth of time per byte;
        # in one thread they would add up, in two they overlap.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osdpipe-file-hash")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="osdpipe-write")
        self._pending: list[tuple[Future[None], Future[None]] | None] = [None] * BUFFERS
        #: told how far the file is written, by the writing thread after each buffer (:func:`followed_as_written`)
        self.follower = follower

    def tell(self) -> int:
        return self._flushed + self._fill

    def cut(self) -> int:
        """Start a new piece here (none where one starts already); returns the index of the piece that starts here."""
        here = self.tell()
        if here > self._cuts[-1]:
            self._cuts.append(here)
        return len(self._cuts) - 1

    def piece_digest(self, index: int) -> str:
        """The sha256 of piece ``index`` (after :meth:`close`)."""
        return self._piece_digests[index]

    def _hash(self, view: memoryview, start: int) -> None:
        """Hash the bytes at ``start`` on (in the hashing thread, buffer after buffer),
        finishing a piece at every cut they pass.

        A cut is made before the bytes after it are written, so the cuts
        this buffer passes are known when it is hashed; one at its very end
        is finished with the next buffer, or at :meth:`close`.
        """
        at, end = 0, len(view)
        while self._hashing + 1 < len(self._cuts) and self._cuts[self._hashing + 1] - start < end:
            boundary = self._cuts[self._hashing + 1] - start
            self._piece.update(view[at:boundary])
            self._piece_digests.append(self._piece.hexdigest())
            self._piece, self._hashing, at = hashlib.sha256(), self._hashing + 1, boundary
        self._piece.update(view[at:])

    def write(self, data: Any) -> None:
        """Append ``data`` (any object with the buffer protocol, copied once into a buffer)."""
        view = memoryview(data).cast("B")
        at, size = 0, len(view)
        while at < size:
            buffer = self._buffers[self._current]
            take = min(size - at, BUFFER_BYTES - self._fill)
            buffer[self._fill : self._fill + take] = view[at : at + take]
            self._fill += take
            at += take
            if self._fill == BUFFER_BYTES:
                self._hand_over(BUFFER_BYTES)

    def _hand_over(self, length: int) -> None:
        """Hash the current buffer's fill and write ``length`` bytes of it (its fill, padded) at its offset,
        each in its thread; go on in the next buffer."""
        index, offset = self._current, self._flushed
        view = memoryview(self._buffers[index])
        self._pending[index] = (
            # in order: one thread hashes, buffer after buffer
            self._hasher.submit(self._hash, view[: self._fill], offset),
            self._writer.submit(self._pwrite, view[:length], offset, offset + self._fill),
        )
        self._flushed += self._fill
        self._fill = 0
        self._current = (index + 1) % BUFFERS
        self._wait(self._current)  # the next buffer is filled again only once it is hashed and written

    def _wait(self, index: int) -> None:
        pending = self._pending[index]
        if pending is not None:
            for future in pending:
                future.result()
            self._pending[index] = None

    def _pwrite(self, view: memoryview, offset: int, end: int) -> None:
        """Write ``view`` at ``offset``; the file's own bytes then end at ``end`` (the rest of a last block is
        padding, cut at :meth:`close`)."""
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)
        if self.follower is not None:
            self.follower.grown(end)

    def close(self, sync: bool) -> None:
        """Write what is left, cut the file to its length, sync it if ``sync``;
        its digest (taken as the buffers were written) is then in ``digest``."""
        try:
            length = self.tell()
            tail = self._fill
            if tail:
                padded = -(-tail // BLOCK) * BLOCK if self.direct else tail
                self._buffers[self._current][tail:padded] = bytes(padded - tail)
                self._hand_over(padded)
            for index in range(BUFFERS):
                self._wait(index)
            os.ftruncate(self.fd, length)
            if sync:
                os.fsync(self.fd)
        finally:
            self.release()
        if len(self._cuts) > 1 and self._cuts[-1] == length:  # a cut at the very end starts no piece
            self._cuts.pop()
        self._piece_digests.append(self._piece.hexdigest())  # the last piece, which no cut finished
        pieces = [b - a for a, b in zip(self._cuts, [*self._cuts[1:], length])]
        self.digest = PieceDigest(digest_of_pieces(self._piece_digests), tuple(pieces))

    def release(self) -> None:
        """Let go of the file and the buffers,
        the writes in flight waited for (after :meth:`close`, or after a failure: the caller drops the file)."""
        if self.fd < 0:
            return
        self._hasher.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._pending = [None] * BUFFERS
        os.close(self.fd)
        self.fd = -1
        for buffer in self._buffers:
            buffer.close()


class Filler(Protocol):
    """Makes a storage's bytes as its record is written, rather than before (see :func:`filled_as_written`)."""

    def fills(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is one of this filler's: written from :meth:`windows`, not from its memory as it is."""
        ...

    def windows(self, storage: torch.UntypedStorage) -> Iterator[memoryview]:
        """The storage's bytes, front to back, a window at a time;
        a window is written (and hashed) before the next is asked for."""
        ...

    def part(self, flat: torch.Tensor, start: int, stop: int) -> torch.Tensor | None:
        """Elements ``[start, stop)`` of ``flat`` (one of this filler's storages, whole) as a storage of its own that
        this filler fills, written as a record of its own; ``flat`` itself is then never written. ``None``: ``flat``
        is none of this filler's."""
        ...


def placeholder(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A flat tensor in anonymous memory that is mapped but untouched (zeros, no pages held), and the mapping: a
    storage of the right size for a :class:`Filler` to fill as its record is written."""
    if numel == 0:
        return torch.empty(0, dtype=dtype), None
    # private: let-go pages are freed, not kept as shared memory
    region = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MB pages where the kernel allows: filling 4 KB pages first-touched one by one took 3x as long
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype), region  # the tensor keeps the mapping alive


_FILLER: ContextVar[Filler | None] = ContextVar("osdpipe_torchfile_filler", default=None)


@contextmanager
def filled_as_written(filler: Filler) -> Iterator[None]:
    """Every archive written inside takes the bytes of ``filler``'s storages from ``filler``,
    window by window, as it writes their records.

    So a storage that would be too large to hold filled (a rank's output
    under ``runtime.memory_budget``, see :mod:`osdpipe.run.streamed_output`) is made and
    written a window at a time, whoever calls ``torchfile`` (a rank file, a
    DCP item): the records, offsets and bytes are those of the filled storage.
    """
    token = _FILLER.set(filler)
    try:
        yield
    finally:
        _FILLER.reset(token)


def windows_of(tensor: torch.Tensor) -> Iterator[memoryview] | None:
    """The bytes of ``tensor``, a window at a time, where it is a whole storage of the filler in effect
    (:func:`filled_as_written`): a writer of another format (safetensors) writes it as a ``torch.save`` record is
    written; ``None``: it holds its bytes itself."""
    filler = _FILLER.get()
    storage = tensor.untyped_storage()
    if filler is None or not filler.fills(storage):
        return None
    if tensor.storage_offset() != 0 or not tensor.is_contiguous() or tensor.nbytes != storage.nbytes():
        raise ValueError(f"a part of a tensor made as it is written ({tuple(tensor.shape)}), written alone: write the "
                         "whole tensor, or take the part with part_of")
    return filler.windows(storage)


def part_of(flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flat tensor ``flat``, to be written as a record of its own (the rows of a
    parameter a state-dict hook saves under another key: torchtitan's ``wqkv`` as ``wq``, ``wk``, ``wv``): where
    ``flat`` is a storage of the filler in effect (:func:`filled_as_written`), a storage that filler fills as it is
    written, so the parts of a parameter are made as they are written, as the parameter would be; else a copy."""
    filler = _FILLER.get()
    part = None if filler is None else filler.part(flat, start, stop)
    return part if part is not None else flat[start:stop].clone()


class Archive:
    """The zip writer ``torch.serialization._save`` writes records into,
    writing them to a :class:`DirectFile` as they come.

    Each storage record's data is a piece of the file's (:meth:`DirectFile.cut`),
    so its sha256 is taken by the file's one pass over its bytes.
    """

    def __init__(self, out: DirectFile) -> None:
        self.out = out
        self.start = out.tell()  # where the archive begins in the file: its offsets and alignment count from here
        self.entries: list[tuple[str, int, int, int]] = []  # name, crc, size, header offset
        # each storage (``UntypedStorage._cdata``) -> its piece of the file (``None``: no bytes), and the storage
        self.storage_pieces: dict[int, tuple[int | None, torch.UntypedStorage]] = {}

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        """One record: its bytes (``str``, ``bytes`` or a CPU storage), ``nbytes`` of them."""
        if isinstance(data, str):
            data = data.encode()
        storage = data if isinstance(data, torch.UntypedStorage) else None
        filler = _FILLER.get()
        if storage is not None and filler is not None and filler.fills(storage):
            self._header(name, 0, nbytes)
            self.storage_pieces[storage._cdata] = (self.out.cut() if nbytes else None, storage)
            self._write_filled(filler.windows(storage), nbytes)
            self.out.cut()
            return
        if storage is not None:
            payload = _storage_bytes(storage, nbytes)
            crc = 0  # never checked by torch.load; the manifest's digests guard the bytes
        else:
            payload = memoryview(bytes(data))[:nbytes]
            crc = zlib.crc32(payload)
        self._header(name, crc, nbytes)
        if storage is None:
            self.out.write(payload)
            return
        self.storage_pieces[storage._cdata] = (self.out.cut() if nbytes else None, storage)
        self.out.write(payload)
        self.out.cut()

    def _write_filled(self, windows: Iterator[memoryview], nbytes: int) -> None:
        """A storage's record from its filler's windows:
        each copied out before the next is made (its memory may then be let go)."""
        written = 0
        for window in windows:
            self.out.write(window)
            written += memoryview(window).nbytes
        if written != nbytes:
            raise ValueError(f"a storage of {nbytes} bytes was filled with {written}")

    # torch's skip_data mode, which osdpipe never uses
    def write_record_metadata(self, name: str, nbytes: int) -> None:  # noqa: ARG002
        raise NotImplementedError("osdpipe's archives hold every record's bytes")

    def _header(self, name: str, crc: int, size: int) -> None:
        """A local file header in front of a record of ``size`` bytes,
        padded so that its data starts at a multiple of :data:`ALIGNMENT`."""
        full = f"{ARCHIVE}/{name}".encode()
        offset = self.out.tell() - self.start
        zip64 = size >= ZIP64_FROM
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        start = offset + _LOCAL.size + len(full) + len(extra) + 4  # the padding field's own 4 bytes
        pad = -start % ALIGNMENT
        extra += struct.pack("<HH", _PAD_ID, pad) + bytes(pad)
        stored = _ZIP64_MARK if zip64 else size
        # as its central entry says it: ZIP64 for its size or its offset
        version = 45 if zip64 or offset >= ZIP64_FROM else 20
        self.out.write(_LOCAL.pack(0x04034B50, version, _UTF8, 0, 0, 0x21, crc, stored, stored, len(full), len(extra)))
        self.out.write(full)
        self.out.write(extra)
        self.entries.append((f"{ARCHIVE}/{name}", crc, size, offset))

    def finish(self) -> None:
        """The records torch's writer adds at the end (the format's version, a serialization id),
        then the central directory."""
        self.write_record("version", "3\n", 2)
        # not the digests' hash: the records' names, sizes and places
        records = hashlib.blake2b(repr(self.entries).encode(), digest_size=16).hexdigest()
        # what torch keeps here: an id of the records
        self.write_record(".data/serialization_id", str(int(records, 16)).zfill(40)[:40], 40)
        start = self.out.tell() - self.start
        for name, crc, size, offset in self.entries:
            full = name.encode()
            values = ([size, size] if size >= ZIP64_FROM else []) + ([offset] if offset >= ZIP64_FROM else [])
            extra = struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) if values else b""
            version = 45 if values else 20
            stored = _ZIP64_MARK if size >= ZIP64_FROM else size
            at = _ZIP64_MARK if offset >= ZIP64_FROM else offset
            self.out.write(
                _CENTRAL.pack(
                    0x02014B50, version, version, _UTF8, 0, 0, 0x21, crc, stored, stored,
                    len(full), len(extra), 0, 0, 0, 0, at,
                )
            )
            self.out.write(full)
            self.out.write(extra)
        end = self.out.tell() - self.start
        count, length = len(self.entries), end - start
        zip64 = count >= 0xFFFF or length >= ZIP64_FROM or start >= ZIP64_FROM
        if zip64:
            self.out.write(_END64.pack(0x06064B50, _END64.size - 12, 45, 45, 0, 0, count, count, length, start))
            self.out.write(_LOCATOR64.pack(0x07064B50, 0, end, 1))
        entries = 0xFFFF if zip64 and count >= 0xFFFF else count
        self.out.write(
            _END.pack(
                0x06054B50, 0, 0, entries, entries, _ZIP64_MARK if zip64 else length, _ZIP64_MARK if zip64 else start, 0
            )
        )


def _storage_bytes(storage: torch.UntypedStorage, nbytes: int) -> memoryview:
    """A CPU storage's bytes, without a copy."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,)).numpy()).cast("B")


def write_archive(obj: Any, out: DirectFile) -> dict[int, tuple[int | None, torch.UntypedStorage]]:
    """Write ``obj`` as ``torch.save`` would, as one archive from ``out``'s current position on:
    what a ``torch.save`` file holds.

    Its offsets and alignment count from where it begins, so the bytes from
    there to the end load with ``torch.load`` wherever they sit (DCP keeps a
    rank's items one after another in one file). Returns each storage's
    piece of the file (by ``UntypedStorage._cdata``; ``None`` for one of no
    bytes) with the storage, whose digests :func:`storage_digests` gives once
    ``out`` is closed.
    A storage whose bytes are made as it is written comes from the active
    filler (:func:`filled_as_written`).
    """
    if sys.byteorder != "little":
        raise NotImplementedError("osdpipe writes torch files on little-endian machines")
    archive = Archive(out)
    # torch.save's own pickling of the records
    torch.serialization._save(obj, archive, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    archive.finish()
    return archive.storage_pieces


#: The sha256 of no bytes: a storage of none is no piece of the file.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class StorageDigests(dict[int, str]):
    """Each written storage's sha256, by ``UntypedStorage._cdata`` (the address of the storage's C object), holding
    the storages themselves.

    An address names a storage only while that storage lives: once freed, the next storage made may get it, and a
    lookup by address would give that one a digest of bytes it does not hold. What is written is often made for the
    write and freed right after it (a copy of a view, :func:`osdpipe.io.formats.dcp_writer.write_rank`), and its
    digests are looked up later, by tensors made later (:func:`osdpipe.io.digest.tensor_sha256`). Holding the
    storages for as long as the digests are held keeps every address in here naming its own storage.
    """

    def __init__(self, digests: dict[int, str], storages: list[torch.UntypedStorage]) -> None:
        super().__init__(digests)
        self._storages = storages


def storage_digests(out: DirectFile, pieces: dict[int, tuple[int | None, torch.UntypedStorage]]) -> StorageDigests:
    """Each storage's sha256 (by ``UntypedStorage._cdata``), its piece's digest:
    from the one pass over the closed file ``out``'s bytes."""
    return StorageDigests(
        {cdata: EMPTY_SHA256 if index is None else out.piece_digest(index) for cdata, (index, _) in pieces.items()},
        [storage for _, storage in pieces.values()],
    )


def save(obj: Any, path: Path, *, sync: bool = True, direct: bool = True) -> tuple[PieceDigest, StorageDigests]:
    """``torch.save(obj, path)`` as :mod:`osdpipe.io.torchfile` writes it:
    the file's digest, and each storage's sha256 (by ``UntypedStorage._cdata``).

    ``path`` must not exist. On failure nothing is left claiming to be
    whole: the partial file is removed.
    """
    with written(path, sync=sync, direct=direct) as out:
        pieces = write_archive(obj, out)
    return out.digest, storage_digests(out, pieces)


@contextmanager
def written(path: Path, *, sync: bool, direct: bool = True) -> Iterator[DirectFile]:
    """A new file at ``path`` to write through a :class:`DirectFile`;
    closed (and synced if ``sync``) on leaving, its digest then in ``digest``.

    On failure, while writing or while finishing the file, it is removed:
    nothing is left claiming to be whole.
    """
    follow = _FOLLOW.get()
    out = DirectFile(path, direct, follow(path) if follow is not None else None)
    try:
        yield out
        out.close(sync)
    except BaseException:
        out.release()
        path.unlink(missing_ok=True)
        if out.follower is not None:
            out.follower.dropped()
        raise
    if out.follower is not None:
        out.follower.ended(out.tell())
