"""Generate a source checkpoint: train the model under the source layout and save its optimizer state.

This is what plain ``osdpipe`` converts: with no ``input.path``, the source
world (``source.world_size`` ranks) takes a few optimizer steps with real FSDP
on synthetic gradients (:func:`osdpipe.run.live_jobs.train_step`: no forward pass,
no example input) and saves the optimizer state in the source state-dict type:
FULL as an ``fsdp_full`` file, SHARDED as a DCP directory, ``local`` as each
rank's own ``optim.state_dict()`` in a ``rank_local`` directory; an unwrapped
source (``kind=none``) saves its optimizer's own ``state_dict()`` as a
``plain`` file. With ``checkpoint=torchtitan`` or ``accelerate`` a learning-rate
scheduler steps along, and the whole job is saved as that framework saves it
(:meth:`osdpipe.io.checkpoints.base.CheckpointLayout.save`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from osdpipe.layout import kinds
from osdpipe.layout.kinds import rank_layout
from osdpipe.run import whereabouts
from osdpipe.run.live_jobs import live_target, train_step
from osdpipe.spec.plan import Plan


def generate_rank(plan: Plan) -> str:
    """Train and save on this rank of the source world; returns the checkpoint path (the plan's input path).

    It is written straight into the staged run (:func:`osdpipe.spec.plan.generated_source_path`):
    a failed run discards it whole (:mod:`osdpipe.io.output`).
    """
    whereabouts.enter("generate")
    spec, tree = plan.spec, plan.tree
    rank = dist.get_rank()
    model, optim = live_target(spec, plan.source_spec, tree, rank)
    layout = rank_layout(tree, plan.source_spec, rank)
    whole = plan.checkpoint.whole
    # a whole training job's: it steps with the optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, _decay) if whole else None
    for step in range(spec.generate.steps):  # synthetic gradients: no forward pass, so any model trains
        train_step(spec, model, optim, step, layout, tree)
        if scheduler is not None:
            scheduler.step()
    path = Path(plan.input_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if whole:
        plan.checkpoint.save(model, optim, scheduler, path, spec.generate.steps)
    else:
        kinds.get(spec.source.kind).save(model, optim, path, spec.source.state_dict_type, spec.input.key)
    dist.barrier()
    return str(path)


def _decay(step: int) -> float:
    """The generated job's learning-rate factor at ``step``: a schedule with state of its own to carry over."""
    return 1.0 / (1 + step)
