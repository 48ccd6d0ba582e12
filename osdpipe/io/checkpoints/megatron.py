"""Megatron-LM's layout of a whole checkpoint, as ``osdpipe inspect`` names it and ``checkpoint=megatron`` reads it.

A save folder (``latest_checkpointed_iteration.txt``, ``iter_<7 digits>/``), its iteration folder one DCP checkpoint
beside ``common.pt`` and ``metadata.json`` (:mod:`osdpipe.io.formats.megatron` reads it whole). It says every entry
with its size, the parallelism and sharding type that saved it, the model's dimensions from ``args``, and what osdpipe
cannot lay out yet.

Two conversions read it:

* to another Megatron grid or a Hugging Face folder: Megatron's own stages (:mod:`osdpipe.pipeline.megatron`);
* to a PyTorch-native framework's layout (``output.checkpoint=pytorch|accelerate|torchtitan``): the range pipeline,
  which asks this layout what every framework's answers (:meth:`optimizer_part`, :meth:`open_model`, :meth:`carried`):
  the save read as its Hugging Face model's (``LlamaForCausalLM``, ``GPT2LMHeadModel``...) or torchtitan model's state
  (:mod:`osdpipe.io.formats.megatron_source`), the model built from ``args`` (:meth:`model_from_files`),
  ``config.json`` (or torchtitan's ``model_args.json``) written beside, and common.pt's plain entries carried.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from osdpipe.io.checkpoints.base import (
    CarriedData,
    Carrying,
    CheckpointLayout,
    Entry,
    ModelNaming,
    Part,
    WholeCheckpoint,
    register,
)
from osdpipe.io.checkpoints.dcp_entries import dcp_items
from osdpipe.io.checkpoints.torchtitan import MODEL_ARGS
from osdpipe.io.errors import ModelRefused
from osdpipe.io.formats import megatron as files
from osdpipe.io.formats.base import InputError
from osdpipe.io.hf_folder import RECORD
from osdpipe.io.remote_input import as_path
from osdpipe.layout.megatron import position_embedding_type, query_groups

if TYPE_CHECKING:  # annotations only: reading imports torch
    import torch

    from osdpipe.io.formats.megatron_source import MegatronReader
    from osdpipe.io.weights import ModelMeta
    from osdpipe.layout.tree import ModuleTree


class MegatronWeights:
    """The fp32 master weights of a :class:`MegatronReader`, as a whole checkpoint's model part
    (:class:`~osdpipe.io.weights.WeightsReader`)."""

    def __init__(self, reader: MegatronReader, tree: ModuleTree) -> None:
        self.reader, self.tree = reader, tree

    def model_meta(self) -> ModelMeta:
        from osdpipe.io.formats.megatron_source import MASTER, described
        from osdpipe.io.weights import model_meta_of

        stored = {name: described(t) for name, t in self.reader.states[MASTER].items()}
        return model_meta_of(stored, {}, self.tree, str(self.reader.folder))

    def stored_name(self, name: str) -> str | None:
        from osdpipe.io.formats.megatron_source import MASTER

        return name if name in self.reader.states[MASTER] else None

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        from osdpipe.io.formats.megatron_source import MASTER

        return self.reader.read_range(name, MASTER, start, stop)


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
    input_formats: ClassVar[tuple[str, ...]] = ("megatron",)
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
        where = as_path(path)
        return str(files.iteration_folder(where)) if (where / files.LATEST).is_file() else None

    def model_naming(self, path: Path) -> ModelNaming:
        """No model to name: Megatron's ``args`` give every dimension."""
        return ModelNaming(())

    def model_from_files(self, path: str, written_as: str | None = None) -> tuple[str, dict[str, Any]]:
        """The model of the GPT ``args`` describe, as the job that resumes the output builds it: torchtitan's llama3
        or qwen3 (:func:`~osdpipe.layout.megatron_hf.titan_family`) for a torchtitan step folder (``written_as``),
        else the transformers model of its family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
        ``GPT2LMHeadModel``: :func:`~osdpipe.layout.megatron_hf.hf_config`).
        """
        from osdpipe.layout import megatron_hf

        folder = files.iteration_folder(path)
        args = files.read_common(folder)["args"]
        titan = written_as == "torchtitan"
        if why := megatron_hf.refusal(args, titan=titan):
            raise ModelRefused(f"{folder}: {why}")
        vocab = megatron_hf.true_vocab_size(args)
        if titan:
            return megatron_hf.titan_family(args).factory, megatron_hf.titan_args(args, vocab_size=vocab)
        try:
            return megatron_hf.hf_factory(args), megatron_hf.hf_config(args, vocab_size=vocab, dtype="float32")
        except ValueError as exc:  # an arg config.json needs, missing
            raise ModelRefused(f"{folder}: {exc}") from None

    def optimizer_part(self, path: str, input_format: str, written_as: str | None = None) -> Part:
        """The iteration folder, read for the model ``written_as``'s job builds: its ``key`` names that model's names
        (the reader's facts name the param groups' parameters so)."""
        from osdpipe.io.formats.megatron_source import HF_NAMES, TORCHTITAN

        naming = TORCHTITAN if written_as == "torchtitan" else HF_NAMES
        return Part(str(files.iteration_folder(path)), "megatron", naming)

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> MegatronWeights:
        """The fp32 masters from the optimizer part's own reader: the save is read, and mapped, once."""
        from osdpipe.io.formats.megatron_source import MegatronReader

        reader = optimizer if isinstance(optimizer, MegatronReader) else MegatronReader(path)
        return MegatronWeights(reader, tree)

    def carried(self, path: str, input_format: str, tree: ModuleTree) -> Carrying:
        """common.pt's plain entries (the iteration, the scheduler's state, the FLOPs so far), each leaf under its own
        name, and ``config.json`` made for Hugging Face (``model_args.json`` for a torchtitan model); the rest
        describes Megatron's own job (``args``, the RNG states of its (PP, TP) ranks, the linears' ``_extra_state``) and
        is left out, the report says so."""
        import torch
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # how dcp.save names each leaf

        from osdpipe.io.formats.megatron_source import TORCHTITAN, naming_of

        folder = files.iteration_folder(path)
        common = files.read_common(folder)
        flat, paths = flatten_state_dict(_carried_values(common))
        tensors = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in flat.items()
                   if torch.is_tensor(v)}
        titan = naming_of(tree) == TORCHTITAN
        _, config = self.model_from_files(str(folder), "torchtitan" if titan else None)
        entries = [
            e if e.part in ("model", "optimizer") else Entry(e.name, "framework", e.where, e.size, e.tensors)
            for e in self.read(folder).entries if not e.name.startswith(files.COMMON)
        ]
        entries += [Entry(f"{files.COMMON} {key}", _COMMON_PARTS.get(key, "other"), files.COMMON, len(repr(value)))
                    for key, value in common.items()]
        return Carrying(
            str(folder), tuple(flat), tuple(paths[k] for k in flat), tensors, (), tuple(entries),
            layout=self.name, step=int(common.get("iteration", 0)),
            made={MODEL_ARGS if titan else HF_CONFIG: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()},
        )

    def read_carried(self, carrying: Carrying) -> CarriedData:
        """The carried leaves' values (common.pt read inertly: plain data)."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, _ = flatten_state_dict(_carried_values(files.read_common(as_path(carrying.source))))
        return CarriedData(tensors={k: flat[k] for k in carrying.item_tensors},
                           values={k: flat[k] for k in carrying.items if k not in carrying.item_tensors})

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
        if RECORD in common:  # what osdpipe kept of the Hugging Face folder it made the save of
            entries.append(Entry(RECORDED, "other", files.COMMON, len(repr(common[RECORD]))))
        return WholeCheckpoint(self.name, str(folder), tuple(entries), notes=tuple(_notes(common, args, folder)))


_PARTS = ("model", "optimizer", "other")
#: The entry of the Hugging Face folder a save was made of (:func:`osdpipe.io.hf_folder.record_of`).
RECORDED = f"common.pt {RECORD} (the Hugging Face folder's config.json and generation_config.json it was made of)"

#: The Hugging Face model's config a PyTorch-native output gets beside it: what its ``LlamaForCausalLM`` (or
#: ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``GPT2LMHeadModel``) is built from.
HF_CONFIG = "config.json"

#: common.pt's entries that describe Megatron's own job, which a PyTorch job has no use for (``args``: an
#: ``argparse.Namespace``, read as an inert record; the optimizer's param groups: converted with it).
_MEGATRONS_OWN = ("args", "optimizer", "content_metadata", "rng_state", "checkpoint_version")
#: What each of those is to a conversion: the param groups convert with the optimizer, the rest is left out.
_COMMON_PARTS = {key: "optimizer" if key == "optimizer" else "framework" for key in _MEGATRONS_OWN}


def _carried_values(common: dict[str, Any]) -> dict[str, Any]:
    """common.pt's entries a PyTorch-native output carries: plain data of the training run (iteration, scheduler)."""
    return {k: v for k, v in common.items() if k not in _MEGATRONS_OWN}


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


