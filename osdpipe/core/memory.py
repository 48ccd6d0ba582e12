"""How much memory a process held at its peak: resident (RSS) and anonymous (not backed by a file).

Memory-mapped input counts in RSS, but the kernel can drop those pages at any
time; anonymous memory (tensors osdpipe made, buffers) is what a conversion
really holds. Linux reports the peak RSS (``VmHWM``) but only the current
anonymous size (``RssAnon``), so a thread samples that while the stages run.
Where ``/proc`` does not exist, the anonymous figures are ``None`` and the peak
RSS comes from ``getrusage``.

A sample reads ``/proc/self/statm`` (resident pages less file-backed and shared
ones: ``RssAnon``), not ``/proc/self/status``: the kernel makes ``status`` whole
for every read (signal masks, CPU lists, every thread's state), and taken 200
times a second beside a conversion's threads it held the GIL for 0.55 s of a
23 s run; ``statm`` is two counters, a twelfth of the time.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_STATM = "/proc/self/statm"
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: How often the anonymous size is sampled: short next to a tensor copy of a few hundred MB.
SAMPLE_S = 0.005


@dataclass(frozen=True)
class MemoryPeak:
    """One process's memory while it converted, in bytes.

    ``baseline_anonymous`` is what it held when the watch began (imports,
    the model's tree): the conversion's own share is the peak minus it.
    """

    process: str
    peak_rss: int
    peak_anonymous: int | None
    baseline_anonymous: int | None


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _anonymous_bytes() -> int | None:
    """This process's anonymous resident memory now (``RssAnon``), from ``/proc/self/statm``'s resident and
    shared page counts; ``None`` without ``/proc``."""
    try:
        fd = os.open(_STATM, os.O_RDONLY)
    except OSError:
        return None
    try:
        _, resident, shared = os.pread(fd, 256, 0).split()[:3]
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return (int(resident) - int(shared)) * _PAGE_BYTES


def _peak_rss() -> int:
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


class MemoryWatch:
    """Samples this process's anonymous memory from :meth:`start` until :meth:`stop`, which returns the peaks."""

    def __init__(self, process: str) -> None:
        self.process = process
        self.baseline = _anonymous_bytes()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="osdpipe-memory", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            now = _anonymous_bytes()
            if now is not None and (self.peak is None or now > self.peak):
                self.peak = now

    def start(self) -> MemoryWatch:
        if self.baseline is not None:
            self._thread.start()
        return self

    def stop(self) -> MemoryPeak:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        now = _anonymous_bytes()  # a peak at the very end is not missed
        peak = None if self.peak is None else max(self.peak, now or 0)
        return MemoryPeak(self.process, _peak_rss(), peak, self.baseline)


_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """The C library, its ``madvise`` and ``mprotect`` typed (address, length, flags): loaded once."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        for call in (_libc.madvise, _libc.mprotect):
            call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


#: glibc's ``mallopt`` parameter of the size from which an allocation is a mapping of its own (``M_MMAP_THRESHOLD``).
_M_MMAP_THRESHOLD = -3
#: Allocations of this size and more are mappings of their own, given back when freed.
LARGE_ALLOCATION = 1 << 20


def give_back_large_allocations() -> None:
    """Make every allocation of :data:`LARGE_ALLOCATION` bytes or more a mapping of its own, unmapped when freed.

    glibc otherwise raises that threshold past the largest block freed so far, and serves the next ones from its heap,
    which it keeps: a conversion that reads a batch as a copy of its own (a column block's rows), frees it and reads
    the next held one more batch's worth at every read (11.5 MB a read, measured, torch 2.13, glibc 2.36), over the
    budget by the sum. Linux with glibc only; elsewhere nothing happens.
    """
    if sys.platform != "linux":
        return
    try:
        libc().mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION)
    except AttributeError:  # not glibc
        return


def drop_mapped_pages(view: Any) -> None:
    """Let go of the whole pages under ``view``, a tensor read from a memory-mapped file that nothing wrote to.

    Pages of a file mapped with ``mmap`` stay in the process's RSS once
    touched, so converting a large file would end with all of it resident.
    ``MADV_DONTNEED`` drops them from this process (the page cache keeps
    them, and a later touch maps them again). Only for file-backed pages that
    were never written: anonymous memory would read back as zeros. Partial
    pages at the ends stay; where the call is not available, nothing happens.
    """
    if sys.platform != "linux" or view.numel() == 0:
        return
    start = view.data_ptr()
    end = start + view.numel() * view.element_size()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last > first:
        libc().madvise(first, last - first, mmap.MADV_DONTNEED)
