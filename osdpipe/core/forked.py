"""Run one function over several indices in forked processes that see this process's memory as it was.

For work whose input is already in memory and large (a Megatron save read whole, split over ``runtime.workers``
writers): a forked child shares the parent's pages until it writes to them, so nothing is sent or read again. Only
the results travel back, pickled. A child that dies (killed, out of memory) fails the call with one line rather than
hanging it (``concurrent.futures`` notices a dead worker; ``multiprocessing.Pool`` would wait for its lost task).

A child runs torch on one thread: the parent's OpenMP threads are not forked with it, and the first parallel op of a
child whose parent had used them waits for them forever (a Megatron writer making a bucket's state hung so).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import torch

T = TypeVar("T")

#: The function the children run: set before they fork, so they inherit it (a closure need not be picklable).
_work: Callable[[int], Any] | None = None


def each_forked(count: int, work: Callable[[int], T]) -> list[T]:
    """``[work(0), ..., work(count - 1)]``, each in a forked process of its own (``count == 1``: in this one).

    Raises:
        RuntimeError: a worker died without an answer; what ``work`` raised is raised as it was.
    """
    global _work
    if count == 1:
        return [work(0)]
    _work = work
    try:
        with ProcessPoolExecutor(count, mp_context=mp.get_context("fork")) as pool:
            return list(pool.map(_call, range(count)))
    except BrokenProcessPool:
        raise RuntimeError(f"a worker of {count} died without an answer (killed, or out of memory)") from None
    finally:
        _work = None


def _call(index: int) -> Any:
    assert _work is not None, "set before the workers fork"
    torch.set_num_threads(1)
    return _work(index)
