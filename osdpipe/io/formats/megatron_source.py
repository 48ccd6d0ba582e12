"""A Megatron-LM save as a source of the range pipeline: read by ranges for its own GPT, or through a model map.

``checkpoint=megatron`` reads the save's sharded keys by ranges of its memory-mapped chunks
(:class:`~osdpipe.io.formats.megatron_reader.SavedState`), for a Megatron target of any grid. For a PyTorch job
(``output.checkpoint=pytorch|accelerate|torchtitan|hf``) the same reader is read through the map of its GPT to the
job's model (:meth:`osdpipe.io.checkpoints.megatron.Megatron.model_map`, :mod:`osdpipe.io.formats.mapped`): a
Hugging Face model of its family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``GPT2LMHeadModel``) or a torchtitan model (llama3, or qwen3 for a GPT with head norms), by ranges too:

* each optimizer state (the fp32 master weight, ``exp_avg``, ``exp_avg_sq``) goes through the same map: Adam's
  moments follow the weights element for element, so the map that is right for the weights carries the optimizer
  exactly (the vocabulary's padding rows, which no token reads, are left out of all three);
* the job's weights are the fp32 masters, not the module's copy in the training dtype (as for a DeepSpeed save: they
  are what the optimizer steps from);
* Megatron keeps ``step`` in each param group; a PyTorch ``Adam``/``AdamW`` keeps it per parameter, so every
  parameter gets its group's ``step`` as the 0-dim float32 tensor torch's Adam holds;
* each param group keeps the optimizer's hyperparameters (``lr``, ``betas``, ``weight_decay``...), its parameters
  being the names its Megatron keys map to; the keys Megatron adds for its own learning-rate scheduler
  (:data:`SCHEDULERS_KEYS`) are left out, as a PyTorch job runs its own scheduler, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io.formats.base import Format, IdGroups, InputError, Shown, SourceMeta, SourceReader
from osdpipe.io.formats.megatron import SCHEDULERS_KEYS
from osdpipe.io.formats.megatron_reader import MegatronFiles, SavedState
from osdpipe.io.formats.state_facts import describe_meta
from osdpipe.layout import llama_titan, megatron_hf
from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.megatron_grid import written_tensors
from osdpipe.layout.megatron_hf import HF_NAMES, MEGATRON_NAMES, TORCHTITAN
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

#: Megatron's name of the fp32 master weight among its optimizer's states.
MASTER = "param"
#: The word embedding's sharded key: a model of Megatron's own names has it.
_MEGATRON_EMBEDDING = "embedding.word_embeddings.weight"


def naming_of(tree: ModuleTree) -> str:
    """Which model's names ``tree`` (the model the conversion builds) has: Megatron's own GPT's, a Hugging Face
    model's of any family, or a torchtitan model's (:data:`osdpipe.layout.megatron_hf.NAMINGS`).

    Raises:
        InputError: it has none of theirs; the message names the factories that build one.
    """
    if tree.resolve(_MEGATRON_EMBEDDING) is not None:
        return MEGATRON_NAMES
    if any(tree.resolve(f.HF_EMBEDDING) is not None for f in megatron_hf.FAMILIES):
        return HF_NAMES
    if tree.resolve("tok_embeddings.weight") is not None:
        return TORCHTITAN
    factories = ", ".join([*(f"model.factory={f.HF_FACTORY}" for f in megatron_hf.FAMILIES),
                           *(f"model.factory={factory}" for factory in llama_titan.FAMILIES)])
    raise InputError(f"a Megatron GPT converts into {factories} (leave "
                     "model.factory out: the save's args build it), not a model of other names")


def as_torchs(meta: SourceMeta) -> SourceMeta:
    """A Megatron save's optimizer (read for its own GPT) as the PyTorch optimizer it steps with describes it: its
    param groups without the keys Megatron adds for its scheduler (:data:`SCHEDULERS_KEYS`) and ``step`` (kept
    per parameter), its state without the fp32 master (the parameter that optimizer steps). What tells which optimizer
    it is (:func:`osdpipe.io.formats.state_facts.describe_meta`); the conversion keeps the groups as saved."""
    groups = [{k: v for k, v in g.items() if k not in (*SCHEDULERS_KEYS, "step")} for g in meta.param_groups or []]
    state = {key: {n: v for n, v in held.items() if n != MASTER} for key, held in meta.state.items()}
    return SourceMeta(state=state, param_groups=groups, notes=meta.notes)


class Megatron(Format):
    """A Megatron-LM save folder: read as its own GPT's state, by ranges
    (:class:`~osdpipe.io.formats.megatron_reader.SavedState`; a PyTorch job's model reads it through a map:
    :mod:`osdpipe.io.formats.mapped`); laid out for a Megatron target's grid (:meth:`output_layout`), whose files its
    checkpoint layout writes (:mod:`osdpipe.io.checkpoints.megatron`)."""

    name = "megatron"
    keyed_by_id = False
    directory = True
    generated_name = "iter_0000000"
    looks_like = "a Megatron-LM save (latest_checkpointed_iteration.txt and iter_<N>/ with common.pt)"
    made_as_written = True

    def output_path(self, directory: Path, rank: int) -> Path:
        """Every rank's job loads the save folder itself (``latest_checkpointed_iteration.txt`` and ``iter_<N>/``)."""
        return directory

    def output_layout(
        self, tree: ModuleTree, target: LayoutSpec, rank: int, optimizer_layout: Callable[[], tuple[LocalTensor, ...]]
    ) -> tuple[LocalTensor, ...]:
        """What target rank ``rank`` writes of the save: its model boxes and its slices of the distributed optimizer's
        buckets (:func:`osdpipe.layout.megatron_grid.written_tensors`)."""
        if target.grid is None:
            raise ValueError(f"output.format={self.name} is written for a Megatron grid: set target.kind=megatron")
        return written_tensors(target.grid, {p.fqn: p.shape for p in tree.params}, rank)

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        """The save's optimizer by its sharded keys (``key`` names the model the conversion reads it as: a map over
        this reader gives that model's names, :meth:`osdpipe.io.checkpoints.megatron.Megatron.model_map`)."""
        return SavedState(MegatronFiles(path))

    def found_in(self, directory: Path) -> bool:
        from osdpipe.io.formats.megatron import megatron_folder

        return megatron_folder(directory) is not None

    def shows(self, facts: Facts, kind: Any) -> list[Shown]:
        """Read for its own GPT, the grid its ``args`` say saved it (``source.kind=megatron``, TP, PP, virtual stages,
        world) and the sharding type a converted save keeps unless told; for another model's names, one process: the
        reader gives every parameter's state whole, whatever grid saved it."""
        if facts.kind != MEGATRON_NAMES:
            return [Shown("source.kind", "none", None), Shown("source.world_size", 1, None)]
        from osdpipe.io.formats.megatron import DEFAULT_OUTPUT, iteration_folder, optimizer_sharding, read_common

        folder = iteration_folder(facts.path)
        common = read_common(folder)
        args, said = common["args"], f"{folder / 'common.pt'}'s args say"
        grid = {"tp_size": int(args.get("tensor_model_parallel_size") or 1),
                "pp_size": int(args.get("pipeline_model_parallel_size") or 1),
                "vpp_size": gpt_layout.virtual_stages(args),
                "ep_size": int(args.get("expert_model_parallel_size") or 1),
                "world_size": int(args.get("world_size") or 1)}
        out = [Shown("source.kind", MEGATRON_NAMES, f"{folder} is a Megatron-LM save")]
        out += [Shown(f"source.{k}", v, f"{said} {k.removesuffix('_size').upper()} {v}") for k, v in grid.items()]
        sharding = optimizer_sharding(common, folder)
        if sharding is not None:
            out.append(Shown("output.megatron_optim_format", DEFAULT_OUTPUT[sharding], None))
        return out

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        """The optimizer (from its param groups and states), its parameters under the names of the model ``key`` says
        (:meth:`osdpipe.io.checkpoints.megatron.Megatron.optimizer_part`: the one the output's job builds)."""
        files = MegatronFiles(str(path))
        grid = f"TP{files.tp} PP{files.pp} DP{files.dp}"
        if key in (None, MEGATRON_NAMES):
            describe_meta(facts, as_torchs(SavedState(files, compared=False).meta()))
            facts.kind, facts.world_size = MEGATRON_NAMES, int(files.args.get("world_size") or 1)
            facts.notes.append(
                f"Megatron-LM save of iteration {files.iteration} ({grid}), read as its own GPT's state "
                f"({files.sharding or 'weights only'}): the fp32 master weights and the optimizer's per sharded key")
            return
        from osdpipe.io.formats.megatron_maps import read_as

        describe_meta(facts, read_as(str(path), key, SavedState(files, compared=False), optimizer_only=True).meta())
        facts.world_size = 1
        a = files.args
        model = f"torchtitan {megatron_hf.titan_family(a).name}" if key == TORCHTITAN else megatron_hf.architecture(a)
        facts.notes.append(f"Megatron-LM save of iteration {files.iteration} ({grid}), read as {model}'s state: the "
                           "fp32 master weights and the optimizer's per parameter")
