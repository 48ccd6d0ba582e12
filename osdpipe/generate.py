"""Generate a source checkpoint: train the model under the source layout and save its optimizer state.

This is what plain ``osdpipe`` converts: with no ``input.path``, the source
world (``source.world_size`` ranks) takes a few optimizer steps with real FSDP
on synthetic gradients (:func:`osdpipe.reference.train_step`: no forward pass,
no example input) and saves the optimizer state in the source state-dict type:
FULL as an ``fsdp_full`` file, SHARDED as a DCP directory, ``local`` as each
rank's own ``optim.state_dict()`` in a ``rank_local`` directory; an unwrapped
source (``kind=none``) saves its optimizer's own ``state_dict()`` as a
``plain`` file.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from osdpipe import formats, kinds, whereabouts
from osdpipe.config import RunSpec
from osdpipe.kinds import rank_layout
from osdpipe.models import build_model
from osdpipe.output import STAGING
from osdpipe.reference import live_target, train_step
from osdpipe.tree import describe

def source_path(spec: RunSpec) -> str:
    """Where the generated source checkpoint goes: ``source/`` of the staged run (:mod:`osdpipe.output`).

    It is committed with the conversion, as ``<output.path>/source/``, and
    replaced with it.
    """
    return str(Path(spec.output.path) / STAGING / "source" / formats.get(spec.source_input_format).generated_name)


def generate_rank(spec: RunSpec) -> str:
    """Train and save on this rank of the source world; returns the checkpoint path."""
    whereabouts.enter("generate")
    rank = dist.get_rank()
    tree = describe(build_model(spec.model.factory, spec.model.kwargs, device="meta"))
    model, optim = live_target(spec, spec.source.spec(), tree, rank)
    layout = rank_layout(tree, spec.source.spec(), rank)
    for step in range(spec.generate.steps):  # synthetic gradients: no forward pass, so any model trains
        train_step(spec, model, optim, step, layout, tree)
    path = Path(source_path(spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written straight into the staged run: a failed run discards it whole (osdpipe.output).
    kinds.get(spec.source.kind).save(model, optim, path, spec.source.state_dict_type, spec.input.key)
    dist.barrier()
    return str(path)

