"""What the command takes for a Megatron-LM save (``checkpoint=megatron``), and the rules a config for one follows.

A Megatron-LM save converts through the stage loop as every checkpoint does: its grid is a layout kind
(:mod:`osdpipe.layout.kinds.megatron`), its files a format and a checkpoint layout, and its source side is what its
files say (``common.pt``'s ``args``, settled by reconcile). So a config for one says only the target's grid
(``target.tp_size`` x ``target.pp_size`` x DP = ``target.world_size``, ``target.vpp_size`` model chunks per
pipeline stage), how the optimizer is saved
(``output.megatron_optim_format``), the paths, and how it runs (``runtime.workers``). :func:`megatron_problem` says,
in one line naming the key, what in a config does not fit that; it imports nothing heavy, so the schema pass runs it
(:meth:`osdpipe.spec.config.RunSpec._consistent`).
"""

from __future__ import annotations

from typing import Any

from osdpipe.layout.megatron import interleaving_problem  # pure: no torch

#: ``checkpoint=`` and ``target.kind=`` of a Megatron-LM save.
MEGATRON = "megatron"
#: ``output.checkpoint=`` of a Hugging Face model folder (``config.json``, safetensors), written from a Megatron save.
HF = "hf"
#: The layouts a Megatron-LM save is written in for a PyTorch job (a Hugging Face model's or torchtitan llama3's).
PYTORCH_NATIVE = ("pytorch", "accelerate", "torchtitan")
#: The layouts of a whole checkpoint that ``output.checkpoint=megatron`` converts (a Hugging Face Llama, Qwen2, Qwen3
#: or GPT-2: accelerate's, PyTorch's, veRL's; or torchtitan's llama3 of a ``model_args.json``).
FROM_HF = ("accelerate", "pytorch", "verl", "torchtitan")


