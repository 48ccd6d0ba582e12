"""What a directory of ``rank_<r>.pt`` shows of itself (:meth:`osdpipe.io.formats.rank_local.RankLocal.read_facts`):
each rank's own ``optim.state_dict()``.

Nothing in a user's files says what their local tensors are; the layout is
told from what they hold: FSDP2's DTensors (or the ``dtensor`` table
:func:`osdpipe.to_rank_local` writes for them), what osdpipe's own files
record (``param_layout``, ``manifest.json``), else the local shapes alone.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.io.formats.state_facts import Unit, describe_state, moments_alike, tally
from osdpipe.io.loading import PARAM_LAYOUT
from osdpipe.layout.kinds.ddp import DDP
from osdpipe.layout.kinds.fsdp1 import FSDP1
from osdpipe.layout.kinds.fsdp2 import FSDP2

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts


def describe_ranks(facts: Facts, path: Path, osds: list[dict[str, Any]], tables: list[Any]) -> None:
    """What every rank's loaded state dict (``osds``, one per file) shows,
    ``tables`` being each one's ``dtensor`` table (``None``: none)."""
    facts.world_size = len(osds)
    first = osds[0]
    state = {k: v for k, v in first["state"].items() if isinstance(v, dict)}
    describe_state(facts, state, first.get("param_groups"))
    for osd in osds:  # every rank's bytes: replicas too, as the files hold them
        tally(facts, osd["state"])
    facts.moments_alike = all(moments_alike({k: v for k, v in o["state"].items() if isinstance(v, dict)}) for o in osds)
    records = first.get(PARAM_LAYOUT) or {}
    if any(tables):  # a file of DTensors, as to_rank_local would have saved it
        facts.kind = FSDP2.name
        meshes = {tuple(e["mesh"]) for t in tables for e in t.values()}
        facts.placements = sorted(
            {f"mesh {list(e['mesh'])}: {', '.join(e['placements'])}" for t in tables for e in t.values()}
        )
        tp = {e["mesh"][-1] for t in tables for e in t.values() if (e.get("mesh_dim_names") or [None])[-1] == "tp"}
        if tp:  # a tensor-parallel job's: the plan is the job's own, which the files do not tell
            facts.notes.append(
                f"tensor parallel over tp_size={tp.pop()} (its mesh's last dimension is named tp): "
                "set source.tp_size and source.tp_plan as the job's"
            )
        elif len(meshes) == 1 and len(mesh := next(iter(meshes))) == 2:
            facts.shard_group_size = mesh[1]
    if records:  # osdpipe's own file: it says what each param ID holds
        fqns = sorted({f for osd in osds for r in (osd.get(PARAM_LAYOUT) or {}).values() for f in r["fqns"]})
        facts.fqns, facts.params = fqns, len(fqns)
        flat = [r for r in records.values() if r["key"].endswith("_flat_param")]
        if flat:
            facts.kind = facts.kind or FSDP1.name
            facts.use_orig_params = False
            facts.units = [Unit(list(r["fqns"]), sum(math.prod(s) for s in r["shapes"])) for r in flat]
        elif facts.kind is None:
            pieces = any(
                list(r["local_shape"]) != list(s)
                for osd in osds
                for r in (osd.get(PARAM_LAYOUT) or {}).values()
                for s in r["shapes"][:1]
            )
            facts.kind, facts.use_orig_params = (FSDP1.name, True) if pieces else (DDP.name, None)
    else:
        facts.params = len(state)
        if facts.kind is None:
            _kind_from_shapes(facts, osds, len(state))


def _kind_from_shapes(facts: Facts, osds: list[dict[str, Any]], per_rank: int) -> None:
    """The kind, from the local shapes alone: tensors of two or more dimensions are whole
    parameters (DDP); 1-D ones that differ across ranks are FSDP1 shards (``per_rank``
    flat parameters on each); 1-D ones alike everywhere could be either."""
    shapes = [
        {
            pid: tuple(v.shape)
            for pid, e in o["state"].items()
            if isinstance(e, dict)
            for v in e.values()
            if torch.is_tensor(v) and v.dim() > 0
        }
        for o in osds
    ]
    if any(len(s) > 1 for o in shapes for s in o.values()):
        facts.kind = DDP.name
    elif any(o != shapes[0] for o in shapes[1:]):
        facts.kind = FSDP1.name
        facts.notes.append(f"{per_rank} flat parameter(s) per rank; the files do not name the parameters they flatten")
