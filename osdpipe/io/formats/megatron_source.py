"""A Megatron-LM save read as a PyTorch job's state: the range pipeline's source for other frameworks' layouts.

``checkpoint=megatron output.checkpoint=pytorch|accelerate|torchtitan`` converts a Megatron GPT into a Hugging Face
model's (its family's: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``GPT2LMHeadModel``) or
a torchtitan model's (llama3, or qwen3 for a GPT with head norms) training checkpoint, for FSDP2, FSDP1, DDP or one
process (``target.*``), through the same stages as every PyTorch-native conversion. What those stages need is a
:class:`~osdpipe.io.formats.base.SourceReader` of full per-parameter state keyed by the model's names; this module is
that reader:

* the save is read whole by :func:`osdpipe.io.formats.megatron.read_save` (no Megatron code runs);
* each optimizer state (the fp32 master weight, ``exp_avg``, ``exp_avg_sq``) goes through the same pure map,
  :func:`osdpipe.layout.megatron_hf.to_hf`: Adam's moments follow the weights element for element, so the map that
  is right for the weights carries the optimizer exactly (the vocabulary's padding rows, which no token reads, are
  left out of all three); for torchtitan on through :func:`osdpipe.layout.llama_titan.to_titan` (the model's names
  say which: :func:`naming_of`);
* Megatron keeps ``step`` in each param group; a PyTorch ``Adam``/``AdamW`` keeps it per parameter, so every
  parameter gets its group's ``step`` as the 0-dim float32 tensor torch's Adam holds;
* each param group keeps the optimizer's hyperparameters (``lr``, ``betas``, ``weight_decay``...), its parameters
  being the Hugging Face names its Megatron keys map to; the keys Megatron adds for its own learning-rate scheduler
  (:data:`SCHEDULERS_KEYS`) are left out, as a PyTorch job runs its own scheduler, and the report says so.

The model's weights are the fp32 masters (:class:`osdpipe.io.checkpoints.megatron.MegatronWeights`), not the
module's copy in the training dtype,
as for a DeepSpeed save: they are what the optimizer steps from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.io.formats.base import Format, IdGroups, InputError, Shown, SourceMeta, SourceReader, TensorRef
from osdpipe.io.formats.megatron import STATES, MegatronSave, gpt_of, read_save
from osdpipe.io.formats.megatron_reader import MegatronFiles, SavedState
from osdpipe.io.formats.state_facts import describe_meta
from osdpipe.layout import llama_titan, megatron_hf
from osdpipe.layout import megatron as gpt_layout
from osdpipe.layout.megatron_grid import written_tensors
from osdpipe.layout.ranges import LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

#: Megatron's name of the fp32 master weight among :data:`~osdpipe.io.formats.megatron.STATES`.
MASTER = "param"
#: The states a PyTorch Adam keeps per parameter, in the order its ``state_dict()`` lists them.
MOMENTS = ("exp_avg", "exp_avg_sq")
#: What megatron-core adds to each param group for its ``OptimizerParamScheduler`` (megatron-core 0.16.1
#: ``optimizer/__init__.py`` ``_get_param_groups``, l. 208-225), which no torch optimizer reads.
SCHEDULERS_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")


#: The models a Megatron GPT's state is read for, by what their parameters are named: the transformers model of its
#: family (:mod:`osdpipe.layout.megatron_hf`), its torchtitan model (:func:`osdpipe.layout.megatron_hf.titan_family`:
#: llama3 and qwen3 name their parameters alike), or Megatron's own GPT (its sharded keys:
#: :func:`osdpipe.layout.models.megatron_gpt`), read by ranges (:mod:`osdpipe.io.formats.megatron_reader`).
HF_NAMES, TORCHTITAN, MEGATRON_NAMES = "hf", "torchtitan", "megatron"
#: The word embedding's sharded key: a model of Megatron's own names has it.
_MEGATRON_EMBEDDING = "embedding.word_embeddings.weight"


def naming_of(tree: ModuleTree) -> str:
    """Which model's names ``tree`` (the model the conversion builds) has: a Hugging Face model's, of any family
    (:data:`HF_NAMES`), or a torchtitan model's (:data:`TORCHTITAN`).

    Raises:
        InputError: it has neither's; the message names the factories that build one.
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


