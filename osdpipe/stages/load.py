"""load: open the source checkpoint on every rank, lazily.

Readers memory-map (``fsdp_full``) or read keys on demand (``dcp``), so opening
costs no tensor bytes; the shard stage reads only the ranges a rank needs.
"""

from __future__ import annotations

from pathlib import Path

from osdpipe.context import Context
from osdpipe.formats import open_source
from osdpipe.stages import stage


@stage("load")
def load(ctx: Context) -> None:
    if not Path(ctx.input_path).exists():
        raise FileNotFoundError(
            f"rank {ctx.rank} cannot see {ctx.input_path}; every rank reads the input itself, so put it on a filesystem all ranks share"
        )
    ctx.reader = open_source(ctx.input_format, ctx.input_path, ctx.spec.input.key)
