"""``verl``: the optimizer part of a veRL FSDP checkpoint, each rank's ``optimizer.state_dict()`` in its own file.

veRL's ``FSDPCheckpointManager`` saves, on every rank of an FSDP2 job, ``torch.save(optimizer.state_dict())`` as
``optim_world_size_<W>_rank_<r>.pt``: state keyed by parameter index over ``model.parameters()``, moments as DTensor
shards of dim 0, as a ``rank_local`` directory holds them under other names. So it is read as one: the same reader
(:class:`~osdpipe.io.formats.rank_local.RankLocalReader`), the same facts (FSDP2 and its mesh from the DTensors), the
names its own (:data:`NAMING`). The whole folder, the model's files beside it, is the ``verl`` checkpoint layout's
(:mod:`osdpipe.io.checkpoints.verl`), which writes veRL's files too (as DTensors, which a ``rank_local`` file does not
hold).
"""

from __future__ import annotations

from osdpipe.io.formats.rank_local import RankFileNaming, RankLocal

#: Each rank's optimizer file, as veRL names it: the world that saved it is in the name.
NAMING = RankFileNaming("optim_world_size_{world_size}_rank_{rank}.pt")
#: Each rank's model file (``model.state_dict()`` of its FSDP2 job: DTensor shards).
MODEL_NAMING = RankFileNaming("model_world_size_{world_size}_rank_{rank}.pt")
#: Each rank's other state (the learning-rate scheduler's, the RNG states).
EXTRA_NAMING = RankFileNaming("extra_state_world_size_{world_size}_rank_{rank}.pt")


class Verl(RankLocal):
    """veRL's optimizer files: each rank's ``optimizer.state_dict()``, ``optim_world_size_<W>_rank_<r>.pt``."""

    name = "verl"
    naming = NAMING
    generated_name = "verl"
    looks_like = "a veRL FSDP checkpoint's optimizer files (optim_world_size_<W>_rank_<r>.pt)"
    found_by = "optim_world_size_<W>_rank_<r>.pt files"
