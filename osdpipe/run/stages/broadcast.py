"""broadcast: the first reading rank reads the source's metadata and shares it; every rank checks it against the model.

Only metadata travels (names, shapes, dtypes, scalar state, param groups);
tensor bytes travel in the shard stage, and only with ``runtime.transfer=scatter``.
NaN or Inf in scalar state (a ``step``) is found here, in tensor state where
shard reads it (see :func:`act_on_nonfinite`).
"""

from __future__ import annotations

import math
import pickle

import torch

from osdpipe.io.formats import RenamedReader, SourceMeta, canonical_meta
from osdpipe.run.collective import from_rank0
from osdpipe.run.context import Context
from osdpipe.run.products import Described, Opened, Tally


def broadcast(ctx: Context, opened: Opened, tally: Tally) -> Described:
    assert opened.reader is not None or not opened.reads_itself(ctx.rank), "the load stage must run before broadcast"
    meta = from_rank0("broadcast", lambda: opened.reader.meta(), src=opened.first_reader)
    if ctx.rank == opened.first_reader and ctx.world.ranks_meet:  # played apart (offline), it went to no process
        tally.sent += len(pickle.dumps(meta)) * (ctx.world_size - 1)
    meta = canonical_meta(meta, ctx.tree)
    tally.warnings += meta.notes  # every rank's are the same: the report lists each warning once
    reader = opened.reader
    # the checkpoint names parameters otherwise (module., _orig_mod., an alias): read by its names
    if meta.names and reader is not None:
        reader = RenamedReader(reader, meta.names)
    act_on_nonfinite(ctx, tally, nonfinite_scalars(meta))
    return Described(reader, opened.reading_ranks, meta)


def nonfinite_scalars(meta: SourceMeta) -> list[str]:
    """Scalar state (0-dim tensors, floats) that is NaN or Inf, as ``"<fqn> <name> = nan"``;
    tensors are checked in shard."""
    found = []
    for fqn, entries in meta.state.items():
        for name, value in entries.items():
            if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point():
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"{fqn} {name} = {value}")
    return found


def act_on_nonfinite(ctx: Context, tally: Tally, found: list[str], *, here: bool = True) -> None:
    """Act on NaN or Inf found in the source (``found`` names each parameter and state).

    By default that is an error, raised where it was found (``here``; the
    other ranks learn of it when the stage's ranks agree). With
    ``input.allow_nonfinite`` it is a warning, and the state converts as it is.
    """
    if not found:
        return
    shown = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    if ctx.spec.input.allow_nonfinite:
        tally.warnings.append(
            f"the source holds NaN or Inf, converted as they are (input.allow_nonfinite=true): {shown}"
        )
    elif here:
        raise ValueError(
            f"the source holds NaN or Inf: {shown}; "
            "mend the checkpoint, or set input.allow_nonfinite=true to convert them as they are"
        )
