"""Megatron-LM's layout of a whole checkpoint, as ``osdpipe inspect`` names it and ``checkpoint=megatron`` reads it.

A save folder (``latest_checkpointed_iteration.txt``, ``iter_<7 digits>/``), its iteration folder one DCP checkpoint
beside ``common.pt`` and ``metadata.json`` (:mod:`osdpipe.io.formats.megatron` reads it whole). What this layout
says is metadata only: every entry with its size, the parallelism and sharding type that saved it, the model's
dimensions from ``args``, and what osdpipe cannot lay out yet. The conversion itself runs by Megatron's own stages
(:mod:`osdpipe.pipeline.megatron`), so the range pipeline's methods (:meth:`optimizer_part`, :meth:`open_model`, ...)
are not this layout's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import ClassVar

from osdpipe.io.checkpoints.base import CheckpointLayout, Entry, ModelNaming, WholeCheckpoint, register
from osdpipe.io.checkpoints.dcp_entries import dcp_items
from osdpipe.io.formats import megatron as files
from osdpipe.io.formats.base import InputError
from osdpipe.layout.megatron import query_groups

#: Entries by what their flat keys start with, and the part of a conversion each is.
_OPTIMIZER = re.compile(
    r"optimizer\.(state\.(\w+)\..+|distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_\(.+\)\.bucket_idx_\d+\.(\w+))"
)
_BUCKET_SIZES = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.per_bucket_numel(_unpadded)?/.*")
_GROUPS = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/.*")


@register
class Megatron(CheckpointLayout):
    """A Megatron-LM ``torch_dist`` save, as inspect and the command name it."""

    name = "megatron"
    looks_like = "a Megatron-LM save folder (latest_checkpointed_iteration.txt and iter_<N>/) or one iter_<N> folder"
    whole = True
    input_formats: ClassVar[tuple[str, ...]] = ("dcp",)
    output_formats: ClassVar[tuple[str, ...]] = ("dcp",)
    written_as = None
    saves_step = True
    needs_step = False
    target_placeholders: ClassVar[tuple[str, ...]] = ("target.tp_size=T", "target.pp_size=P")

    def recognizes(self, path: Path) -> bool:
        return path.is_dir() and files.megatron_folder(path) is not None

    def newest_in(self, path: str) -> str | None:
        """A save folder is read at the iteration its ``latest_checkpointed_iteration.txt`` names, as Megatron-LM
        resumes."""
        where = Path(path)
        return str(files.iteration_folder(where)) if (where / files.LATEST).is_file() else None

    def model_naming(self, path: Path) -> ModelNaming:
        """No model to name: Megatron's ``args`` give every dimension."""
        return ModelNaming(())

    def read(self, path: Path) -> WholeCheckpoint:
        """Every entry of the save at ``path``, the parallelism and the model its ``args`` describe, and what osdpipe
        cannot convert yet (metadata only).

        Raises:
            InputError: naming the file that is missing or damaged.
        """
        folder = files.iteration_folder(path)
        common = files.read_common(folder)
        args = common["args"]
        where = f"{folder.name}/ (DCP)"
        groups: dict[tuple[str, str], list] = defaultdict(list)
        for item in dcp_items(folder):
            flat = str(item.path[-1]) if len(item.path) == 1 else ".".join(map(str, item.path))
            groups[_entry_of(flat)].append(item)
        entries = [Entry(name, part, where, sum(i.size for i in members), sum(i.tensor for i in members))
                   for (part, name), members in sorted(groups.items(), key=lambda kv: (_PARTS.index(kv[0][0]), kv[0]))]
        entries.append(Entry("common.pt (args, iteration, scheduler)", "other", files.COMMON,
                             (folder / files.COMMON).stat().st_size))
        return WholeCheckpoint(self.name, str(folder), tuple(entries), notes=tuple(_notes(common, args, folder)))


_PARTS = ("model", "optimizer", "other")


def _entry_of(flat: str) -> tuple[str, str]:
    """``(part, entry name)`` of a DCP item of a Megatron save: the model's weights one entry, each optimizer state one,
    each (PP, TP) rank's RNG states one (the buckets' sizes are the optimizer's, laid out again for the target)."""
    if (m := _OPTIMIZER.fullmatch(flat)) is not None:
        state = m[2] or m[3]  # a fully_sharded_model_space save names the fp32 master ``fp32_param``
        return "optimizer", f"optimizer {'param' if state == 'fp32_param' else state}"
    if _GROUPS.fullmatch(flat):
        return "optimizer", "optimizer param groups"
    if _BUCKET_SIZES.fullmatch(flat):
        return "optimizer", "optimizer bucket sizes"
    if (m := files.RNG.fullmatch(flat)) is not None:
        return "other", f"rng_state (PP rank {m[1]}, TP rank {m[2]})"
    if "._extra_state/" in flat:
        return "other", "the linears' _extra_state"
    return "model", "model weights"


def _notes(common: dict, args: dict, folder: Path) -> list[str]:
    """What the files say of the job that saved it, and what osdpipe cannot convert yet."""
    tp, pp, dp = (args.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                        "data_parallel_size"))
    ep, vpp = args.get("expert_model_parallel_size") or 1, args.get("virtual_pipeline_model_parallel_size")
    try:
        sharding = files.sharding_type(common, folder)
    except InputError as exc:
        sharding = str(exc)
    dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    heads, groups = args.get("num_attention_heads"), query_groups(args)
    notes = [
        f"Megatron-LM torch_dist save of iteration {common.get('iteration', args.get('iteration'))}: TP{tp} PP{pp} "
        f"DP{dp} (world {args.get('world_size')}), EP{ep}, virtual pipeline stages {vpp or 'none'}",
        f"distributed optimizer {sharding}; weights {dtype}, fp32 master weights and moments",
        f"GPT: {args.get('num_layers')} layers, hidden {args.get('hidden_size')}, ffn {args.get('ffn_hidden_size')}, "
        f"{heads} heads in {groups} query groups, vocabulary padded to {args.get('padded_vocab_size')}"
        + (", SwiGLU" if args.get("swiglu") else "") + f", {args.get('normalization', 'LayerNorm')}",
    ]
    if (why := files.refused_model(args, folder)) is not None:
        notes.append(why)
    return notes
