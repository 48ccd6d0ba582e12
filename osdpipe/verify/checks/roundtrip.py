"""``roundtrip``: every converted element equals the same element of the source,
bitwise, and the ranks cover every source element.

Padding is zero; scalar state equals the source's; a rank sent its ranges
(``runtime.transfer=scatter``) compares them with the digests its reading
rank took, and a rank that read a source in object storage with the digests it
took as it read (rather than fetching every byte again). Together: gathered
back, the result *is* the source. An output
made as it is written (:mod:`osdpipe.run.streamed_output`) has its elements and its
padding compared by the same function as save writes them, batch by batch.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.core.compare import diff, differing_segments
from osdpipe.io.formats import TensorRef
from osdpipe.io.formats.base import WEIGHTS
from osdpipe.layout import kinds
from osdpipe.layout.ranges import LocalTensor, uncovered
from osdpipe.run.collective import scatter_from
from osdpipe.run.products import CheckResult
from osdpipe.run.transfer import Batch, batch_fingerprint, plan, stateful
from osdpipe.verify.checks.common import Subject


def _result_state(ctx: Subject, key: str) -> dict[str, Any] | None:
    """What the output holds for layout key ``key``: its optimizer state, and a whole checkpoint's weights beside it."""
    assert ctx.result is not None
    rkey = ctx.result_keys.get(key)
    state = None if rkey is None else ctx.result["state"].get(rkey)
    weights = ctx.keyed.weights if ctx.keyed is not None else None
    if weights is not None and key in weights:
        return {**(state or {}), WEIGHTS: weights[key]}
    return state


def run(ctx: Subject) -> CheckResult:
    """Compare this rank's converted tensors with the source, batch by batch, and check coverage.

    A rank that reads a local source compares the bytes themselves (and names
    the first differing element); a rank whose bytes were sent to it
    (``runtime.transfer=scatter``) compares each batch's fingerprint with the
    one its reading rank took of the source while sending it, and a rank
    that read a source in object storage with the one it took as it read
    (:func:`osdpipe.run.stages.shard.digests_reads`).
    """
    assert ctx.meta is not None
    # The digests of the source's batches taken as they were read: by the rank that sent them here, else by this
    # rank as it read a source in object storage; None where the source is read again and compared byte by byte.
    read_digests = _sent_digests(ctx)
    reader = ctx.rank if ctx.reading_ranks is None else ctx.reading_ranks[ctx.rank]
    if read_digests is None and ctx.keyed is not None:
        read_digests = ctx.keyed.sharded.read_digests
    problems: list[str] = []
    reads: list[tuple[LocalTensor, dict[str, Any], list[tuple[int, Batch]]]] = []  # compared below, all known first
    for tensor in ctx.target_layout():
        entry = ctx.flat_state.get(tensor.key)
        if ctx.id_keyed and tensor.key not in ctx.held_keys(ctx.rank):
            # A parameter outside the target optimizer carries no optimizer state there;
            # a whole checkpoint's weights it does.
            entry = {WEIGHTS: entry[WEIGHTS]} if entry is not None and WEIGHTS in entry else None
            if entry is None:
                continue
        state = _result_state(ctx, tensor.key)
        if entry is None:
            if state:
                problems.append(f"{tensor.key}: has state where the source has none")
            continue
        if state is None:
            problems.append(f"{tensor.key}: state missing")
            continue
        comparable = set()  # the state names whose tensors have the layout's shape: their bytes are compared below
        for name, expected in entry.items():
            value = state.get(name)
            if not isinstance(expected, TensorRef):
                sources = [ctx.meta.state[f][name] for f in tensor.fqns if name in ctx.meta.state.get(f, {})]
                if any(diff(value, s) for s in sources):
                    problems.append(f"{tensor.key}.{name}: {value!r} differs from the source's {sources[0]!r}")
                continue
            if not torch.is_tensor(value) or tuple(value.shape) != tensor.shape:
                problems.append(f"{tensor.key}.{name}: expected a tensor of shape {tensor.shape}")
                continue
            if ctx.streamed is not None and ctx.streamed.holds(state, name):
                continue  # made as save writes it: each batch is compared then (osdpipe.run.streamed_output)
            problems += _zero_where_no_state(tensor, name, value.reshape(-1), ctx)
            comparable.add(name)
        work = [
            (i, b)
            for i, b in enumerate(plan(tensor, entry, ctx.meta, ctx.spec.runtime.piece_bytes))
            if b.name in comparable
        ]
        if read_digests is None:
            reads.append((tensor, state, work))
        else:
            problems += _compare_digests(tensor, state, work, read_digests, reader, ctx.rank)
    problems += _compare_reads(reads, ctx)
    if ctx.rank == 0:  # pure layout math over all target ranks: one rank suffices
        problems.extend(_coverage_gaps(ctx))
    passed = "every element equals the source bitwise; every source element is covered"
    if ctx.streamed is not None:
        passed = (
            "shapes and scalar state match the source; every source element is covered; "
            "the elements are compared bitwise "
            "batch by batch as save writes them (runtime.memory_budget), and a difference fails the save"
        )
    return CheckResult("roundtrip", not problems, "; ".join(problems[:5]) or passed)


