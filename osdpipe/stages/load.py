"""load: open the source checkpoint on every rank, lazily.

Readers memory-map (``fsdp_full``, ``plain``, ``rank_local``) or read stored
chunks on demand (``dcp``), so opening costs no tensor bytes; the shard stage
reads only the ranges a rank needs. With ``runtime.transfer=scatter`` only one
rank per host opens it (see :mod:`osdpipe.transfer`).
"""

from __future__ import annotations

import socket
from pathlib import Path

from osdpipe.config import RunSpec
from osdpipe.context import Context
from osdpipe import formats
from osdpipe.formats import IdGroups, open_source
from osdpipe.transfer import reading_ranks


def source_id_groups(spec: RunSpec, input_format: str) -> IdGroups:
    """The groups a param-ID keyed input's IDs follow, as FQN patterns per group (``None``: not known; see :meth:`Format.id_groups`)."""
    configured = [g.params for g in spec.optim.param_groups] or None
    return formats.get(input_format).id_groups(spec.input.param_groups, configured, generated=spec.input.path is None)


def load(ctx: Context) -> None:
    """Decide which ranks read the input (``runtime.transfer``), and open it on those."""
    seen = ctx.world.process_facts((socket.gethostname(), Path(ctx.input_path).exists()))
    ctx.reading_ranks = reading_ranks([h for h, _ in seen], [v for _, v in seen], ctx.spec.runtime.transfer, ctx.input_path)
    if not ctx.reads_itself:
        return
    spec = ctx.spec
    groups = source_id_groups(spec, ctx.input_format)
    ctx.reader = open_source(ctx.input_format, ctx.input_path, spec.input.key, tree=ctx.tree, source=spec.source.spec(), id_groups=groups)
