"""The one stage loop: every conversion, online or offline, and ``osdpipe check``'s derivation, runs here.

For each target rank this process plays (:meth:`~osdpipe.run.world.World.ranks`:
its own rank in a process group, every rank in turn offline), the stages run
in order on that rank's :class:`~osdpipe.run.context.Context`. Every rank's failure
in a stage is agreed on (:func:`~osdpipe.run.collective.agree`), so every rank
raises the same :class:`~osdpipe.run.collective.StageError`. The stages that open
and describe the source (:data:`SOURCE_STAGES`) run once per process: a rank
played later reuses what they made. What spans ranks is done after the last
rank, the same way in every world: the checks are combined, and the files
every rank staged are committed once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from osdpipe.core import vector_math
from osdpipe.core.memory import MemoryWatch, give_back_large_allocations
from osdpipe.io.checkpoints.base import fates
from osdpipe.io.upload_queue import UploadQueue
from osdpipe.io.weights import WholeSource
from osdpipe.pipeline.stages import STAGES
from osdpipe.run import progress, whereabouts
from osdpipe.run.collective import StageError, agree, one_line, ranks_apart
from osdpipe.run.context import Context
from osdpipe.run.products import CheckResult, Described, P, Sharded, SkippedCheck, Staged, Tally, Verified, find
from osdpipe.run.report import Report, StageReport
from osdpipe.run.stages.save import commit
from osdpipe.run.world import World
from osdpipe.spec.plan import Plan

#: Stages that open and describe the source: run once per process, their product shared by every rank it plays.
SOURCE_STAGES = ("load", "broadcast")


@dataclass
class Timings:
    """Per stage, the seconds this process spent in it and the bytes its ranks read or wrote, and sent each other."""

    seconds: dict[str, float] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, seconds: float, moved: int, sent: int) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.moved[name] = self.moved.get(name, 0) + moved
        self.sent[name] = self.sent.get(name, 0) + sent


@dataclass(frozen=True)
class Played:
    """One target rank once its stages have run:
    where it ran, the last stage's product, and the warnings its stages gave."""

    ctx: Context
    product: Any
    warnings: tuple[str, ...]

    def find(self, kind: type[P]) -> P | None:
        """The product of type ``kind`` this rank made (``None``: that stage did not run)."""
        return find(self.product, kind)


def play(
    plan: Plan,
    world: World,
    stages: Sequence[str],
    timings: Timings | None = None,
    on_rank: Callable[[Played], None] | None = None,
) -> Iterator[Played]:
    """Run ``stages`` for every rank ``world`` plays here; yield each rank once its stages have run.

    Each stage gets the previous stage's product and makes its own
    (:mod:`osdpipe.run.products`). A rank's products are dropped once the caller
    moves on to the next rank, so memory holds one target rank's state at a
    time; the source's (:data:`SOURCE_STAGES`) are made once and shared.
    """
    vector_math.settle()  # before any check steps an optimizer: their float math is compared bit for bit
    timings = timings if timings is not None else Timings()
    source: Described | None = None
    for rank in world.ranks():
        ctx = Context(plan, world, rank)
        product: Any = source
        warnings: list[str] = []
        for name in stages:
            if source is not None and name in SOURCE_STAGES:
                continue
            whereabouts.enter(name)
            if rank == 0:
                progress.emit("phase", f"stage {name}")
            tally = Tally()
            start = time.perf_counter()
            error = None
            try:
                product = STAGES[name](ctx, product, tally)
            except StageError:
                raise  # already agreed on by every rank inside the stage
            except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
                error = one_line(exc)
            agree(name, error, rank=rank)
            timings.add(name, time.perf_counter() - start, tally.moved, tally.sent)
            warnings += tally.warnings
            if name == SOURCE_STAGES[-1]:
                source = product
        played = Played(ctx, product, tuple(warnings))
        if on_rank is not None:
            on_rank(played)
        yield played
        del played, product  # not held through the next rank's stages: one target rank's state at a time


@dataclass
class RankOutcome:
    """What the report needs of one target rank once its stages have run."""

    rank: int
    checks: tuple[CheckResult, ...]
    skipped: tuple[SkippedCheck, ...]
    output_bytes: int
    saved: Any


def outcome_of(played: Played) -> RankOutcome:
    verified, sharded, staged = played.find(Verified), played.find(Sharded), played.find(Staged)
    return RankOutcome(
        played.ctx.rank,
        () if verified is None else verified.checks,
        () if verified is None else verified.skipped,
        0 if sharded is None else sharded.state_bytes(),
        None if staged is None else staged.files,
    )


def run_stages(
    plan: Plan,
    world: World,
    on_rank: Callable[[Played], None] | None = None,
    display: progress.Display | None = None,
) -> tuple[Report, Played]:
    """The conversion over ``world``: every rank's stages, then the checks combined and the staged files committed.

    Returns the report, the same on every process, and the last rank this
    process played (the Python API returns its state dict). Where the
    processes are not the target's ranks (:attr:`~osdpipe.run.world.World.ranks_meet`),
    each plays its ranks apart and they meet here, after the last. ``display``: the live line where this process
    draws its own (offline, one process), else what it does is sent as progress events (:mod:`osdpipe.run.progress`).
    """
    with nullcontext() if world.ranks_meet else ranks_apart(world.player):
        return _run_stages(plan, world, on_rank, display)