def _sent_digests(ctx: Subject) -> dict[tuple[str, str, int], str] | None:
    """The digests this rank's reading rank took of the batches it sent here
    (``None``: this rank reads the source itself)."""
    if ctx.reading_ranks is None or not any(reader != r for r, reader in enumerate(ctx.reading_ranks)):
        return None
    mine: dict[tuple[str, str, int], str] = {}
    # collectives: every rank takes part, also those that read for themselves
    for reader in sorted(set(ctx.reading_ranks)):
        per_rank = [ctx.sent_digests.get(r, {}) for r in range(ctx.world_size)] if ctx.rank == reader else None
        got = scatter_from(reader, per_rank)  # each rank gets its own digests only, not every receiver's
        if reader == ctx.reading_ranks[ctx.rank]:
            mine = got
    return None if ctx.reads_itself else mine


def _zero_where_no_state(tensor: LocalTensor, name: str, flat: torch.Tensor, ctx: Subject) -> list[str]:
    """Padding, and the ranges of parameters without state ``name`` in the source, hold zeros."""
    assert ctx.meta is not None
    problems = []
    if any(
        bool(flat[lo:hi].any())
        for lo, hi in uncovered(0, flat.numel(), [(s.dest, s.dest + s.length) for s in tensor.segments])
    ):
        problems.append(f"{tensor.key}.{name}: padding is not zero")
    have = set(stateful(tensor, name, ctx.meta))
    for seg in tensor.segments:
        if seg not in have and bool(flat[seg.dest : seg.dest + seg.length].any()):
            problems.append(f"{tensor.key}.{name}: {seg.fqn} has no {name} in the source, but its range is not zero")
    return problems


def _compare_reads(reads: list[tuple[LocalTensor, dict[str, Any], list[tuple[int, Batch]]]], ctx: Subject) -> list[str]:
    """Each batch of the result against the same ranges read from the source, bitwise.

    Every read is known before the first is made: a source in object storage fetches them ahead as few requests
    (:meth:`osdpipe.run.transfer.Source.expect`), as the shard stage did.
    """
    if not reads:
        return []
    source, problems = ctx.read_source(), []
    source.expect([batch for _, _, work in reads for _, batch in work])
    try:
        for tensor, state, work in reads:
            for _, batch in work:
                stored, pieces = source.parts(batch)
                problems += differing_segments(
                    f"{tensor.key}.{batch.name}", state[batch.name].reshape(-1), stored.segments, pieces
                )
                source.done(batch)
    finally:
        source.expect([])
    return problems


def _compare_digests(
    tensor: LocalTensor,
    state: dict[str, Any],
    work: list[tuple[int, Batch]],
    digests: dict[tuple[str, str, int], str],
    reader: int,
    rank: int,
) -> list[str]:
    """Each batch of the result (``i``: its place in the plan)
    against the digest rank ``reader`` took of the source as it read it (this rank: ``rank``)."""
    who = "this rank" if reader == rank else f"rank {reader}"
    problems = []
    for i, batch in work:
        if batch_fingerprint(state, batch) != digests.get((tensor.key, batch.name, i)):
            first, last = batch.segments[0], batch.segments[-1]
            where = f"{first.fqn}[{first.start}..{first.start + first.length}]" + (
                f" .. {last.fqn}" if len(batch.segments) > 1 else ""
            )
            problems.append(
                f"{tensor.key}.{batch.name}: elements {where} (flat) "
                f"differ from what {who} read from the source"
            )
    return problems


def _coverage_gaps(ctx: Subject) -> list[str]:
    """Source tensor elements that no target rank holds (computed from all target layouts), state by state: a layout
    that keeps a parameter's weights and its optimizer's state in tensors of their own (Megatron's model boxes and
    buckets) must cover each."""
    assert ctx.meta is not None
    held: dict[tuple[str, str | None], list[tuple[int, int]]] = {}
    ranks = ctx.spec.target.world_size if ctx.id_keyed else ctx.world_size
    for r in range(ranks):
        for tensor in ctx.target_layout(r):
            if ctx.id_keyed and tensor.key not in ctx.held_keys(r):
                continue
            for seg in tensor.segments:
                for state in tensor.states or (None,):
                    held.setdefault((seg.fqn, state), []).append((seg.start, seg.start + seg.length))
    gaps = []
    left_out = kinds.get(ctx.spec.target.kind).left_out(ctx.tree, ctx.plan.target_spec)  # on purpose: padding
    for fqn, entries in ctx.meta.state.items():
        numel = ctx.tree.param(fqn).numel
        for name in (n for n, v in entries.items() if isinstance(v, TensorRef)):
            ranges = [*held.get((fqn, None), []), *held.get((fqn, name), [])]
            ranges += [left_out[fqn]] if fqn in left_out else []
            missing = sum(hi - lo for lo, hi in uncovered(0, numel, ranges))
            if missing:
                gaps.append(f"{fqn}: {missing} of {numel} elements of {name} are held by no target rank")
                break
    return gaps


def skip_reason(ctx: Subject) -> str | None:
    return None  # it runs on every conversion

