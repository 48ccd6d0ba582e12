"""Memory that stands for bytes elsewhere (a file in object storage), unreadable until they are fetched into it.

:func:`reserve` gives a storage of ``nbytes`` whose memory is mapped but **unreadable** (``PROT_NONE``). Before a
reader uses elements of a tensor on it, it calls :func:`fetch` (or :func:`fetch_many`, :func:`fetch_all`): the pages
under them that are not there yet are fetched, as few runs of pages as possible, through the storage's
:class:`Fetcher`, written, and made readable; :func:`let_go` gives pages back (unreadable again, fetched again if
asked for). Memory never fetched cannot be read as zeros by mistake: touching it kills the process with SIGSEGV,
which :mod:`osdpipe.run.native_crash` names with the code that touched it.

Every call here is a no-op for a tensor on ordinary memory, so the readers of local files call them as well.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from osdpipe.core.memory import libc

PAGE = mmap.PAGESIZE
_PROT_NONE = 0  # <sys/mman.h>; Python's mmap names PROT_READ and PROT_WRITE only



class Fetcher(Protocol):
    """Where a reserved storage's bytes come from. It may also take a plan, ``plan(spans)``: the spans
    :meth:`fetch` will be asked for next, to fetch ahead (empty: none)."""

    def fetch(self, spans: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """The bytes ``[offset, offset + length)`` of each ``(offset, length)``, in order (a view into a larger
        fetch, or bytes)."""
        ...


@dataclass
class _Reserved:
    """One reserved storage: where its bytes come from, from which offset, and its memory."""

    fetcher: Fetcher
    offset: int  # of its first byte in what the fetcher reads
    nbytes: int
    address: int
    fetched: set[int] = field(default_factory=set)  # page indices readable and holding their bytes


_lock = threading.Lock()
#: Each reserved storage by the address of its memory (``untyped_storage().data_ptr()``).
_RESERVED: dict[int, _Reserved] = {}
#: The fetchers holding a plan (:func:`plan`), by ``id``.
_PLANNED: dict[int, Fetcher] = {}


def _protect(address: int, length: int, readable: bool) -> None:
    prot = mmap.PROT_READ | mmap.PROT_WRITE if readable else _PROT_NONE
    if libc().mprotect(address, length, prot) != 0:
        raise OSError(ctypes.get_errno(), f"mprotect of {length} bytes failed")


def reserve(nbytes: int, offset: int, fetcher: Fetcher) -> torch.UntypedStorage:
    """``nbytes`` of unreadable memory standing for the bytes ``fetcher`` reads from ``offset`` on."""
    if nbytes == 0:
        return torch.UntypedStorage(0)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    storage = flat.untyped_storage()
    address = storage.data_ptr()
    _protect(address, -(-nbytes // PAGE) * PAGE, readable=False)
    with _lock:
        _RESERVED[address] = _Reserved(fetcher, offset, nbytes, address)
    # The mapping lives as long as a tensor of it; its entry goes with it, before the address can be mapped again.
    weakref.finalize(region, _forget, address)
    return storage


def _forget(address: int) -> None:
    with _lock:
        _RESERVED.pop(address, None)


def _span(tensor: torch.Tensor, start: int, stop: int) -> tuple[_Reserved, int, int] | None:
    """The reserved storage under elements ``[start, stop)`` of ``tensor``'s flattened view, and their bytes in it
    (``None``: not a reserved storage's tensor)."""
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    with _lock:
        reserved = _RESERVED.get(storage.data_ptr())
    if reserved is None:
        return None
    size = tensor.element_size()
    if tensor.is_contiguous():
        return reserved, (tensor.storage_offset() + start) * size, (tensor.storage_offset() + stop) * size
    return reserved, 0, reserved.nbytes  # a strided view: all of its storage


def fetch(tensor: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
    """Make elements ``[start, stop)`` of ``tensor``'s flattened view readable, fetching the pages under them that
    are not (nothing for a tensor on ordinary memory)."""
    fetch_many([(tensor, start, tensor.numel() if stop is None else stop)])


def fetch_many(ranges: list[tuple[torch.Tensor, int, int]]) -> None:
    """:func:`fetch` of each ``(tensor, start, stop)``: the missing pages of all of them, as runs of pages, each
    fetcher asked once for all of its runs."""
    for fetcher, members in _missing_runs(ranges).items():
        spans = [span for _, _, span in members]
        for (reserved, (first, end), (offset, length)), data in zip(members, fetcher.fetch(spans), strict=True):
            if len(data) != length:
                raise OSError(f"{length} bytes asked at {offset}, {len(data)} received")
            with _lock:
                lo = first * PAGE
                _protect(reserved.address + lo, (end - first) * PAGE, readable=True)
                memoryview((ctypes.c_char * length).from_address(reserved.address + lo)).cast("B")[:] = data
                reserved.fetched.update(range(first, end))


def plan(ranges: list[tuple[torch.Tensor, int, int]]) -> None:
    """The ranges a reader will ask for next, told ahead: each fetcher that can (:meth:`Fetcher.plan`) starts
    fetching their missing pages, to hand them over when :func:`fetch` asks. Empty: every plan is dropped."""
    wanted = _missing_runs(ranges)
    with _lock:
        planned = list(_PLANNED.values())
        _PLANNED.clear()
    for fetcher in planned:
        fetcher.plan([])
    for fetcher, members in wanted.items():
        if hasattr(fetcher, "plan"):
            fetcher.plan([span for _, _, span in members])
            with _lock:
                _PLANNED[id(fetcher)] = fetcher


def _missing_runs(
    ranges: list[tuple[torch.Tensor, int, int]],
) -> dict[Fetcher, list[tuple[_Reserved, tuple[int, int], tuple[int, int]]]]:
    """Per fetcher, the runs of pages each range needs that are not fetched: ``(storage, (first page, end page),
    (offset, length) to fetch)``, each run once.

    Runs are a range's own, never joined with another range's: a range told ahead (:func:`plan`) asks for the same
    runs when it is read, which is how a plan's fetcher knows them (it joins neighbouring runs into one request
    itself). Two ranges that share a page may both fetch it.
    """
    runs: dict[tuple[int, int, int], _Reserved] = {}  # (address, first page, end page) -> its storage
    for tensor, start, stop in ranges:
        found = _span(tensor, start, stop) if stop > start else None
        if found is None:
            continue
        reserved, first, end = found
        with _lock:
            missing = [p for p in range(first // PAGE, -(-end // PAGE)) if p not in reserved.fetched]
        for run in _runs(missing):
            runs[(reserved.address, *run)] = reserved
    by_fetcher: dict[Fetcher, list[tuple[_Reserved, tuple[int, int], tuple[int, int]]]] = {}
    for (_, first, end), reserved in runs.items():
        span = (reserved.offset + first * PAGE, min(end * PAGE, reserved.nbytes) - first * PAGE)
        by_fetcher.setdefault(reserved.fetcher, []).append((reserved, (first, end), span))
    return by_fetcher


def fetch_all(obj: Any) -> Any:
    """Every reserved tensor in ``obj`` (nested dicts, lists, tuples, DTensors) made readable whole; ``obj``."""
    fetch_many([(t, 0, t.numel()) for t in _tensors(obj)])
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj.to_local() if hasattr(obj, "to_local") else obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for value in values for t in _tensors(value)]


def let_go(tensor: torch.Tensor, start: int, stop: int) -> bool:
    """Done with elements ``[start, stop)``: the whole pages under them are given back and unreadable again
    (fetched again if asked for). Whether ``tensor`` is on reserved memory (else nothing happened)."""
    found = _span(tensor, start, stop)
    if found is None:
        return False
    reserved, first, end = found
    lo, hi = -(-first // PAGE), end // PAGE
    if end == reserved.nbytes:
        hi = -(-end // PAGE)  # the storage's last page holds nothing beyond it
    if hi <= lo:
        return True
    with _lock:
        reserved.fetched.difference_update(range(lo, hi))
        libc().madvise(reserved.address + lo * PAGE, (hi - lo) * PAGE, mmap.MADV_DONTNEED)
        _protect(reserved.address + lo * PAGE, (hi - lo) * PAGE, readable=False)
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