def _run_stages(
    plan: Plan, world: World, on_rank: Callable[[Played], None] | None, display: progress.Display | None
) -> tuple[Report, Played]:
    stages = list(plan.stages)
    timings = Timings()
    outcomes: list[RankOutcome] = []
    warnings: list[str] = []
    give_back_large_allocations()  # a batch read as a copy is given back when freed, not kept by the allocator
    watch = MemoryWatch(world.label).start()
    last: Played | None = None
    # an output in object storage: the save stage sends each rank's files as soon as they are written
    queue = UploadQueue(plan.upload) if plan.upload is not None and "save" in stages else None
    if queue is not None:
        world.kept[UploadQueue] = queue
    ranks = play(plan, world, stages, timings, on_rank)
    try:
        for _ in world.ranks():
            # The rank played before goes before the next is made (what the report needs of it is in ``outcomes``):
            # a ``for`` over ``play`` would keep its tensors through the next rank's stages, two target ranks' at once.
            last = None
            last = next(ranks)
            outcomes.append(outcome_of(last))
            warnings += [w for w in last.warnings if w not in warnings]
    except BaseException:
        if queue is not None:
            queue.withdraw()  # what it sent, removed once nothing is in flight (the launcher removes the rest)
        raise
    finally:
        peak = watch.stop()  # its sampling thread must not outlive a failed run in a caller's process (the Python API)
    assert last is not None, "a world plays at least one rank"
    # every upload done before the commit moves the files it reads
    unsent = None if queue is None else queue.finish(_upload_shown(plan, world, display))
    per_process = world.gather_processes((outcomes, unsent))
    every = sorted((o for process, _ in per_process for o in process), key=lambda o: o.rank)
    checks = combine([list(o.checks) for o in every]) if every and every[0].checks else []
    ok = all(c.ok for c in checks)
    failed = [(process[0].rank, error) for process, error in per_process if error is not None]
    if ok and failed:
        raise StageError("save", dict(failed[:1]))
    files: dict[str, str] = {}
    if ok and "save" in stages and all(o.saved is not None for o in every):
        start = time.perf_counter()
        tally = Tally()
        error = None
        if 0 in world.ranks():  # one process commits: the one that plays rank 0
            try:
                files = commit(last.ctx, [o.saved for o in every], tally, _carried(last))
            except Exception as exc:  # noqa: BLE001 - shared with every process below
                error = one_line(exc)
        # the committing process's: rank 0 is the first process's first
        error, files = world.gather_processes((error, files))[0]
        if error is not None:
            raise StageError("save", {0: error})
        timings.add("save", time.perf_counter() - start, tally.moved, 0)
    carried = _carried(last)
    if carried is not None:  # what the output cannot hold as the source's job had it
        adopted = last.ctx.plan.output_checkpoint.adopt(carried.carrying)
        warnings += [w for w in adopted.warnings if w not in warnings]
    per_process = world.gather_processes((timings, peak, warnings))
    warnings = [w for _, _, said in per_process for w in said]
    # each once, in the order the processes said them
    warnings = [w for i, w in enumerate(warnings) if w not in warnings[:i]]
    report = Report(
        ok=ok,
        stages=[
            StageReport(
                name,
                round(max(t.seconds.get(name, 0.0) for t, _, _ in per_process), 6),
                sum(t.moved.get(name, 0) for t, _, _ in per_process),
                sum(t.sent.get(name, 0) for t, _, _ in per_process),
            )
            for name in stages
        ],
        checks=checks,
        skipped_checks=list(outcomes[-1].skipped),
        files=files,
        warnings=warnings,
        memory=[p for _, p, _ in per_process],
        memory_budget=plan.spec.runtime.memory_budget,
        output_bytes=[o.output_bytes for o in every],
        entries=_entries(last),
    )
    return report, last


def _upload_shown(plan: Plan, world: World, display: progress.Display | None) -> Callable[[int, int], None] | None:
    """Where this process draws the live line (it plays rank 0): the wait for its files' uploads as a phase of it,
    and what tells it their bytes sent (:meth:`~osdpipe.io.upload_queue.UploadQueue.finish`); else ``None``.

    A large output's last files are still going up when its last rank has converted; without this the line would
    stand still at the conversion's end for as long."""
    assert plan.upload is not None, "only an output in object storage has an upload queue"
    if 0 not in world.ranks():
        return None
    draw = progress.drawer(display)
    played = list(world.ranks())  # under a process group each rank sends its own files
    whose = "the ranks'" if len(played) == plan.world_size else f"rank {', '.join(map(str, played))}'s"
    draw(("phase", f"uploading {whose} files to {plan.upload.url}", "B"))
    return lambda sent, total: draw(("items", sent, total))


def _carried(played: Played) -> WholeSource | None:
    """What a whole checkpoint carries over besides the model and the optimizer
    (``None``: the input is an optimizer's alone)."""
    source = played.find(Described)
    return None if source is None else source.meta.carried


def _entries(played: Played) -> list[dict[str, Any]]:
    """A whole checkpoint's every entry and what became of it (none for an optimizer's alone)."""
    carried = _carried(played)
    written = played.ctx.plan.output_checkpoint
    return [] if carried is None else fates(written.adopt(carried.carrying), written.weights_alone)


def combine(per_rank: list[list[CheckResult]]) -> list[CheckResult]:
    """Every rank's results of the same checks as one result per check, naming the ranks where it failed."""
    combined = []
    for i, check in enumerate(per_rank[0]):
        failed = [(r, checks[i]) for r, checks in enumerate(per_rank) if not checks[i].ok]
        detail = "; ".join(f"rank {r}: {c.detail}" for r, c in failed[:3]) if failed else check.detail
        combined.append(CheckResult(check.name, not failed, detail))
    return combined
