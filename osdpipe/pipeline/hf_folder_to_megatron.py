"""A Hugging Face model folder (``checkpoint=hf``) -> a Megatron-LM save of its weights, for any TP x PP x DP.

The folder is what ``save_pretrained`` writes: ``config.json`` and ``model.safetensors`` (or the shards its
``model.safetensors.index.json`` names), a ``LlamaForCausalLM``. It holds the model alone, so the Megatron save does
too: Megatron-LM's convention for converted weights, a ``release`` save (``latest_checkpointed_iteration.txt`` says
``release``; ``release/`` holds the model's items and ``common.pt``, with ``args.no_save_optim`` and
``args.no_save_rng``). Megatron-LM's ``load_checkpoint`` loads it with no flags, at iteration 0, and starts its
optimizer, scheduler and RNG fresh (megatron/training/checkpointing.py: it loads an optimizer only where the save is
no ``release`` and ``args.no_save_optim`` is unset); the report says so.

The weights go through the map every Llama checkpoint does (:func:`osdpipe.layout.megatron_hf.from_hf`, the
vocabulary padded with zero rows to Megatron's padded size for the target's TP), in the folder's own dtype (a bf16
folder is a bf16 Megatron job's weights, bit for bit); ``args`` come from ``config.json``
(:func:`osdpipe.layout.megatron_hf.megatron_args`), ``bf16``/``fp16`` set as the weights are. What ``args`` cannot
hold of the folder (``config.json`` whole: its token ids, its dtype; ``generation_config.json``) is kept in
``common.pt`` (:func:`osdpipe.io.hf_folder.record_of`), which Megatron-LM's load ignores, so that the save converted
back to a folder is this one. The save, read back and mapped to Hugging Face's names again, must hold every tensor of
the folder bit for bit (the verify stage and ``osdpipe check``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from osdpipe.io import hf_folder
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.megatron import MegatronSave, gpt_of
from osdpipe.io.remote_input import as_path
from osdpipe.io.safetensors_out import INDEX_FILE, SINGLE_FILE
from osdpipe.layout import megatron_hf
from osdpipe.pipeline import megatron
from osdpipe.pipeline.hf_to_megatron import extra_state, into_megatron
from osdpipe.run.report import Report
from osdpipe.spec.config import RunSpec
from osdpipe.spec.megatron import HF, MegatronJob

#: What the report warns of every such conversion.
FRESH_OPTIMIZER = (
    "a Hugging Face folder holds the model's weights alone: the Megatron-LM save is a release save of the weights "
    "(no optimizer, scheduler or RNG states), which Megatron-LM's load_checkpoint loads at iteration 0 with its "
    "optimizer and learning-rate schedule started fresh"
)

#: What becomes of each file of the folder, by kind: its weights, its ``config.json``, its ``generation_config.json``,
#: the rest (a tokenizer's files).
_FATES = {
    "weights": "converted: the weights, mapped to Megatron's GPT in their own dtype, laid out for the target's TP and "
               "PP, the vocabulary padded with zero rows",
    "config": f"converted: the model's dimensions, written as common.pt's args; kept whole in common.pt's "
              f"{hf_folder.RECORD!r} for the way back (output.checkpoint=hf: its token ids, dtype and other fields)",
    "generation": f"kept: in common.pt's {hf_folder.RECORD!r}, written back by output.checkpoint=hf",
    "other": "left out: a Megatron-LM save has no place for it",
}


def refusal(spec: RunSpec) -> str | None:
    """Why the folder ``spec`` names cannot convert to its target's grid, from its ``config.json`` and file names
    alone (``None``: nothing yet): no ``config.json`` or safetensors, a model Megatron cannot express, a grid that
    does not divide it. Asked before anything is read or written."""
    path, target = as_path(spec.input.path), spec.target
    try:
        config = hf_folder.read_config(path)
        _weights_files(path)
        megatron_hf.megatron_args(config, target.tp_size, target.pp_size, target.world_size, vpp=target.vpp_size)
    except ValueError as exc:  # InputError among them
        return f"input.path={path}: {exc}"
    return None


def _weights_files(folder: Path) -> None:
    """Refuse a folder without safetensors weights (``InputError``, naming what it holds)."""
    if not hf_folder.has_weights(folder):
        held = sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        raise InputError(f"{folder} holds no {SINGLE_FILE} or {INDEX_FILE} (it holds "
                         f"{', '.join(held[:5]) or 'no file'}); save the model with "
                         "save_pretrained(safe_serialization=True)")


def read_folder(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The folder's ``config.json`` and every tensor of its safetensors files, by Hugging Face name.

    Raises:
        InputError: no ``config.json``, no safetensors files (a ``pytorch_model.bin`` folder), or a damaged one.
    """
    folder = as_path(path)
    config = hf_folder.read_config(folder)
    _weights_files(folder)  # refused in one line naming what the folder holds, not a missing model.safetensors
    return config, hf_folder.read_weights(folder)


