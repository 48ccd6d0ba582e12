"""``verl``: the optimizer part of a veRL FSDP checkpoint, each rank's ``optimizer.state_dict()`` in its own file.

veRL's ``FSDPCheckpointManager`` saves, on every rank of an FSDP2 job, ``torch.save(optimizer.state_dict())`` as
``optim_world_size_<W>_rank_<r>.pt``: state keyed by parameter index over ``model.parameters()``, moments as DTensor
shards of dim 0, as a ``rank_local`` directory holds them under other names (an FSDP1 job's, ``FSDP_version`` 1 in
``fsdp_config.json``: its flat parameters' shards, which the files' shapes alone do not tell from DDP's). So it is read
as one: the same reader (:class:`~osdpipe.io.formats.rank_local.RankLocalReader`), the same facts (FSDP2 and its mesh
from the DTensors), the names its own (:data:`NAMING`). The whole folder, the model's files beside it, is the ``verl``
checkpoint layout's (:mod:`osdpipe.io.checkpoints.verl`), which writes veRL's files too (as DTensors, which a
``rank_local`` file does not hold).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from osdpipe.io.formats.base import Shown
from osdpipe.io.formats.rank_local import RankFileNaming, RankLocal
from osdpipe.layout.kinds import find
from osdpipe.layout.kinds.fsdp1 import FSDP1

#: Each rank's optimizer file, as veRL names it: the world that saved it is in the name.
NAMING = RankFileNaming("optim_world_size_{world_size}_rank_{rank}.pt")
#: Each rank's model file (``model.state_dict()`` of its FSDP2 job: DTensor shards).
MODEL_NAMING = RankFileNaming("model_world_size_{world_size}_rank_{rank}.pt")
#: Each rank's other state (the learning-rate scheduler's, the RNG states).
EXTRA_NAMING = RankFileNaming("extra_state_world_size_{world_size}_rank_{rank}.pt")
#: Beside the rank files: ``{"FSDP_version", "world_size"}``.
FSDP_CONFIG = "fsdp_config.json"


def fsdp_version(folder: Path) -> int | None:
    """The FSDP version ``fsdp_config.json`` beside the rank files names (``None``: none there, or not veRL's; the
    checkpoint layout says what is wrong with it)."""
    try:
        return int(json.loads((folder / FSDP_CONFIG).read_bytes())["FSDP_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Verl(RankLocal):
    """veRL's optimizer files: each rank's ``optimizer.state_dict()``, ``optim_world_size_<W>_rank_<r>.pt``."""

    name = "verl"
    naming = NAMING
    generated_name = "verl"
    looks_like = "a veRL FSDP checkpoint's optimizer files (optim_world_size_<W>_rank_<r>.pt)"
    found_by = "optim_world_size_<W>_rank_<r>.pt files"

    def read_facts(self, facts: Any, path: Path, key: str | None) -> None:
        """As every rank-file input's; an FSDP1 job's files (``FSDP_version`` 1: each rank's flat parameters' shards,
        which their shapes alone do not tell from DDP's) are said to be FSDP1's."""
        super().read_facts(facts, path, key)
        if facts.kind is None and fsdp_version(path) == 1:
            facts.kind = FSDP1.name

    def shows(self, facts: Any, kind: Any) -> list[Shown]:
        """As every rank-file input's, and an FSDP1 job's kind, which ``fsdp_config.json`` names."""
        shown = super().shows(facts, kind)
        saved_by = find(facts.kind)
        if saved_by is not None and not saved_by.dtensor_state:
            shown.append(Shown("source.kind", facts.kind, f"{facts.path}/{FSDP_CONFIG} names FSDP_version 1 (veRL's "
                                                          "actor.strategy=fsdp: FSDP1, flat parameters)"))
        return shown
