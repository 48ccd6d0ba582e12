"""Generate a source checkpoint: train the model under the source layout and save its optimizer state.

This is what plain ``osdpipe`` converts: with no ``input.path``, the source
world (``source.world_size`` ranks) trains a few steps with real FSDP and saves
the optimizer state in the source state-dict type: FULL as an ``fsdp_full``
file, SHARDED as a DCP directory, ``local`` as each rank's own
``optim.state_dict()`` in a ``rank_local`` directory; an unwrapped source
(``kind=none``) saves its optimizer's own ``state_dict()`` as a ``plain`` file.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from osdpipe.config import RunSpec
from osdpipe.models import build_model
from osdpipe.reference import full_optim_config, live_target, train_step
from osdpipe.tree import describe


def source_path(spec: RunSpec) -> str:
    """Where the generated source checkpoint goes: ``<output.path>/source/``."""
    if spec.source.kind == "none" or spec.source.state_dict_type == "full":
        name = "optim.pt"
    else:
        name = "dcp" if spec.source.state_dict_type == "sharded" else "rank_local"
    return str(Path(spec.output.path) / "source" / name)


def generate_rank(spec: RunSpec) -> str:
    """Train and save on this rank of the source world; returns the checkpoint path."""
    from torch.distributed.fsdp import (
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    tree = describe(build_model(spec.model.factory, spec.model.kwargs, device="meta"))
    model, optim = live_target(spec, spec.source.spec(), tree, rank)
    for step in range(spec.generate.steps):
        train_step(spec, model, optim, step)
    path = Path(source_path(spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec.source.kind == "none":  # an unwrapped model: its optimizer's own, param-ID keyed state
            if rank == 0:
                tmp = path.with_suffix(".tmp")
                torch.save(optim.state_dict(), tmp)
                os.replace(tmp, path)
        elif spec.source.state_dict_type == "local":  # each rank's own state, param-ID keyed, local shards
            path.mkdir(exist_ok=True)
            if rank == 0:  # a previous, larger source world's files would read as a mismatched world size
                for stale in path.glob("rank_*.pt"):
                    if stale.stem.removeprefix("rank_").isdigit() and int(stale.stem.removeprefix("rank_")) >= spec.source.world_size:
                        stale.unlink()
            tmp = path / f".rank_{rank}.pt.tmp"
            torch.save(optim.state_dict(), tmp)
            os.replace(tmp, path / f"rank_{rank}.pt")
        elif spec.source.state_dict_type == "full":
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), full_optim_config(rank0_only=True)):
                osd = FSDP.optim_state_dict(model, optim)
            if rank == 0:
                tmp = path.with_suffix(".tmp")
                torch.save(osd, tmp)
                os.replace(tmp, path)
        else:
            import torch.distributed.checkpoint as dcp

            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()):
                osd = FSDP.optim_state_dict(model, optim)
            dcp.save({spec.input.key: osd}, checkpoint_id=str(path))
    dist.barrier()
    return str(path)

