"""What a DCP checkpoint shows of itself (:meth:`osdpipe.io.formats.dcp.Dcp.read_facts`).

Apart from :mod:`osdpipe.io.formats.dcp`, and imported when first used, as the
reader is: ``torch.distributed.checkpoint`` takes a second to import.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.dcp_reader import DcpReader, nested_paths
from osdpipe.io.formats.safe_load import read_dcp_metadata
from osdpipe.io.formats.state_facts import describe_state

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

#: DCP's ``FileSystemWriter`` names each rank's file ``__<rank>_<n>.distcp``.
_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def dcp_optimizer_keys(metadata: Any) -> list[str]:
    """The top-level keys of a DCP checkpoint that hold an optimizer state dict
    (``state`` and ``param_groups`` under them)."""
    return sorted(
        {str(p[0]) for p in nested_paths(metadata.planner_data).values() if len(p) > 1 and p[1] == "param_groups"}
    )


def read_dcp_facts(facts: Facts, path: Path, key: str | None) -> None:
    """A DCP directory: its ``.metadata`` and its files' names; param groups and ``step`` (small items) are read."""
    metadata = read_dcp_metadata(path / ".metadata")
    keys = dcp_optimizer_keys(metadata)
    if key is None:
        if len(keys) != 1:
            held = sorted({str(p[0]) for p in metadata.planner_data.values() if p})
            raise InputError(
                f"{path}: "
                + (
                    f"several top-level keys hold optimizer state ({keys}); name one with input.key"
                    if keys
                    else f"no top-level key holds optimizer state (it holds {held})"
                )
            )
        key = keys[0]
    facts.key = key
    reader = DcpReader(str(path), key)
    meta = reader.meta()
    describe_state(facts, meta.state, meta.param_groups)
    facts.params = len(meta.state)
    facts.fqns = sorted(meta.state)
    chunks = 0
    for flat, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size) > 0 and flat.startswith(f"{key}.state."):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            facts.dtypes[dtype] = facts.dtypes.get(dtype, 0) + math.prod(md.size) * md.properties.dtype.itemsize
            chunks = max(chunks, sum(1 for c in md.chunks if math.prod(c.sizes)))
    facts.state_bytes = sum(facts.dtypes.values())
    ranks = {
        int(m.group(1)) for info in metadata.storage_data.values() if (m := _DCP_FILE.fullmatch(info.relative_path))
    }
    facts.world_size = max(ranks) + 1 if ranks else None
    facts.kind = "sharded"
    facts.notes.append(
        "dim-0 chunks, as FSDP1's SHARDED_STATE_DICT and FSDP2 both write them "
        "(byte for byte alike; a conversion needs no more)"
    )
    if facts.world_size is not None and 1 < chunks < facts.world_size and facts.world_size % chunks == 0:
        facts.shard_group_size = chunks
        facts.notes.append(
            f"{facts.world_size} ranks saved it, its tensors are cut in {chunks}: "
            f"replica groups of {chunks} ranks (HSDP, HYBRID_SHARD)"
        )
