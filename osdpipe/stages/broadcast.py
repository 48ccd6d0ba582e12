"""broadcast: rank 0 reads the source's metadata and shares it; every rank checks it against the model.

Only metadata travels (names, shapes, dtypes, scalar state, param groups);
tensor bytes never do: each rank reads its own ranges in the shard stage.
"""

from __future__ import annotations

import pickle

from osdpipe.collective import from_rank0
from osdpipe.context import Context
from osdpipe.formats import SourceMeta, TensorRef
from osdpipe.stages import stage
from osdpipe.tree import ModuleTree


def canonical_meta(meta: SourceMeta, tree: ModuleTree) -> SourceMeta:
    """Key the source state by canonical parameter FQNs and check every tensor's shape.

    Raises:
        ValueError: for state of a parameter the model does not have, or a
            tensor whose shape differs from its parameter's.
    """
    state = {}
    for fqn, entries in meta.state.items():
        if not tree.has_param(fqn):
            raise ValueError(
                f"the source has state for {fqn!r}, which model has no parameter of that name; "
                "is model.factory / model.kwargs the model that saved it?"
            )
        param = tree.param(fqn)
        for name, value in entries.items():
            if isinstance(value, TensorRef) and value.shape != param.shape:
                raise ValueError(f"source state {fqn}.{name} has shape {value.shape} but the parameter has shape {param.shape}")
        state[param.fqn] = entries
    groups = None
    if meta.param_groups is not None:
        groups = [{**g, "params": [tree.canonical(f) if tree.has_param(f) else f for f in g["params"]]} for g in meta.param_groups]
    return SourceMeta(state=state, param_groups=groups, extra=meta.extra)


@stage("broadcast")
def broadcast(ctx: Context) -> None:
    assert ctx.reader is not None, "the load stage must run before broadcast"
    meta = from_rank0("broadcast", ctx.reader.meta)
    ctx.bytes_moved += len(pickle.dumps(meta)) * (ctx.world_size - 1)
    ctx.meta = canonical_meta(meta, ctx.tree)
