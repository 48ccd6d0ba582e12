"""A ``torch.save`` file in object storage, loaded without its tensor bytes; each tensor's bytes fetched by range
when a reader asks for them.

``torch.load`` of a local file maps it (``mmap=True``): a rank touches only the pages of the ranges it reads. A file
in a bucket cannot be mapped, and ``torch.load`` of a file object reads every storage. :func:`load` instead reads
the archive's structure (checked as a local file's is, :func:`~osdpipe.io.formats.safe_load.check_torch_zip`) and
its pickle, and gives each storage memory of its own that is reserved but **unreadable** (``PROT_NONE``). A reader
fetches the bytes it is about to use (:func:`fetch`, called by :func:`~osdpipe.io.formats.base.mapped_range` and the
readers' whole-tensor reads): the pages under them are fetched in one ranged request, written, and made readable;
:func:`let_go` gives them back once used. Memory that was never fetched cannot be read as zeros by mistake: touching
it kills the process with SIGSEGV, named with the code that touched it (:mod:`osdpipe.run.native_crash`).

Small storages (step counters, scalars: at most :data:`EAGER_BYTES`) are fetched with the structure, so looking at
a file's metadata needs nothing more.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import threading
import warnings
import weakref
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from osdpipe.io.remote_input import Prefetch, RemotePath

#: A storage this small (a step counter, a scalar) is fetched with the file's structure.
EAGER_BYTES = 16
#: The block size the archive's structure is read in: its index, each record's header (one block each), the pickle.
STRUCTURE_BLOCK = 64 << 10
_PAGE = mmap.PAGESIZE
_PROT_NONE = 0  # <sys/mman.h>; Python's mmap names PROT_READ and PROT_WRITE only

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclass
class _Remote:
    """One storage of a remote file: where its bytes lie in the object, and the address of its memory."""

    path: RemotePath
    offset: int  # of its first byte in the object
    nbytes: int
    address: int
    fetched: set[int] = field(default_factory=set)  # page indices readable and holding the object's bytes


_lock = threading.Lock()
#: Each remote storage by the address of its memory (``untyped_storage().data_ptr()``).
_REMOTE: dict[int, _Remote] = {}


def _protect(address: int, length: int, readable: bool) -> None:
    prot = mmap.PROT_READ | mmap.PROT_WRITE if readable else _PROT_NONE
    if _libc.mprotect(address, length, prot) != 0:
        raise OSError(ctypes.get_errno(), f"mprotect of {length} bytes failed")


def _storage(path: RemotePath, offset: int, nbytes: int) -> torch.UntypedStorage:
    """``nbytes`` of unreadable memory standing for the bytes at ``offset`` of ``path``."""
    if nbytes == 0:
        return torch.UntypedStorage(0)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    storage = flat.untyped_storage()
    address = storage.data_ptr()
    _protect(address, -(-nbytes // _PAGE) * _PAGE, readable=False)
    with _lock:
        _REMOTE[address] = _Remote(path, offset, nbytes, address)
    # The mapping lives as long as a tensor of it; its entry goes with it, before the address can be mapped again.
    weakref.finalize(region, _forget, address)
    return storage


def _forget(address: int) -> None:
    with _lock:
        _REMOTE.pop(address, None)


def _span(tensor: torch.Tensor, start: int, stop: int) -> tuple[_Remote, int, int] | None:
    """The remote storage under elements ``[start, stop)`` of ``tensor``'s flattened view, and their bytes in it
    (``None``: not a remote storage's tensor)."""
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    with _lock:
        remote = _REMOTE.get(storage.data_ptr())
    if remote is None:
        return None
    size = tensor.element_size()
    if tensor.is_contiguous():
        first = (tensor.storage_offset() + start) * size
        return remote, first, (tensor.storage_offset() + stop) * size
    return remote, 0, remote.nbytes  # a strided view: all of its storage


def fetch(tensor: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
    """Make elements ``[start, stop)`` of ``tensor``'s flattened view readable, fetching the pages under them that
    are not (nothing for a tensor that is not a remote file's)."""
    fetch_many([(tensor, start, tensor.numel() if stop is None else stop)])


def fetch_many(ranges: list[tuple[torch.Tensor, int, int]]) -> None:
    """:func:`fetch` of each ``(tensor, start, stop)``: the missing pages of all of them fetched at once, several
    requests in flight, neighbouring pages of one object in one request (:class:`~osdpipe.io.remote_input.Prefetch`)."""
    wanted: dict[tuple[int, int, int], _Remote] = {}  # (address, first page, end page) -> its storage
    for tensor, start, stop in ranges:
        found = _span(tensor, start, stop) if stop > start else None
        if found is None:
            continue
        remote, first, end = found
        with _lock:
            missing = [p for p in range(first // _PAGE, -(-end // _PAGE)) if p not in remote.fetched]
        for run in _runs(missing):
            wanted[(remote.address, *run)] = remote
    if not wanted:
        return
    spans = {
        key: (remote.path, remote.offset + key[1] * _PAGE, min(key[2] * _PAGE, remote.nbytes) - key[1] * _PAGE)
        for key, remote in wanted.items()
    }
    prefetch = Prefetch(list(spans.values()))
    try:
        for key, remote in wanted.items():
            path, offset, length = spans[key]
            data = prefetch.take(path, offset, length)
            if len(data) != length:
                raise OSError(f"{path}: {length} bytes asked at {offset}, {len(data)} received")
            with _lock:
                if key[1] in remote.fetched:  # two ranges of one page: filled once
                    continue
                lo = key[1] * _PAGE
                _protect(remote.address + lo, (key[2] - key[1]) * _PAGE, readable=True)
                ctypes.memmove(remote.address + lo, data, length)
                remote.fetched.update(range(*key[1:]))
    finally:
        prefetch.close()


def fetch_all(obj: Any) -> Any:
    """Every remote tensor in ``obj`` (nested dicts, lists, tuples, DTensors) made readable whole; ``obj``."""
    fetch_many([(t, 0, t.numel()) for t in _tensors(obj)])
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj.to_local() if hasattr(obj, "to_local") else obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for value in values for t in _tensors(value)]


def let_go(tensor: torch.Tensor, start: int, stop: int) -> bool:
    """Done with elements ``[start, stop)``: the whole pages under them are given back and unreadable again
    (fetched again if asked for). Whether ``tensor`` is a remote file's (else nothing happened)."""
    found = _span(tensor, start, stop)
    if found is None:
        return False
    remote, first, end = found
    lo, hi = -(-first // _PAGE), end // _PAGE
    if end == remote.nbytes:
        hi = -(-end // _PAGE)  # the storage's last page holds nothing beyond it
    if hi <= lo:
        return True
    with _lock:
        remote.fetched.difference_update(range(lo, hi))
        _libc.madvise(remote.address + lo * _PAGE, (hi - lo) * _PAGE, mmap.MADV_DONTNEED)
        _protect(remote.address + lo * _PAGE, (hi - lo) * _PAGE, readable=False)
    return True


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page indices as ``[start, end)`` runs of consecutive pages."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def load(path: RemotePath, check: Any) -> Any:
    """``torch.load(path, weights_only=True)`` of a remote ``torch.save`` file, its storages unfetched
    (small ones fetched).

    ``check(file, size)`` checks the archive's structure and returns each record's data span by name
    (:func:`~osdpipe.io.formats.safe_load.check_torch_zip`).
    """
    from torch import _weights_only_unpickler

    size = path.stat().st_size
    with path.open_blocks(STRUCTURE_BLOCK) as f:
        spans = check(f, size)
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            prefix = next(n for n in archive.namelist() if n.endswith("/data.pkl")).rsplit("/", 1)[0]
            pickled = archive.read(f"{prefix}/data.pkl")
            order = f"{prefix}/byteorder"
            byteorder = archive.read(order).decode() if order in archive.namelist() else "little"
    if byteorder != "little":
        raise ValueError(f"{path} was saved on a big-endian machine; load and re-save it there")
    storages: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(saved_id: tuple) -> torch.storage.TypedStorage:
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key not in storages:
            start, end = spans[f"{prefix}/data/{key}"]
            nbytes = numel * torch._utils._element_size(dtype)
            if end - start < nbytes:
                raise ValueError(f"{path}: record data/{key} holds {end - start} bytes, its tensor {nbytes}")
            untyped = _storage(path, start, nbytes)
            storages[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
        return storages[key]

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load
    loaded = unpickler.load()
    small = [s._untyped_storage for s in storages.values() if 0 < s._untyped_storage.nbytes() <= EAGER_BYTES]
    # the small ones now, as one look at the file needs them
    fetch_all([torch.empty(0, dtype=torch.uint8).set_(u) for u in small])
    return loaded
