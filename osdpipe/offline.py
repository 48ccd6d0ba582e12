"""Offline conversion: one process, no process group, every target rank in turn.

A layout needs only the module tree of a ``meta`` model, the wrapping and the
world size, so one process can play each of the target's ranks: the same
stages run for rank 0, then rank 1, ... with no collective (the helpers of
:mod:`osdpipe.collective` act on one process). The source is opened once
(``load``, ``broadcast``) and shared; everything else is made per rank and
dropped before the next, so memory holds one target rank's output and the
tensors being copied. Files are staged rank by rank and committed once, after
the last rank, so a failure anywhere writes nothing.

Verify runs what needs no live target world: ``roundtrip`` streams each
rank's ranges against the source and checks coverage; ``replicas`` compares a
hybrid source's replica groups, and each hybrid target rank's state with its
first group's (by digest). ``reference`` and ``load_step`` build the real
target job, which needs its world; the report lists the checks that ran, and
a warning names those that did not.
"""

from __future__ import annotations

import time

from osdpipe.collective import StageError, one_line
from osdpipe.config import RunSpec
from osdpipe.context import Context
from osdpipe.memory import MemoryWatch
from osdpipe.models import build_model
from osdpipe.pipeline import Report, StageReport, state_bytes
from osdpipe.progress import Display
from osdpipe.stages import STAGES
from osdpipe.stages.save import commit_offline
from osdpipe.stages.verify import combine
from osdpipe.tree import ModuleTree, describe

#: Stages that open and describe the source: run once, their product shared by every rank.
SOURCE_STAGES = ("load", "broadcast")


def rank_context(spec: RunSpec, tree: ModuleTree, rank: int, input_path: str, input_format: str, source: tuple, shared: dict) -> Context:
    """Target rank ``rank``'s context, played offline; ``source`` is the ``(reader, meta)`` an earlier rank opened (empty for the first)."""
    ctx = Context(
        spec=spec, rank=rank, world_size=spec.target.world_size, tree=tree, input_path=input_path, input_format=input_format, offline=True, shared=shared
    )
    if source:
        ctx.reader, ctx.meta = source
    return ctx


def stages_for(stages: list[str] | tuple[str, ...], source: tuple) -> list[str]:
    """The stages a rank runs offline: those that open and describe the source only where no earlier rank did."""
    return [name for name in stages if not (source and name in SOURCE_STAGES)]


def run_offline(spec: RunSpec, input_path: str, input_format: str, display: Display) -> Report:
    """Convert ``input_path`` for every rank of ``spec.target`` in this process, and commit the files.

    Raises:
        StageError: naming the stage and the target rank that failed.
    """
    world = spec.target.world_size
    watch = MemoryWatch("offline").start()
    tree = describe(build_model(spec.model.factory, spec.model.kwargs, device="meta"))
    seconds: dict[str, float] = {name: 0.0 for name in spec.pipeline.stages}
    moved: dict[str, int] = {name: 0 for name in spec.pipeline.stages}
    checks, saved, warnings, output_bytes = [], [], [], []
    shared: tuple = ()
    same_for_every_rank: dict = {}
    display.phase(f"offline: {world} target rank(s)")
    ctx = None
    try:
        for rank in range(world):
            ctx = rank_context(spec, tree, rank, input_path, input_format, shared, same_for_every_rank)
            for name in stages_for(spec.pipeline.stages, shared):
                ctx.bytes_moved = 0
                start = time.perf_counter()
                try:
                    STAGES[name](ctx)
                except StageError:
                    raise
                except Exception as exc:  # noqa: BLE001 - said as the stage's error on this rank
                    raise StageError(name, {rank: one_line(exc)}) from exc
                seconds[name] += time.perf_counter() - start
                moved[name] += ctx.bytes_moved
            shared = (ctx.reader, ctx.meta)
            checks.append(ctx.checks)
            saved.append(ctx.saved)
            output_bytes.append(state_bytes(ctx.local_state))
            warnings += [w for w in ctx.warnings if w not in warnings]
            display(("items", rank + 1, world))
    finally:
        peak = watch.stop()
    assert ctx is not None
    combined = combine(checks) if checks and checks[0] else []
    ok = all(c.ok for c in combined)
    files: dict[str, str] = {}
    if ok and "save" in spec.pipeline.stages and all(s is not None for s in saved):
        start = time.perf_counter()
        ctx.bytes_moved = 0
        files = commit_offline(ctx, saved)
        seconds["save"] += time.perf_counter() - start
        moved["save"] += ctx.bytes_moved
    stages = [StageReport(name, round(seconds[name], 6), moved[name]) for name in spec.pipeline.stages]
    return Report(
        ok=ok, stages=stages, checks=combined, skipped_checks=ctx.skipped_checks, files=files, warnings=warnings, memory=[peak],
        memory_budget=spec.runtime.memory_budget, output_bytes=output_bytes,
    )
