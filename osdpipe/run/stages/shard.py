"""shard: cut this rank's piece of every target tensor out of the source, and pad it.

Every segment of the layout is copied from the same range of the source
parameter's flattened view, and only those ranges are read; the rest
(padding, parameters without state) is zero. A rank that reads for others
(``runtime.transfer=scatter``) first sends each of them its ranges
(:mod:`osdpipe.run.transfer`); under ``runtime.memory_budget`` every copy, read
and message is a batch of at most half the budget, and where nothing before
save needs the rank's output in memory, its tensors are left placeholders
that save fills batch by batch as it writes them (:mod:`osdpipe.run.streamed_output`):
the rank holds the budget, not its whole output.

This is where the source's tensor bytes are first read, so this is where NaN
and Inf in the source are found: each rank checks what it copied (together,
the ranks see every element). By default that fails the run before anything
is converted further or written; ``input.allow_nonfinite=true`` converts them
as they are, with a warning. (An output made as it is written is looked
through as it is written, and fails the save instead.)
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.core.compare import nonfinite_segments
from osdpipe.io import remote_input
from osdpipe.io.formats import TensorRef
from osdpipe.layout.ranges import LocalTensor
from osdpipe.run.collective import gather_to_all
from osdpipe.run.context import Context
from osdpipe.run.products import Described, Flattened, Sharded, Tally
from osdpipe.run.progress import track
from osdpipe.run.stages.broadcast import act_on_nonfinite
from osdpipe.run.stages.flatten import flat_entry
from osdpipe.run.streamed_output import StreamedOutput, held_warning, why_held
from osdpipe.run.transfer import Receiver, Server, Source, allocate, fill, plan


def nonfinite(tensor: LocalTensor, state: dict[str, Any]) -> list[str]:
    """Each source parameter and state name whose copied range holds NaN or Inf:
    ``"block1.gate exp_avg (2 element(s), first at flat index 5)"``."""
    found = []
    for name, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            found += nonfinite_segments(name, value.reshape(-1), tensor.segments)
    return found


def shard(ctx: Context, flat: Flattened, tally: Tally) -> Sharded:
    source = flat.source
    if source.reader is None and source.reads_itself(ctx.rank):
        raise RuntimeError("the shard stage needs the load and broadcast stages before it")
    found: list[str] = []
    failure: Exception | None = None
    state: dict[str, dict[str, Any]] = {}
    streamed: StreamedOutput | None = None
    sent_digests: dict[int, dict[tuple[str, str, int], str]] = {}
    read_digests: dict[tuple[str, str, int], str] | None = None
    try:
        sent_digests = _serve(ctx, source, tally)
        state, streamed, read_digests = _convert(ctx, flat, tally, found)
    except Exception as exc:  # noqa: BLE001 - raised below: first every rank must reach the collective
        failure = exc
    everywhere = sorted({f for rank_found in gather_to_all(found) for f in rank_found})
    if failure is not None:
        raise failure
    act_on_nonfinite(ctx, tally, everywhere, here=bool(found))
    return Sharded(flat, state, sent_digests, streamed=streamed, read_digests=read_digests)


def read_source(ctx: Context, source: Described) -> Source:
    """This rank's reader of the source, in pieces of the size ``runtime.memory_budget`` allows."""
    assert source.reader is not None, "the load stage opens the reader"
    return Source(source.reader, ctx.spec.runtime.piece_bytes)


def _serve(ctx: Context, source: Described, tally: Tally) -> dict[int, dict[tuple[str, str, int], str]]:
    """Send each rank this one reads for its batches (``runtime.transfer=scatter``); they wait for them, so first.

    Returns, per rank served, each batch's fingerprint (when roundtrip will check them).
    """
    receivers = source.receivers(ctx.rank)
    if not (source.reads_itself(ctx.rank) and receivers):
        return {}
    server = Server(read_source(ctx, source), digest=_roundtrip_checks(ctx))
    sent_digests: dict[int, dict[tuple[str, str, int], str]] = {}
    sends = [
        (receiver, tensor, plan(tensor, entry, source.meta, ctx.spec.runtime.piece_bytes))
        for receiver in receivers
        for tensor in ctx.target_layout(receiver)
        if (entry := flat_entry(tensor, source.meta)) is not None
    ]
    server.source.expect([batch for _, _, work in sends for batch in work])  # fetched ahead from object storage
    try:
        for receiver, tensor, work in sends:
            sent, digests = server.send(work, receiver)
            tally.sent += sent
            sent_digests.setdefault(receiver, {}).update(
                {(tensor.key, b.name, i): d for i, (b, d) in enumerate(zip(work, digests))}
            )
    finally:
        server.source.expect([])
    server.finish()
    return {receiver: sent_digests.get(receiver, {}) for receiver in receivers}