def folder_save(path: str | Path, job: MegatronJob) -> tuple[MegatronSave, dict[str, torch.Tensor]]:
    """The Megatron save of the folder at ``path`` for ``job``'s grid, and the folder's tensors it was made of.

    Raises:
        InputError: one line: what Megatron cannot express, a TP or PP that does not divide the model, tensors
            that are not the Llama ``config.json`` describes, weights of more than one dtype.
    """
    config, weights = read_folder(path)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()})
    if len(dtypes) != 1 or dtypes[0] not in ("float32", "bfloat16", "float16"):
        raise InputError(f"{path}: weights of dtype {', '.join(dtypes)}; a Megatron GPT's are one of float32, "
                         "bfloat16 or float16: not supported yet")
    try:
        args = megatron_hf.megatron_args(config, job.tp, job.pp, job.tp * job.pp * job.dp)
        args.update(bf16=dtypes[0] == "bfloat16", fp16=dtypes[0] == "float16")
        gpt = gpt_of(args)
        model = megatron_hf.from_hf(gpt, weights, gpt.padded_vocab_size)
    except ValueError as exc:
        raise InputError(f"{path}: {exc}") from None
    save = MegatronSave(
        folder=as_path(path),
        iteration=0,
        args=args,
        sharding=None,
        model=model,
        optim={},
        param_groups=[],
        scheduler=None,
        common={"checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0,
                hf_folder.RECORD: hf_folder.record_of(path, config)},
        extra_state=extra_state(gpt.num_layers),
        release=True,
    )
    return save, weights


def folder_source(path: str | Path, job: MegatronJob) -> megatron.Source:
    """The :class:`osdpipe.pipeline.megatron.Source` of the folder at ``path``, for ``job``."""
    held: dict[str, Any] = {}

    def read() -> MegatronSave:
        held["save"], held["weights"] = folder_save(path, job)
        return held["save"]

    def problems(written: MegatronSave) -> list[str]:
        from osdpipe.verify.megatron import hf_source_problems

        save = held["save"]
        return hf_source_problems(gpt_of(save.args), int(save.args["vocab_size"]), {"weights": held["weights"]}.get,
                                  0.0, [], written)

    return megatron.Source(read, problems, lambda: entries(path), lambda: [FRESH_OPTIMIZER])


def entries(path: str | Path) -> list[dict[str, Any]]:
    """Every file of the folder (:class:`osdpipe.io.checkpoints.hf.HuggingFaceFolder`'s entries) and what became of
    it, as ``report.json`` lists a checkpoint's entries."""
    from osdpipe.io.checkpoints import get
    from osdpipe.io.checkpoints.hf import kind_of

    return [{"name": e.name, "part": e.part, "where": e.where, "size": e.size, "fate": _FATES[kind_of(e)]}
            for e in get(HF).read(as_path(path)).entries]


def run_command(spec: RunSpec, notes: list[str]) -> Report:
    """The ``osdpipe`` command's conversion of the Hugging Face folder ``spec`` names to a Megatron-LM save
    (``notes``: what the run says besides); ``report.json`` and ``osdpipe.log`` in ``output.path``, whatever happens.

    Raises:
        Contradiction: ``output.path`` holds a conversion and ``output.overwrite`` is false (exit 2).
        OutputError: ``output.path`` cannot be written.
    """
    job = MegatronJob.of(spec)
    return into_megatron(spec, job, spec.model_dump(mode="json"), folder_source(job.source, job), notes)


def check_problems(raw: dict[str, Any], folder: Path) -> list[str]:
    """What ``osdpipe check`` finds of the Megatron save ``folder`` that a conversion of ``raw`` (its manifest's
    config) wrote: the Hugging Face folder read and mapped again, held against the save read back a tensor at a time,
    bit for bit (:func:`osdpipe.verify.megatron.written_problems`)."""
    from osdpipe.verify.megatron import written_problems

    target = raw["target"]
    tp, pp = int(target["tp_size"]), int(target["pp_size"])
    job = MegatronJob(source=raw["input"]["path"], output=str(folder), tp=tp, pp=pp,
                      dp=int(target["world_size"]) // (tp * pp))
    source = folder_source(job.source, job)
    return written_problems(source.read(), folder, source.problems)