class MegatronReader:
    """A Megatron GPT save as its Hugging Face model's or its torchtitan model's full per-parameter state (the module
    docstring); ``naming``: which (:func:`naming_of`).

    ``tensors=False``: the save described, not read (:func:`~osdpipe.io.formats.megatron.read_save`'s): every state
    a tensor on the meta device, mapped as the run maps it, so :meth:`meta` describes what the run will read
    without its bytes: what working out the config asks (:meth:`Megatron.read_facts`), where reading the save whole
    would read it twice.
    """

    def __init__(self, path: str, naming: str = HF_NAMES, *, tensors: bool = True) -> None:
        # the module's weights (the training dtype's copy) are not read: the masters stand in for them
        save = read_save(path, within_memory=True, weights=False, tensors=tensors)
        self.folder = save.folder
        if why := megatron_hf.refusal(save.args, titan=naming == TORCHTITAN):
            raise InputError(f"{save.folder}: {why}")
        self.gpt, self.vocab = gpt_of(save.args), megatron_hf.true_vocab_size(save.args)
        self.args, self.iteration, self.notes = save.args, save.iteration, list(save.notes)
        heads = None
        if naming == TORCHTITAN:  # the map of the model the job builds: its family, heads and tying (model_args.json)
            heads = llama_titan.heads_of(megatron_hf.titan_args(save.args, vocab_size=self.vocab))
        #: state name (``param``: the master) -> Hugging Face (or torchtitan) name -> the full tensor
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        try:
            for name in STATES:  # one state at a time, taken out of the save: its Megatron-keyed tensors go as mapped
                self.states[name] = self._mapped({k: s.pop(name) for k, s in save.optim.items()}, heads)
            names_of = megatron_hf.hf_names_of(self.gpt)
            if heads is not None:
                names_of = {key: list(dict.fromkeys(t for n in names for t in llama_titan.titan_names_of(n)))
                            for key, names in names_of.items()}
        except ValueError as exc:
            raise InputError(f"{save.folder}: {exc}") from None
        self.groups = _torch_groups(save, names_of)

    def _mapped(self, state: dict[str, torch.Tensor], heads: llama_titan.Heads | None) -> dict[str, torch.Tensor]:
        """One state of every parameter (Megatron's keys, taken from the caller), by the target model's names."""
        hf = megatron_hf.to_hf(self.gpt, state, self.vocab)
        state.clear()  # the Megatron-keyed tensors the map copied go before torchtitan's map makes its copies
        return hf if heads is None else llama_titan.to_titan(heads, hf)

    def meta(self) -> SourceMeta:
        state: dict[str, dict[str, Any]] = {}
        for group, step in self.groups:
            for name in group["params"]:
                state[name] = {"step": torch.tensor(step, dtype=torch.float32)}
                state[name].update({m: described(self.states[m][name]) for m in MOMENTS})
        return SourceMeta(state=state, param_groups=[dict(g) for g, _ in self.groups], notes=self.notes)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        return {(fqn, name): self.states[name][fqn] for fqn, name in items}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        return self.states[name][fqn].reshape(-1)[start:stop]

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        """Nothing to let go: the save is held in memory, read once."""


def as_torchs(meta: SourceMeta) -> SourceMeta:
    """A Megatron save's optimizer (read for its own GPT) as the PyTorch optimizer it steps with describes it: its
    param groups without the keys Megatron adds for its scheduler (:data:`SCHEDULERS_KEYS`) and ``step`` (kept
    per parameter), its state without the fp32 master (the parameter that optimizer steps). What tells which optimizer
    it is (:func:`osdpipe.io.formats.state_facts.describe_meta`); the conversion keeps the groups as saved."""
    groups = [{k: v for k, v in g.items() if k not in (*SCHEDULERS_KEYS, "step")} for g in meta.param_groups or []]
    state = {key: {n: v for n, v in held.items() if n != MASTER} for key, held in meta.state.items()}
    return SourceMeta(state=state, param_groups=groups, notes=meta.notes)