def elsewhere(args: dict[str, Any], weights_only: bool = False) -> str:
    """What the GPT Megatron-LM's ``args`` describe becomes outside Megatron, in one line: the Hugging Face model that
    computes it (:func:`osdpipe.layout.megatron_hf.architecture`), and whether its torchtitan model (llama3, qwen3) can
    hold it; or what stops both. So a user sees which ``output.checkpoint`` takes the save before running one.
    ``weights_only``: the save holds no optimizer, so only the Hugging Face folder of its weights takes it (a PyTorch
    job's checkpoint is its optimizer's state)."""
    from osdpipe.layout import megatron_hf

    if why := megatron_hf.refusals(args):
        return f"outside Megatron: no Hugging Face model yet ({', '.join(why)}); convert it within Megatron"
    if weights_only:
        return (f"outside Megatron: a Hugging Face {megatron_hf.architecture(args)} folder of its weights "
                "(output.checkpoint=hf); no PyTorch job's checkpoint (accelerate, pytorch, torchtitan): those hold an "
                "optimizer's state")
    titan = megatron_hf.titan_refusals(args)
    return (f"outside Megatron: a Hugging Face {megatron_hf.architecture(args)} (output.checkpoint=hf: its weights; "
            f"accelerate|pytorch: a job's, the optimizer included); torchtitan's {megatron_hf.titan_family(args).name} "
            + (f"cannot hold it ({', '.join(titan)})" if titan else "too (output.checkpoint=torchtitan)"))


