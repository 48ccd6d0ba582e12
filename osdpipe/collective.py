"""Collective helpers that keep every rank in step, and agree on failure.

A stage runs on every rank. If it fails on some, every rank must raise the same
error naming the stage and the failed ranks, instead of some ranks waiting
forever in a collective the failed ones never reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class StageError(RuntimeError):
    """A stage failed on one or more ranks: one line naming the stage, the ranks and the first rank's error."""

    def __init__(self, stage: str, failures: dict[int, str]) -> None:
        ranks = sorted(failures)
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
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
_LOST_PEER_MARKERS = ("Connection closed by peer", "Read error", "Connection reset", "pair.cc", "NCCL communicator was aborted")


def lost_a_peer(message: str) -> bool:
    """Whether ``message`` is a collective's error for a peer that died or left: the echo of another rank's failure."""
    return any(m in message for m in _LOST_PEER_MARKERS)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def agree(stage: str, error: str | None, rank: int = 0) -> None:
    """Share each rank's error (or ``None``) and raise :class:`StageError` on every rank if any failed.

    Without a process group the error is ``rank``'s: the rank this process
    plays (see :class:`osdpipe.world.SoloWorld`).
    """
    errors = {rank: error}
    if _initialized():
        gathered: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, error)
        errors = dict(enumerate(gathered))
    failures = {r: e for r, e in errors.items() if e is not None}
    if failures:
        raise StageError(stage, failures)


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
    """Every rank's ``value``, on every rank."""
    if not _initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def scatter_from(src: int, per_rank: list[Any] | None) -> Any:
    """Rank ``src`` gives each rank its own item of ``per_rank`` (one per rank; ``None`` elsewhere); each rank gets only its own."""
    if not _initialized():
        assert per_rank is not None
        return per_rank[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, per_rank if dist.get_rank() == src else None, src=src)
    return box[0]


def barrier() -> None:
    if _initialized():
        dist.barrier()
