"""Collective helpers that keep every rank in step, and agree on failure.

A stage runs on every rank. If it fails on some, every rank must raise the same
error naming the stage and the failed ranks, instead of some ranks waiting
forever in a collective the failed ones never reach.

These helpers span the *target's ranks*: the process group where each
process plays one target rank, and no one else where a process plays several
in turn (offline, or a share of them: :class:`osdpipe.run.world.ShareWorld`,
whose processes meet only between the ranks they play, through
:func:`gather_processes`). :func:`ranks_apart` says so for a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class StageError(RuntimeError):
    """A stage failed on one or more ranks: one line naming the stage, the ranks and the first rank's error.

    ``by``: the process that played the rank, where that is not the rank's
    own (``"worker 1 of 2 on node-a"``, see :class:`osdpipe.run.world.ShareWorld`).
    """

    def __init__(self, stage: str, failures: dict[int, str], by: str | None = None) -> None:
        ranks = sorted(failures)
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        where += f" (played by {by})" if by else ""
        super().__init__(f"stage {stage!r} failed on {where}: {failures[ranks[0]]}")
        self.stage, self.failures = stage, failures


def one_line(exc: BaseException) -> str:
    """An exception as one line for a person.

    Errors osdpipe raises for bad input or a failed operation (``ValueError``,
    ``OSError`` and their kinds) already say what happened and what to do, so
    their type name is noise; any other type is named, since it says more
    than its message (``KeyError: 'step'``).
    """
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, (ValueError, OSError, StageError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: Words in the error a collective raises when another rank of the group has died or left.
_LOST_PEER_MARKERS = (
    "Connection closed by peer", "Read error", "Connection reset", "pair.cc", "NCCL communicator was aborted"
)


def lost_a_peer(message: str) -> bool:
    """Whether ``message`` is a collective's error for a peer that died or left: the echo of another rank's failure."""
    return any(m in message for m in _LOST_PEER_MARKERS)


#: Whether the process group's members are the target's ranks, one each (see :func:`ranks_apart`).
_RANKS_MEET: ContextVar[bool] = ContextVar("osdpipe_ranks_meet", default=True)
#: Who plays the ranks apart, as a stage's error names it (see :func:`ranks_apart`).
_PLAYER: ContextVar[str | None] = ContextVar("osdpipe_player", default=None)


@contextmanager
def ranks_apart(player: str | None = None) -> Iterator[None]:
    """Inside, the helpers act as without a process group: each process plays its target ranks in turn, apart.

    A process group may still be there (the workers of a
    :class:`~osdpipe.run.world.ShareWorld`), but its members play different
    numbers of target ranks, so they would not meet in a per-rank collective;
    they meet in :func:`gather_processes` alone. ``player``: who plays them,
    named in a failed stage's error (``"worker 1 of 2 on node-a"``).
    """
    tokens = _RANKS_MEET.set(False), _PLAYER.set(player)
    try:
        yield
    finally:
        _RANKS_MEET.reset(tokens[0])
        _PLAYER.reset(tokens[1])


def _grouped() -> bool:
    """Whether a process group is there at all."""
    return dist.is_available() and dist.is_initialized()


def _initialized() -> bool:
    """Whether the target's ranks meet in a process group (one process each)."""
    return _grouped() and _RANKS_MEET.get()


def gather_processes(value: T) -> list[T]:
    """Every process's ``value``, on every process of the group
    (a collective of processes, whatever ranks each plays)."""
    if not _grouped():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def agree(stage: str, error: str | None, rank: int = 0) -> None:
    """Share each rank's error (or ``None``) and raise :class:`StageError` on every rank if any failed.

    Without a process group the error is ``rank``'s: the rank this process
    plays (see :class:`osdpipe.run.world.SoloWorld`), named with the worker that
    plays it where :func:`ranks_apart` says who.
    """
    errors = {rank: error}
    if _initialized():
        gathered: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, error)
        errors = dict(enumerate(gathered))
    failures = {r: e for r, e in errors.items() if e is not None}
    if failures:
        raise StageError(stage, failures, None if _initialized() else _PLAYER.get())


def from_rank0(stage: str, compute: Callable[[], T], src: int = 0) -> T:
    """Compute on rank ``src`` (default 0) and broadcast the result; an error there is raised on every rank."""
    if not _initialized():
        return compute()
    box: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            box[0] = (True, compute())
        except Exception as exc:  # noqa: BLE001 - it is re-raised on every rank below
            box[0] = (False, one_line(exc))
    dist.broadcast_object_list(box, src=src)
    ok, value = box[0]
    if not ok:
        raise StageError(stage, {src: value})
    return value


def gather_to_all(value: T) -> list[T]:
    """Every rank's ``value``, on every rank (where the ranks meet; else this process's alone)."""
    return gather_processes(value) if _initialized() else [value]


def scatter_from(src: int, per_rank: list[Any] | None) -> Any:
    """Rank ``src`` gives each rank its own item of ``per_rank``
    (one per rank; ``None`` elsewhere); each rank gets only its own."""
    if not _initialized():
        assert per_rank is not None
        return per_rank[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, per_rank if dist.get_rank() == src else None, src=src)
    return box[0]


def barrier() -> None:
    if _initialized():
        dist.barrier()
