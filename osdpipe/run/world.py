"""Which target ranks this process plays, and how they hear of each other.

Every conversion runs the same stages over a :class:`World`:

* :class:`GroupWorld`: one rank per process, in a ``torch.distributed``
  process group (a local world of spawned ranks, torchrun, the Python API's
  own world), or one rank alone without one;
* :class:`SoloWorld`: one process plays every target rank in turn, with no
  process group (``runtime.mode=offline``, and ``osdpipe check`` deriving a
  conversion again);
* :class:`ShareWorld`: W processes in a process group play the target's M
  ranks, each a share of them in turn (``runtime.mode=offline`` with
  ``runtime.workers``, or a torchrun world smaller than the target).

Stages never ask which world they run in. The collective helpers of
:mod:`osdpipe.run.collective` are trivial without a process group; what a stage
needs beyond them is asked of the world here, in terms that hold for both:
facts about the process (:meth:`World.process_facts`) and what the ranks
played so far have published (:meth:`World.published`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from osdpipe.run.collective import gather_processes, gather_to_all


class World:
    """The target world as seen from this process."""

    #: The number of target ranks.
    size: int
    #: What the memory watch calls this process in the report.
    label: str
    #: Whether the real target job can be built here: a model wrapped on a process group of the target's size
    #: (the checks that load into one, and PyTorch's own conversion, need it).
    builds_target: bool
    #: Whether the processes are the target's ranks, one each, and meet in every stage's collectives
    #: (:mod:`osdpipe.run.collective`); otherwise each plays its ranks apart, and they meet between ranks only.
    ranks_meet: bool = False
    #: Whether every rank hears what each lower rank published (:meth:`published`): not so for workers playing shares.
    hears_lower_ranks: bool = True
    #: Who plays a rank, where an error should name it (a worker and its node); ``None``: the rank's own process.
    player: str | None = None
    #: What this process makes once for every rank it plays (DCP's write plan), or was handed for its rank
    #: (the Python API's live model and optimizer): kept across the ranks it plays, never sent to another process.
    kept: dict[Any, Any]

    def ranks(self) -> Sequence[int]:
        """The target ranks this process plays, in the order it plays them."""
        raise NotImplementedError

    def process_facts(self, value: Any) -> list[Any]:
        """Per target rank, ``value`` as the process playing it sees it (a host name, whether a path exists there)."""
        raise NotImplementedError

    def published(self, key: str, rank: int, value: Any) -> dict[int, Any]:
        """Rank ``rank`` publishes ``value`` under ``key``; returns what each rank published that this process can know.

        In a process group that is every rank (a collective: every rank calls
        it); played in turn, it is each rank played so far, this one included,
        so a rank may ask for a lower rank's value and no other.
        """
        raise NotImplementedError

    def gather_processes(self, value: Any) -> list[Any]:
        """Every process's ``value``, on every process (a collective)."""
        return gather_processes(value)


class GroupWorld(World):
    """This process is one rank of an initialized process group (or the one rank of a world of one, without a group)."""

    ranks_meet = True

    def __init__(self) -> None:
        grouped = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if grouped else 0
        self.size = dist.get_world_size() if grouped else 1
        self.label = f"rank {self.rank}"
        self.builds_target = True
        self.kept = {}

    def ranks(self) -> Sequence[int]:
        return (self.rank,)

    def process_facts(self, value: Any) -> list[Any]:
        return gather_to_all(value)

    def published(self, key: str, rank: int, value: Any) -> dict[int, Any]:
        return dict(enumerate(gather_to_all(value)))


class SoloWorld(World):
    """One process, no process group: it plays every one of ``size`` target ranks in turn."""

    label = "offline"
    builds_target = False

    def __init__(self, size: int) -> None:
        self.size = size
        self.kept = {}
        self._published: dict[str, dict[int, Any]] = {}

    def ranks(self) -> Sequence[int]:
        return range(self.size)

    def process_facts(self, value: Any) -> list[Any]:
        return [value] * self.size  # one process plays them all: it sees the same host and files for each

    def published(self, key: str, rank: int, value: Any) -> dict[int, Any]:
        kept = self._published.setdefault(key, {})
        kept[rank] = value
        return kept


def balanced_shares(weights: Sequence[int], parts: int) -> list[range]:
    """Split ranks ``0 .. len(weights) - 1`` into ``parts`` runs of consecutive ranks,
    each run's weight near an equal share.

    Run ``k`` ends where the ranks before it weigh nearest to ``k`` shares of
    the total, moved so that every run keeps at least one rank (so ``parts`` must
    not exceed the number of ranks). Consecutive runs keep rank 0 with the
    first part, and the split depends on the weights alone: every worker
    computes the same shares.
    """
    count = len(weights)
    if not 1 <= parts <= count:
        raise ValueError(f"{parts} workers cannot each play at least one of {count} target ranks")
    total = sum(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    bounds = [0]
    for k in range(1, parts):
        nearest = min(range(count + 1), key=lambda i: abs(prefix[i] * parts - total * k))
        bounds.append(min(max(nearest, bounds[-1] + 1), count - (parts - k)))
    bounds.append(count)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def worker_named(worker: int, workers: int) -> str:
    """How errors name a worker of a :class:`ShareWorld`: ``"worker 1 of 2 on node-a"`` (its node: where to look)."""
    return f"worker {worker} of {workers} on {socket.gethostname()}"


class ShareWorld(SoloWorld):
    """One of W processes in a process group, playing its share of the target's ``size`` ranks in turn.

    The shares are runs of consecutive ranks balanced by what each rank
    writes (``weights``, see :func:`balanced_shares`), so the worker that
    plays rank 0 commits once every worker has staged its files. The
    processes meet only between the ranks they play
    (:meth:`gather_processes`, :meth:`process_facts`), never inside a rank's
    stages (:func:`osdpipe.run.collective.ranks_apart`); what a rank publishes
    reaches the ranks this worker plays after it, as offline. W = 1 is an
    offline run; no target job is built for any W.
    """

    def __init__(self, size: int, weights: Sequence[int]) -> None:
        super().__init__(size)
        self.worker, self.workers = dist.get_rank(), dist.get_world_size()
        self.shares = balanced_shares(weights, self.workers)
        self.label = f"worker {self.worker}"
        self.hears_lower_ranks = self.workers == 1
        self.player = worker_named(self.worker, self.workers)

    def ranks(self) -> Sequence[int]:
        return self.shares[self.worker]

    def process_facts(self, value: Any) -> list[Any]:
        seen = gather_processes(value)
        return [seen[worker] for worker, share in enumerate(self.shares) for _ in share]