def megatron_problem(spec: Any) -> str | None:
    """Why ``spec`` (a :class:`~osdpipe.spec.config.RunSpec`) is no conversion osdpipe makes of or to a Megatron-LM
    save (``None``: it is one, or none of its keys are Megatron's); one line naming the key to set."""
    layout, target, output = spec.checkpoint.layout, spec.target, spec.output
    if layout == HF and output.checkpoint != MEGATRON:
        return (
            "checkpoint=hf reads a Hugging Face model folder for Megatron-LM: set output.checkpoint=megatron (a "
            "PyTorch job loads the folder itself: transformers' from_pretrained, torchtitan's "
            "checkpoint.initial_load_in_hf)"
        )
    if output.checkpoint == MEGATRON and layout != MEGATRON:
        return to_megatron_problem(spec)
    for side in ("source", "target"):
        held = getattr(spec, side)
        for key in ("pp_size", "vpp_size", "ep_size"):
            if getattr(held, key) > 1 and held.kind != MEGATRON:
                what = "expert-parallel ranks are" if key == "ep_size" else "pipeline stages are"
                return (
                    f"{side}.{key}={getattr(held, key)}: {what} Megatron's (checkpoint=megatron "
                    f"target.kind=megatron); set {side}.{key}=1 for kind={held.kind}"
                )
    if why := interleaving_problem(target.pp_size, target.vpp_size):
        return why
    if output.dtype is not None and output.checkpoint != HF:
        return (
            f"output.dtype={output.dtype} casts a Hugging Face folder's weights (checkpoint=megatron "
            "output.checkpoint=hf); a training checkpoint keeps its masters as they are: leave output.dtype out"
        )
    if output.megatron_optim_format is not None and layout != MEGATRON:
        return (
            f"output.megatron_optim_format={output.megatron_optim_format} is how a Megatron-LM output saves its "
            "optimizer; set checkpoint=megatron, or leave it out"
        )
    if output.checkpoint == HF and layout != MEGATRON:
        return (
            f"output.checkpoint=hf writes a Megatron-LM save (checkpoint=megatron) as a Hugging Face folder; from "
            f"checkpoint={layout}: set output.model_format=safetensors, which writes model.safetensors beside the "
            "output under the model's own names (a Hugging Face model's are its Hub names; a torchtitan model's need "
            "output.model_keys=hf too)"
        )
    if target.kind == MEGATRON and layout != MEGATRON:
        return (
            f"target.kind=megatron writes a Megatron-LM save from one (checkpoint=megatron); from checkpoint={layout}: "
            "not supported yet"
        )
    if layout != MEGATRON:
        return None
    if spec.input.path is None:
        return "checkpoint=megatron converts a Megatron-LM save: give input.path (osdpipe does not train Megatron jobs)"
    if spec.input.format != MEGATRON:
        return f"input.format={spec.input.format}: a Megatron-LM save is read as input.format=megatron; leave it out"
    if output.checkpoint in PYTORCH_NATIVE:
        if target.kind == MEGATRON:
            return (
                f"output.checkpoint={output.checkpoint} writes the save for a PyTorch job: set target.kind (fsdp2, "
                "fsdp1, ddp or none) and target.world_size, the job that resumes it"
            )
        return None  # the range pipeline's rules apply (osdpipe.io.formats.megatron_source reads the save)
    if output.checkpoint == HF:  # one process's model: the recipe's Megatron target becomes it (reconcile)
        if target.kind not in (MEGATRON, "none", None) or (target.kind == "none" and target.world_size != 1):
            return (f"output.checkpoint=hf writes one process's model: leave target.kind and target.world_size out "
                    f"(not target.kind={target.kind} target.world_size={target.world_size})")
        return None  # the range pipeline's rules apply, the weights read through the map
    if target.kind != MEGATRON:
        return (
            f"checkpoint=megatron with target.kind={target.kind}: a Megatron-LM save converts to another Megatron grid "
            f"(target.kind=megatron), or for a PyTorch job with output.checkpoint={' or '.join(PYTORCH_NATIVE)}"
        )
    if target.tp_plan:
        return "target.tp_plan: Megatron's model lays out its own tensor parallelism; leave it empty"
    if output.checkpoint not in (None, HF) or output.model_format is not None:
        key = "output.checkpoint" if output.checkpoint not in (None, HF) else "output.model_format"
        return (f"{key}: a Megatron-LM save is written as Megatron's own, a Hugging Face folder (output.checkpoint=hf) "
                f"or for a PyTorch job (output.checkpoint={' or '.join(PYTORCH_NATIVE)}); drop {key}")
    if output.format != MEGATRON and output.checkpoint != HF:
        return (f"output.format={output.format}: a Megatron-LM save is its own DCP checkpoint beside common.pt; set "
                "output.format=megatron")
    if spec.runtime.mode != "offline":
        return "runtime.mode=online: a Megatron-LM save converts offline, without Megatron; set runtime.mode=offline"
    return None


def to_megatron_problem(spec: Any) -> str | None:
    """Why ``spec`` (``output.checkpoint=megatron`` from another layout) is no conversion of a Hugging Face model's
    checkpoint to a Megatron-LM save osdpipe makes (``None``: it is one); one line naming the key."""
    layout, target, output = spec.checkpoint.layout, spec.target, spec.output
    if layout not in (*FROM_HF, HF):
        return (
            f"output.checkpoint=megatron from checkpoint={layout}: not supported yet (a Hugging Face model's "
            f"checkpoint converts: checkpoint={' or '.join(FROM_HF)}, or its model folder: checkpoint=hf)"
        )
    if spec.input.path is None:
        return "output.checkpoint=megatron converts a checkpoint: give input.path (the HF Trainer's checkpoint-<N>)"
    if layout == HF and output.megatron_optim_format is not None:
        return (
            f"output.megatron_optim_format={output.megatron_optim_format}: a Hugging Face folder holds no optimizer "
            "state, so the Megatron-LM save holds the weights alone; leave it out"
        )
    for key in ("pp_size", "vpp_size"):
        if getattr(spec.source, key) > 1:
            return f"source.{key}={getattr(spec.source, key)}: pipeline stages are Megatron's; leave source.{key} out"
    if target.tp_plan:
        return "target.tp_plan: Megatron's model lays out its own tensor parallelism; leave it empty"
    if output.model_format is not None:
        return "output.model_format: a Megatron-LM save is written as Megatron's own; drop it"
    return None
