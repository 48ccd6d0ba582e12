"""load: open the source checkpoint on every rank, lazily.

Readers memory-map (``fsdp_full``) or read keys on demand (``dcp``), so opening
costs no tensor bytes; the shard stage reads only the ranges a rank needs.
"""

from __future__ import annotations

from pathlib import Path

from osdpipe.config import RunSpec
from osdpipe.context import Context
from osdpipe.formats import IdGroups, open_source
from osdpipe.stages import stage


def source_id_groups(spec: RunSpec, input_format: str) -> IdGroups:
    """The groups a param-ID keyed input's IDs follow, as FQN patterns per group (``None``: not known)."""
    groups = spec.input.param_groups
    if groups is None and input_format == "rank_local":
        groups = [g.params for g in spec.optim.param_groups] or None
    if groups is None and input_format == "plain" and spec.input.path is None:
        # A source osdpipe generated: its optimizer was built from optim.param_groups (one group over model.parameters() without).
        groups = [g.params for g in spec.optim.param_groups] or [["*"]]
    return groups


@stage("load")
def load(ctx: Context) -> None:
    if not Path(ctx.input_path).exists():
        raise FileNotFoundError(
            f"rank {ctx.rank} cannot see {ctx.input_path}; every rank reads the input itself, so put it on a filesystem all ranks share"
        )
    spec = ctx.spec
    groups = source_id_groups(spec, ctx.input_format)
    ctx.reader = open_source(ctx.input_format, ctx.input_path, spec.input.key, tree=ctx.tree, source=spec.source.spec(), id_groups=groups)