def described(tensor: torch.Tensor) -> TensorRef:
    """``tensor`` described without its bytes."""
    return TensorRef(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _torch_groups(save: MegatronSave, names_of: dict[str, list[str]]) -> list[tuple[dict[str, Any], float]]:
    """Each Megatron param group as a PyTorch optimizer's (the names its keys map to, ``names_of``, as ``params``;
    ``step`` taken out of the group), and the group's ``step``.

    Raises:
        InputError: a group holds no ``step`` (an optimizer that never stepped has no moments to carry).
    """
    out = []
    for group in save.param_groups:
        if "step" not in group:
            raise InputError(f"{save.folder}: a param group of the optimizer holds no step; re-copy the save folder")
        hyper = {k: v for k, v in group.items() if k not in ("params", "step", *SCHEDULERS_KEYS)}
        out.append(({**hyper, "params": [n for key in group["params"] for n in names_of[key]]}, float(group["step"])))
    return out


class Megatron(Format):
    """A Megatron-LM save folder: read as its own GPT's state, by ranges (a conversion to another Megatron grid:
    :class:`~osdpipe.io.formats.megatron_reader.SavedState`), or as a Hugging Face or torchtitan model's
    (``output.checkpoint=pytorch|accelerate|torchtitan``: :class:`MegatronReader`), the model the output's job builds
    says which (:func:`naming_of`); laid out for a Megatron target's grid (:meth:`output_layout`), whose files its
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
        return self._reader(path, key, tree, tensors=True)

    def describe(
        self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups
    ) -> SourceReader:
        """The save described: read for its own GPT, it reads nothing before it is asked; for another model's names
        (:class:`MegatronReader` with ``tensors=False``), without the tensors the run reads whole."""
        return self._reader(path, key, tree, tensors=False)

    @staticmethod
    def _reader(path: str, key: str, tree: ModuleTree, *, tensors: bool) -> SourceReader:
        try:
            naming = naming_of(tree)
        except InputError:  # what is wrong with the save itself, for the model the output's job builds, is said first
            MegatronReader(path, key if key in (HF_NAMES, TORCHTITAN) else HF_NAMES, tensors=False)
            raise
        if naming == MEGATRON_NAMES:
            return SavedState(MegatronFiles(path))
        return MegatronReader(path, naming, tensors=tensors)

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
                "vpp_size": gpt_layout.virtual_stages(args), "world_size": int(args.get("world_size") or 1)}
        out = [Shown("source.kind", MEGATRON_NAMES, f"{folder} is a Megatron-LM save")]
        out += [Shown(f"source.{k}", v, f"{said} {k.removesuffix('_size').upper()} {v}") for k, v in grid.items()]
        sharding = optimizer_sharding(common, folder)
        if sharding is not None:
            out.append(Shown("output.megatron_optim_format", DEFAULT_OUTPUT[sharding], None))
        return out

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        """The optimizer (from its param groups and states), its parameters under the names of the model ``key`` says
        (:meth:`osdpipe.io.checkpoints.megatron.Megatron.optimizer_part`: the one the output's job builds)."""
        if key == MEGATRON_NAMES:
            files = MegatronFiles(str(path))
            describe_meta(facts, as_torchs(SavedState(files).meta()))
            facts.kind, facts.world_size = MEGATRON_NAMES, int(files.args.get("world_size") or 1)
            facts.notes.append(
                f"Megatron-LM save of iteration {files.iteration} (TP{files.tp} PP{files.pp} DP{files.dp}), read as "
                f"its own GPT's state ({files.sharding or 'weights only'}): the fp32 master weights and the "
                "optimizer's per sharded key")
            return
        reader = MegatronReader(str(path), key if key in (HF_NAMES, TORCHTITAN) else HF_NAMES, tensors=False)
        describe_meta(facts, reader.meta())
        facts.world_size = 1
        a = reader.args
        model = f"torchtitan {megatron_hf.titan_family(a).name}" if key == TORCHTITAN else megatron_hf.architecture(a)
        facts.notes.append(
            f"Megatron-LM save of iteration {reader.iteration} (TP{a.get('tensor_model_parallel_size')} "
            f"PP{a.get('pipeline_model_parallel_size')} DP{a.get('data_parallel_size')}), read as "
            f"{model}'s "
            f"state: the fp32 master weights and the optimizer's per parameter"
        )
