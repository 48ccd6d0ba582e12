"""The one stage loop: every conversion, online or offline, and ``osdpipe check``'s derivation, runs here.

For each target rank this process plays (:meth:`~osdpipe.world.World.ranks`:
its own rank in a process group, every rank in turn offline), the stages run
in order on that rank's :class:`~osdpipe.context.Context`. Every rank's failure
in a stage is agreed on (:func:`~osdpipe.collective.agree`), so every rank
raises the same :class:`~osdpipe.collective.StageError`. The stages that open
and describe the source (:data:`SOURCE_STAGES`) run once per process: a rank
played later reuses what they made. What spans ranks is done after the last
rank, the same way in every world: the checks are combined, and the files
every rank staged are committed once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from osdpipe import progress, whereabouts
from osdpipe.collective import StageError, agree, one_line
from osdpipe.context import CheckResult, Context
from osdpipe.memory import MemoryWatch
from osdpipe.report import Report, StageReport
from osdpipe.stages import STAGES
from osdpipe.stages.save import commit
from osdpipe.world import World

#: Stages that open and describe the source: run once per process, their product shared by every rank it plays.
SOURCE_STAGES = ("load", "broadcast")

#: Makes the context of a target rank: ``(rank, shared)`` -> its context (``shared``: what every rank of this process shares).
NewContext = Callable[[int, dict[str, Any]], Context]


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


def play(world: World, stages: Sequence[str], new_context: NewContext, timings: Timings | None = None, on_rank: Callable[[int], None] | None = None) -> Iterator[Context]:
    """Run ``stages`` for every rank ``world`` plays here; yield each rank's context once its stages have run.

    A rank's products are dropped once the caller moves on to the next
    rank, so memory holds one target rank's state at a time.
    """
    timings = timings if timings is not None else Timings()
    shared: dict[str, Any] = {}
    source: tuple[Any, ...] = ()
    for rank in world.ranks():
        ctx = new_context(rank, shared)
        if source:
            ctx.reader, ctx.meta, ctx.reading_ranks = source
        for name in stages:
            if source and name in SOURCE_STAGES:
                continue
            whereabouts.enter(name)
            if rank == 0:
                progress.emit("phase", f"stage {name}")
            ctx.bytes_moved = ctx.bytes_sent = 0
            start = time.perf_counter()
            error = None
            try:
                STAGES[name](ctx)
            except StageError:
                raise  # already agreed on by every rank inside the stage
            except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
                error = one_line(exc)
            agree(name, error, rank=rank)
            timings.add(name, time.perf_counter() - start, ctx.bytes_moved, ctx.bytes_sent)
        source = (ctx.reader, ctx.meta, ctx.reading_ranks)
        if on_rank is not None:
            on_rank(rank)
        yield ctx


@dataclass
class RankOutcome:
    """What the report needs of one target rank once its stages have run."""

    rank: int
    checks: list[CheckResult]
    output_bytes: int
    saved: Any


def run_stages(world: World, stages: Sequence[str], new_context: NewContext, on_rank: Callable[[int], None] | None = None) -> tuple[Report, Context | None]:
    """The conversion over ``world``: every rank's stages, then the checks combined and the staged files committed.

    Returns the report, the same on every process, and the context of the
    last rank this process played (the Python API returns its result).
    """
    spec_stages = list(stages)
    timings = Timings()
    outcomes: list[RankOutcome] = []
    warnings: list[str] = []
    watch = MemoryWatch(world.label).start()
    ctx: Context | None = None
    try:
        for ctx in play(world, spec_stages, new_context, timings, on_rank):
            outcomes.append(RankOutcome(ctx.rank, ctx.checks, state_bytes(ctx.local_state), ctx.saved))
            warnings += [w for w in ctx.warnings if w not in warnings]
    finally:
        peak = watch.stop()  # its sampling thread must not outlive a failed run in a caller's process (the Python API)
    assert ctx is not None, "a world plays at least one rank"
    every = sorted((o for process in world.gather_processes(outcomes) for o in process), key=lambda o: o.rank)
    checks = combine([o.checks for o in every]) if every and every[0].checks else []
    ok = all(c.ok for c in checks)
    files: dict[str, str] = {}
    if ok and "save" in spec_stages and all(o.saved is not None for o in every):
        start = time.perf_counter()
        ctx.bytes_moved = 0
        error = None
        if 0 in world.ranks():  # one process commits: the one that plays rank 0
            try:
                files = commit(ctx, [o.saved for o in every])
            except Exception as exc:  # noqa: BLE001 - shared with every process below
                error = one_line(exc)
        agree("save", error)
        timings.add("save", time.perf_counter() - start, ctx.bytes_moved, 0)
    per_process = world.gather_processes((timings, peak))
    report = Report(
        ok=ok,
        stages=[
            StageReport(
                name,
                round(max(t.seconds.get(name, 0.0) for t, _ in per_process), 6),
                sum(t.moved.get(name, 0) for t, _ in per_process),
                sum(t.sent.get(name, 0) for t, _ in per_process),
            )
            for name in spec_stages
        ],
        checks=checks,
        skipped_checks=ctx.skipped_checks,
        files=files,
        warnings=warnings,
        memory=[p for _, p in per_process],
        memory_budget=ctx.spec.runtime.memory_budget,
        output_bytes=[o.output_bytes for o in every],
    )
    return report, ctx


def combine(per_rank: list[list[CheckResult]]) -> list[CheckResult]:
    """Every rank's results of the same checks as one result per check, naming the ranks where it failed."""
    combined = []
    for i, check in enumerate(per_rank[0]):
        failed = [(r, checks[i]) for r, checks in enumerate(per_rank) if not checks[i].ok]
        detail = "; ".join(f"rank {r}: {c.detail}" for r, c in failed[:3]) if failed else check.detail
        combined.append(CheckResult(check.name, not failed, detail))
    return combined


def state_bytes(local_state: dict[str, dict]) -> int:
    """The bytes of the tensors a rank converted: its own output, which a memory budget does not count."""
    return sum(v.numel() * v.element_size() for state in local_state.values() for v in state.values() if hasattr(v, "numel") and v.dim() > 0)