def _roundtrip_checks(ctx: Context) -> bool:
    return "verify" in ctx.plan.stages and "roundtrip" in ctx.spec.pipeline.checks


def digests_reads(ctx: Context) -> bool:
    """Whether this rank keeps the fingerprint of each batch it reads for itself, for the roundtrip check.

    Where the source is in object storage: there, reading it again for the check would fetch every byte a second
    time (as long as the conversion's own reads, and as many requests). A fingerprint taken of the bytes the
    conversion copied proves the same thing of the output (it holds exactly what was read), and fails on one wrong
    byte; what it cannot do is name the first differing element, so a local source, read again from the page cache,
    is compared byte by byte as before.
    """
    return _roundtrip_checks(ctx) and remote_input.is_remote(ctx.plan.input_path)


def _convert(
    ctx: Context, flat: Flattened, tally: Tally, found: list[str]
) -> tuple[dict[str, dict[str, Any]], StreamedOutput | None, dict[tuple[str, str, int], str] | None]:
    """Fill this rank's own tensors, read here or received; ``found`` collects the non-finite elements they hold.

    Under ``runtime.memory_budget``, when nothing before save needs them in
    memory, they are left placeholders that save fills as it writes them
    (:mod:`osdpipe.run.streamed_output`): the second value. The third: each batch's fingerprint as read,
    where the roundtrip check compares with them (:func:`digests_reads`).
    """
    source = flat.source
    reads = read_source(ctx, source) if source.reads_itself(ctx.rank) else None
    receiver = None if reads is not None else Receiver(source.reading_ranks[ctx.rank])
    tensors = [t for t in ctx.target_layout() if t.key in flat.entries]
    plans = [plan(t, flat.entries[t.key], source.meta, ctx.spec.runtime.piece_bytes) for t in tensors]
    streamed = _streamed(ctx, reads, tensors, flat, tally)
    if streamed is not None:
        return {
            t.key: streamed.allocate(t, flat.entries[t.key], source.meta, work) for t, work in zip(tensors, plans)
        }, streamed, None
    out: dict[str, dict[str, Any]] = {}
    read_digests = {} if reads is not None and digests_reads(ctx) else None
    if reads is not None:  # every read this rank makes, known now: an input in object storage fetches them ahead
        reads.expect([batch for work in plans for batch in work])
    try:
        for tensor, work in zip(track(tensors), plans):
            state = allocate(tensor, flat.entries[tensor.key], source.meta)
            if receiver is not None:
                tally.moved += receiver.receive(state, work)
            else:
                digests: list[str] | None = None if read_digests is None else []
                tally.moved += fill(state, work, reads, digests)
                if read_digests is not None:
                    read_digests.update({(tensor.key, b.name, i): d for i, (b, d) in enumerate(zip(work, digests))})
            out[tensor.key] = state
            found.extend(nonfinite(tensor, state))
    except Exception:
        if receiver is not None:
            receiver.drain([batch for work in plans for batch in work])  # the sender is still sending: take it all
        raise
    finally:
        if reads is not None:
            reads.expect([])
    return out, None, read_digests


def _streamed(
    ctx: Context, reads: Source | None, tensors: list[LocalTensor], flat: Flattened, tally: Tally
) -> StreamedOutput | None:
    """This rank's output as placeholders for save to fill from ``reads`` as it writes them,
    where a memory budget is set and nothing needs it in memory sooner.

    Otherwise ``None``; a rank whose output outgrows the budget says why in a warning.
    """
    budget = ctx.spec.runtime.memory_budget
    if budget is None:
        return None
    why = why_held(ctx, flat.source)
    if why is None:
        assert reads is not None, "a rank whose ranges are sent to it holds its output (why_held)"
        return StreamedOutput(reads, compare=_roundtrip_checks(ctx))
    output = sum(
        t.numel * v.torch_dtype.itemsize
        for t in tensors
        for v in flat.entries[t.key].values()
        if isinstance(v, TensorRef)
    )
    if output > budget and "save" in ctx.plan.stages:
        tally.warnings.append(held_warning(why, budget))
    return None
