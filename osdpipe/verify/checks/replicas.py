"""``replicas`` (a side hybrid-sharded: HYBRID_SHARD, HSDP):
the source's replica groups hold the same state, and so do the output's."""

from __future__ import annotations

from osdpipe.io import formats
from osdpipe.io.digest import tensor_digests
from osdpipe.run.collective import one_line
from osdpipe.run.products import CheckResult
from osdpipe.verify.checks.common import Subject


def has_replicas(ctx: Subject) -> tuple[bool, bool]:
    """Whether the source files, and the target files,
    come in replica groups (hybrid sharding, read or written per rank).

    The output's are compared where each rank hears the rank holding the
    same shard in the first group (workers playing shares of the ranks do
    not: :attr:`~osdpipe.run.world.World.hears_lower_ranks`).
    """
    source = formats.get(ctx.input_format).holds_replicas and ctx.plan.source_spec.replicas > 1
    return source, _output_replicas(ctx) and ctx.world.hears_lower_ranks


def _output_replicas(ctx: Subject) -> bool:
    return ctx.id_keyed and ctx.plan.target_spec.replicas > 1


def _first_replica_digests(ctx: Subject, mine: dict[str, str], first: int) -> dict[str, str]:
    """The state digests of rank ``first`` (which holds this rank's shard in the first replica group).

    ``first`` is never later than this rank, so every world has it
    (:meth:`~osdpipe.run.world.World.published`): a process group gathers
    them, and a process playing ranks in turn has seen it go by.
    """
    return ctx.world.published("replica digests", ctx.rank, mine)[first]


def run(ctx: Subject) -> CheckResult:
    """Replica groups agree: the source's (read from one group), and the output's (written for every group).

    Each rank compares a share of the source's rank files with the first
    replica group's; the output's ranks compare their state's digests with
    the rank that holds the same shard in the first group.
    """
    source, target = has_replicas(ctx)
    problems: list[str] = []
    if source:
        readers = sorted(set(ctx.reading_ranks)) if ctx.reading_ranks is not None else list(range(ctx.world_size))
        # the ranks that read the input share the files out
        share = readers.index(ctx.rank) if ctx.rank in readers else None
        mine = [r for r in range(ctx.spec.source.world_size) if share is not None and r % len(readers) == share]
        try:  # not raised: every rank must reach the gather below
            problems += [f"source {p}" for p in formats.get(ctx.input_format).replica_mismatches(
                ctx.input_path, ctx.plan.source_spec, mine
            )]
        except Exception as exc:  # noqa: BLE001
            problems.append(f"source replicas unreadable: {one_line(exc)}")
    if target:
        assert ctx.result is not None
        digests = tensor_digests(ctx.result)
        first = ctx.plan.target_spec.first_replica(ctx.rank)
        theirs = _first_replica_digests(ctx, digests, first)
        if digests != theirs:
            differ = sorted(k for k in digests.keys() | theirs.keys() if digests.get(k) != theirs.get(k))
            problems.append(
                f"output rank {ctx.rank} differs from rank {first}, which holds the same shard: {', '.join(differ[:3])}"
            )
    sides = " and ".join(s for s, applies in (("the source's", source), ("the output's", target)) if applies)
    return CheckResult(
        "replicas", not problems, "; ".join(problems[:5]) or f"{sides} replica groups hold the same state bitwise"
    )


def skip_reason(ctx: Subject) -> str | None:
    if not any(has_replicas(ctx)):
        if _output_replicas(ctx):
            return (
                "compares each output rank with its first replica group's, "
                "which workers playing shares of the ranks do not all hear (leave runtime.workers at 1 to compare)"
            )
        return "applies only where a side has replica groups (HYBRID_SHARD, HSDP)"
    return None

