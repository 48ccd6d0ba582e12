"""Another framework's checkpoint written as a Megatron-LM save: what Megatron's save holds that the source does not.

A Hugging Face model's training checkpoint (the HF Trainer's, accelerate's, PyTorch's own), a torchtitan step folder
or a Hugging Face model folder is read through the map of its model to Megatron's GPT
(:meth:`osdpipe.io.checkpoints.megatron.Megatron.map_into`) and written by the Megatron layout as a save of Megatron's
own is. What only a Megatron save holds is made here, from the source's ``config.json`` and the target's grid:

* ``common.pt``'s ``args``: :func:`osdpipe.layout.megatron_hf.megatron_args` for the grid, ``iteration`` the
  source's step (a folder of weights alone: a ``release`` save at iteration 0, which Megatron-LM loads with a fresh
  optimizer);
* the param groups as Megatron's optimizer keys them (:func:`megatron_groups`): its two groups, weight decay for
  every matrix and none for the 1-D norms, each with the source's hyperparameters and Megatron's own keys;
* the scheduler (``opt_param_scheduler``, which Megatron-LM's load requires): a constant one at the source's
  learning rate and weight decay, as a transformers or torchtitan scheduler (a Python function of the step) has no
  Megatron equivalent;
* no RNG states: the source's are another framework's, so Megatron-LM's ``load_checkpoint`` needs ``--no-load-rng``;
* the linears' ``_extra_state`` items megatron-core's load asks for (:func:`extra_state`);
* the Hugging Face folder the save was made of (its ``config.json`` and ``generation_config.json``), kept in
  ``common.pt`` for the way back (:func:`osdpipe.io.hf_folder.record_of`).
"""

from __future__ import annotations

import io
from typing import Any

from osdpipe.io.formats.base import InputError
from osdpipe.io.hf_folder import CONFIG, GENERATION_CONFIG, RECORD
from osdpipe.layout.megatron import LAYERS

#: The local layer spec's linears of a decoder layer, each with an ``_extra_state`` item per layer.
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")

#: What the report says where the source has one param group for every parameter (torchtitan's default).
ONE_GROUP = (
    "the source's one param group decays every parameter, the norms too; a Megatron save holds Megatron's two groups "
    "(megatron-core _get_param_groups: wd_mult 0 for the 1-D norms), each written with the source's hyperparameters, "
    "and Megatron's scheduler sets the norms' weight decay to 0 from its first step"
)


#: What becomes of the entries of another framework's checkpoint that are neither its model nor its optimizer.
NO_PLACE = "left out: a Megatron-LM save has no place for it"
LEFT_OUT = (f"{NO_PLACE} (another framework's scheduler, RNG states, trainer state); the scheduler written is a "
            "constant one at the source's learning rate")
#: What becomes of the Hugging Face files a save keeps in ``common.pt`` (:func:`osdpipe.io.hf_folder.record_of`).
KEPT = {
    CONFIG: f"converted: the model's dimensions, written as common.pt's args; kept whole in common.pt's {RECORD!r} "
            "for the way back (output.checkpoint=hf: its token ids, dtype and other fields)",
    GENERATION_CONFIG: f"kept: in common.pt's {RECORD!r}, written back by output.checkpoint=hf",
}
#: What the report warns of a checkpoint of the weights alone (a Hugging Face folder).
FRESH = (
    "a Hugging Face folder holds the model's weights alone: the Megatron-LM save is a release save of the weights "
    "(no optimizer, scheduler or RNG states), which Megatron-LM's load_checkpoint loads at iteration 0 with its "
    "optimizer and learning-rate schedule started fresh"
)


def extra_state(layers: int) -> dict[str, bytes]:
    """The linears' ``_extra_state`` items a Megatron save holds and megatron-core's load asks for: one per linear
    and global layer, ``<key>._extra_state/shard_<layer>_<layers>``, each ``torch.save([None])`` (the local spec's
    linears' ``get_extra_state`` is ``None``, megatron-core ``tensor_parallel/layers.py``; a ShardedObject is stored
    as the list of its data, ``dist_checkpointing/strategies/torch.py`` ``_mcore_to_torch_sharded_object``)."""
    import torch

    data = io.BytesIO()
    torch.save([None], data)
    raw = data.getvalue()
    return {f"{LAYERS}{linear}._extra_state/shard_{i}_{layers}": raw for i in range(layers) for linear in LINEARS}


def megatron_groups(groups: list[dict[str, Any]], step: float, where: str) -> list[dict[str, Any]]:
    """The source's param groups (their hyperparameters; as the map gave them, by Megatron's keys) as Megatron's
    optimizer keys its two (megatron-core ``optimizer/__init__.py`` ``_get_param_groups``): the group with weight
    decay, then the one without, each with ``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``,
    ``default_config``, ``max_lr``, ``min_lr`` and ``step``; no ``params`` (a save keeps none). One group for all
    is both (the run warns: :data:`ONE_GROUP`).

    Raises:
        InputError: groups other than Megatron's two (one with weight decay, one without) or one for all.
    """
    decays = [g for g in groups if float(g.get("weight_decay", 0.0)) != 0.0]
    plain = [g for g in groups if float(g.get("weight_decay", 0.0)) == 0.0]
    if len(groups) == 1:
        decays = plain = groups
    elif not (len(decays) == 1 and len(plain) == 1):
        raise InputError(f"{where}: param groups other than Megatron's two (weight decay for every matrix, none for "
                         "the 1-D norms, as the HF Trainer groups them) or one for all: not supported yet")
    out = []
    for group, decay in ((decays[0], True), (plain[0], False)):
        hyper = {k: v for k, v in group.items() if k != "params"}
        lr = float(group["lr"])
        out.append({**hyper, "wd_mult": 1.0 if decay else 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
                    "is_decoupled_lr": False, "default_config": True, "max_lr": lr, "min_lr": lr, "step": step})
    return out


def constant_scheduler(groups: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """Megatron-LM's ``opt_param_scheduler`` state of a constant schedule at the decaying group's learning rate and
    weight decay, at ``step``."""
    lr, wd = float(groups[0]["lr"]), float(groups[0].get("weight_decay", 0.0))
    steps = max(1, step)
    return {"max_lr": lr, "lr_warmup_steps": 0, "num_steps": step, "lr_decay_style": "constant",
            "lr_decay_steps": steps, "min_lr": lr, "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant",
            "wd_incr_steps": steps}


def made_common(args: dict[str, Any], groups: list[dict[str, Any]] | None, step: int,
                record: dict[str, Any] | None) -> dict[str, Any]:
    """``common.pt`` as the source's framework would have had Megatron save it, before the target's grid is set in it
    (:func:`osdpipe.io.formats.megatron_items.target_common`): ``args``, the iteration, the scheduler (none for the
    weights alone), and the Hugging Face folder the save is made of (``record``; ``None``: none)."""
    common: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": step,
                              "num_floating_point_operations_so_far": 0}
    if groups is not None:
        common["opt_param_scheduler"] = constant_scheduler(groups, step)
    if record is not None:
        common[RECORD] = record
    return common
