"""broadcast: the first reading rank reads the source's metadata and shares it; every rank checks it against the model.

Only metadata travels (names, shapes, dtypes, scalar state, param groups);
tensor bytes travel in the shard stage, and only with ``runtime.transfer=scatter``.
NaN or Inf in scalar state (a ``step``) is found here, in tensor state where
shard reads it (see :meth:`~osdpipe.context.Context.nonfinite_in_source`).
"""

from __future__ import annotations

import math
import pickle

import torch

from osdpipe.collective import from_rank0
from osdpipe.context import Context
from osdpipe.formats import RenamedReader, SourceMeta, canonical_meta


def broadcast(ctx: Context) -> None:
    assert ctx.reader is not None or not ctx.reads_itself, "the load stage must run before broadcast"
    meta = from_rank0("broadcast", lambda: ctx.reader.meta(), src=ctx.first_reader)
    if ctx.rank == ctx.first_reader:
        ctx.bytes_sent += len(pickle.dumps(meta)) * (ctx.world_size - 1)
    ctx.meta = canonical_meta(meta, ctx.tree)
    if ctx.meta.names and ctx.reader is not None:  # the checkpoint names parameters otherwise (module., _orig_mod., an alias): read by its names
        ctx.reader = RenamedReader(ctx.reader, ctx.meta.names)
    ctx.nonfinite_in_source(nonfinite_scalars(ctx.meta))


def nonfinite_scalars(meta: SourceMeta) -> list[str]:
    """Scalar state (0-dim tensors, floats) that is NaN or Inf, as ``"<fqn> <name> = nan"``; tensors are checked in shard."""
    found = []
    for fqn, entries in meta.state.items():
        for name, value in entries.items():
            if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point():
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"{fqn} {name} = {value}")
    return found