def _notes(common: dict, args: dict, folder: Path) -> list[str]:
    """What the files say of the job that saved it, and what osdpipe cannot convert yet."""
    tp, pp, dp = (args.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                        "data_parallel_size"))
    ep, vpp = args.get("expert_model_parallel_size") or 1, args.get("virtual_pipeline_model_parallel_size")
    try:
        sharding = files.optimizer_sharding(common, folder)
    except InputError as exc:
        sharding = str(exc)
    dtype = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    release = folder.name == files.RELEASE
    iteration = common.get("iteration", args.get("iteration"))
    saved = "release save (iteration 0)" if release else f"save of iteration {iteration}"
    if sharding is None:  # Megatron-LM loads such a save's weights and starts its optimizer (a release: and all) anew
        optimizer = (f"weights only ({dtype}): no optimizer state (args.no_save_optim); a job that loads it starts a "
                     "fresh optimizer" + (", scheduler and RNG" if release else ""))
    else:
        optimizer = f"distributed optimizer {sharding}; weights {dtype}, fp32 master weights and moments"
    heads, groups = args.get("num_attention_heads"), query_groups(args)
    biases = (", linear biases" if args.get("add_bias_linear")
              else ", linear_qkv bias" if args.get("add_qkv_bias") else "")  # fmt: skip
    notes = [
        f"Megatron-LM torch_dist {saved}: TP{tp} PP{pp} "
        f"DP{dp} (world {args.get('world_size')}), EP{ep}, virtual pipeline stages {vpp or 'none'}",
        optimizer,
        f"GPT: {args.get('num_layers')} layers, hidden {args.get('hidden_size')}, ffn {args.get('ffn_hidden_size')}, "
        f"{heads} heads in {groups} query groups, vocabulary padded to {args.get('padded_vocab_size')}"
        + (", SwiGLU" if args.get("swiglu") else "") + f", {args.get('normalization', 'LayerNorm')}"
        + f", {position_embedding_type(args)} positions"
        + (", untied" if args.get("untie_embeddings_and_output_weights") else ", tied embeddings") + biases
        + (", qk_layernorm" if args.get("qk_layernorm") else ""),
        elsewhere(args, weights_only=sharding is None),
    ]
    if vpp and int(vpp) > 1:  # the command's target leaves target.vpp_size at 1: no virtual stages
        notes.append(f"to keep {vpp} virtual pipeline stages per pipeline stage, add target.vpp_size={vpp} to the "
                     "command below (without it, the output has none)")
    if args.get("overlap_grad_reduce"):
        count, size = args.get("ddp_num_buckets"), args.get("ddp_bucket_size")
        cut = (f"about {count} buckets (--ddp-num-buckets)" if count is not None
               else f"buckets of {size} elements" if size is not None else "buckets of max(40M, 1M x DP) elements")
        notes.append(f"DDP with --overlap-grad-reduce: the first stage's gradient buffer in {cut}; a dp_reshardable "
                     "output is laid out in the buckets a target job run with the same options builds")
    if (why := files.refused_model(args, folder)) is not None:
        notes.append(why)
    return notes
