"""shard: cut this rank's piece of every target tensor out of the source, and pad it.

Every segment of the layout is copied from the same range of the source
parameter's flattened view, and only those ranges are read; the rest
(padding, parameters without state) is zero. A rank that reads for others
(``runtime.transfer=scatter``) first sends each of them its ranges
(:mod:`osdpipe.transfer`); under ``runtime.memory_budget`` every copy, read
and message is a batch of at most half the budget.

This is where the source's tensor bytes are first read, so this is where NaN
and Inf in the source are found: each rank checks what it copied (together,
the ranks see every element). By default that fails the run before anything
is converted further or written; ``input.allow_nonfinite=true`` converts them
as they are, with a warning.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.collective import gather_to_all
from osdpipe.context import Context
from osdpipe.layout import LocalTensor
from osdpipe.progress import track
from osdpipe.stages.flatten import flat_entry
from osdpipe.transfer import Receiver, Server, allocate, fill, plan


def nonfinite(tensor: LocalTensor, state: dict[str, Any]) -> list[str]:
    """Each source parameter and state name whose copied range holds NaN or Inf: ``"block1.gate exp_avg (2 elements, first [5])"``."""
    found = []
    for name, value in state.items():
        if not torch.is_tensor(value) or value.dim() == 0 or not value.is_floating_point():
            continue
        if bool(torch.isfinite(value.sum())):
            continue  # a NaN or an Inf anywhere makes the sum NaN or Inf; a finite sum needs no element-wise pass (one that overflows gets it)
        bad = ~torch.isfinite(value.reshape(-1))
        if not bool(bad.any()):
            continue
        for seg in tensor.segments:
            hits = bad[seg.dest : seg.dest + seg.length].nonzero()
            if hits.numel():
                found.append(f"{seg.fqn} {name} ({hits.numel()} element(s), first at flat index {seg.start + int(hits[0])})")
    return found


def shard(ctx: Context) -> None:
    if ctx.meta is None or (ctx.reader is None and ctx.reads_itself):
        raise RuntimeError("the shard stage needs the load and broadcast stages before it")
    found: list[str] = []
    failure: Exception | None = None
    try:
        _serve(ctx)
        _convert(ctx, found)
    except Exception as exc:  # noqa: BLE001 - raised below: first every rank must reach the collective
        failure = exc
    everywhere = sorted({f for rank_found in gather_to_all(found) for f in rank_found})
    if failure is not None:
        raise failure
    ctx.nonfinite_in_source(everywhere, here=bool(found))


def _serve(ctx: Context) -> None:
    """Send each rank this one reads for its batches (``runtime.transfer=scatter``); they wait for them, so first."""
    assert ctx.meta is not None
    if not (ctx.reads_itself and ctx.receivers()):
        return
    server = Server(ctx.source(), digest="verify" in ctx.spec.pipeline.stages and "roundtrip" in ctx.spec.pipeline.checks)
    for receiver in ctx.receivers():
        ctx.sent_digests[receiver] = {}
        for tensor in ctx.target_layout(receiver):
            entry = flat_entry(tensor, ctx.meta)
            if entry is None:
                continue
            work = plan(tensor, entry, ctx.meta, ctx.spec.runtime.piece_bytes)
            sent, digests = server.send(work, receiver)
            ctx.bytes_sent += sent
            ctx.sent_digests[receiver].update({(tensor.key, b.name, i): d for i, (b, d) in enumerate(zip(work, digests))})
    server.finish()


def _convert(ctx: Context, found: list[str]) -> None:
    """Fill this rank's own tensors, read here or received; ``found`` collects the non-finite elements they hold."""
    assert ctx.meta is not None
    ctx.local_state = {}
    source = ctx.source() if ctx.reads_itself else None
    receiver = None if source is not None else Receiver(ctx.reading_ranks[ctx.rank])
    tensors = [t for t in ctx.target_layout() if t.key in ctx.flat_state]
    plans = [plan(t, ctx.flat_state[t.key], ctx.meta, ctx.spec.runtime.piece_bytes) for t in tensors]
    try:
        for tensor, work in zip(track(tensors), plans):
            state = allocate(tensor, ctx.flat_state[tensor.key], ctx.meta)
            ctx.bytes_moved += fill(state, work, source) if receiver is None else receiver.receive(state, work)
            ctx.local_state[tensor.key] = state
            found.extend(nonfinite(tensor, state))
    except Exception:
        if receiver is not None:
            receiver.drain([batch for work in plans for batch in work])  # the sender is still sending: take it all
        raise
