"""shard: cut this rank's piece of every target tensor out of the source, and pad it.

Each local tensor starts as zeros (the padding), then every segment of the
layout is copied from the same range of the source parameter's flattened
view. The source is read per parameter, and only the parameters this rank's
segments touch.

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
from osdpipe.formats import TensorRef
from osdpipe.layout import LocalTensor
from osdpipe.progress import track
from osdpipe.stages import stage


def materialize(tensor: LocalTensor, entry: dict[str, Any], source: dict[tuple[str, str], torch.Tensor]) -> tuple[dict[str, Any], int]:
    """Fill the state of one local tensor from full source tensors (zeros where a parameter has none).

    Returns the state and the number of bytes copied from the source.
    """
    out: dict[str, Any] = {}
    copied = 0
    for name, value in entry.items():
        if not isinstance(value, TensorRef):
            out[name] = value
            continue
        flat = torch.empty(tensor.numel, dtype=value.torch_dtype)  # every element is written once: copied, or zeroed as padding
        filled = 0
        for seg in sorted(tensor.segments, key=lambda seg: seg.dest):
            flat[filled : seg.dest].zero_()
            src = source.get((seg.fqn, name))
            if src is None:
                flat[seg.dest : seg.dest + seg.length].zero_()
            else:
                flat[seg.dest : seg.dest + seg.length] = src.reshape(-1)[seg.start : seg.start + seg.length]
                copied += seg.length * flat.element_size()
            filled = seg.dest + seg.length
        flat[filled:].zero_()
        out[name] = flat.view(tensor.shape)
    return out, copied


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


@stage("shard")
def shard(ctx: Context) -> None:
    if ctx.reader is None or ctx.meta is None:
        raise RuntimeError("the shard stage needs the load and broadcast stages before it")
    ctx.local_state = {}
    found: list[str] = []
    layout = [t for t in ctx.target_layout() if t.key in ctx.flat_state]
    for tensor in track(layout):
        entry = ctx.flat_state[tensor.key]
        wanted = [
            (seg.fqn, name)
            for seg in tensor.segments
            for name, value in entry.items()
            if isinstance(value, TensorRef) and isinstance(ctx.meta.state.get(seg.fqn, {}).get(name), TensorRef)
        ]
        ctx.local_state[tensor.key], copied = materialize(tensor, entry, ctx.reader.read(wanted))
        ctx.bytes_moved += copied
        found.extend(nonfinite(tensor, ctx.local_state[tensor.key]))
    everywhere = sorted({f for rank_found in gather_to_all(found) for f in rank_found})
    ctx.nonfinite_in_source(everywhere, here=bool(found))
