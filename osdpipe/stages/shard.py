"""shard: cut this rank's piece of every target tensor out of the source, and pad it.

Each local tensor starts as zeros (the padding), then every segment of the
layout is copied from the same range of the source parameter's flattened
view. The source is read per parameter, and only the parameters this rank's
segments touch.
"""

from __future__ import annotations

from typing import Any

import torch

from osdpipe.context import Context
from osdpipe.formats import TensorRef
from osdpipe.layout import LocalTensor
from osdpipe.progress import progress
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
        flat = torch.zeros(tensor.numel, dtype=value.torch_dtype)
        for seg in tensor.segments:
            src = source.get((seg.fqn, name))
            if src is not None:
                flat[seg.dest : seg.dest + seg.length] = src.reshape(-1)[seg.start : seg.start + seg.length]
                copied += seg.length * flat.element_size()
        out[name] = flat.view(tensor.shape)
    return out, copied


@stage("shard")
def shard(ctx: Context) -> None:
    if ctx.reader is None or ctx.meta is None:
        raise RuntimeError("the shard stage needs the load and broadcast stages before it")
    ctx.local_state = {}
    layout = [t for t in ctx.target_layout() if t.key in ctx.flat_state]
    for tensor in progress(layout, "shard", enabled=ctx.spec.runtime.progress and ctx.rank == 0):
        entry = ctx.flat_state[tensor.key]
        wanted = [
            (seg.fqn, name)
            for seg in tensor.segments
            for name, value in entry.items()
            if isinstance(value, TensorRef) and isinstance(ctx.meta.state.get(seg.fqn, {}).get(name), TensorRef)
        ]
        ctx.local_state[tensor.key], copied = materialize(tensor, entry, ctx.reader.read(wanted))
        ctx.bytes_moved += copied
