"""torchtitan: one DCP directory per step, from one ``dcp.save`` of the whole training state.

The model's state dict sits at the top level, one entry per parameter or
buffer FQN (v0.1 and earlier nested it under ``model``); ``optimizer`` is
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
(``state.<fqn>.<name>``, ``param_groups.<fqn>.<hyperparameter>``);
``lr_scheduler``, ``dataloader`` (``dp_rank_<r>`` per data-parallel rank,
and ``world_size``) and ``train_state`` are torchtitan's own; any other
top-level entry is the user's.

A conversion reads the model and the optimizer through the same stages as
any checkpoint, and carries every other item over as it is stored: the
``dcp`` output is one DCP directory laid out as torchtitan saves it (the
model where the input had it, ``optimizer`` flattened), which torchtitan's
``dcp.load`` of the same structure reads on the target world.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io.checkpoints.base import (
    CarriedData,
    Carrying,
    CheckpointLayout,
    Entry,
    ModelNaming,
    NamedModel,
    Part,
    WholeCheckpoint,
    register,
)
from osdpipe.io.checkpoints.dcp_entries import carried_items, dcp_items, is_dcp
from osdpipe.io.remote_input import as_path

if TYPE_CHECKING:  # annotations only: reading and writing import torch
    from osdpipe.io.formats.base import Format, RankFiles
    from osdpipe.layout.ranges import LayoutSpec
    from osdpipe.layout.tree import ModuleTree

#: The top-level keys torchtitan itself saves besides the model.
OPTIMIZER, OWN = "optimizer", ("lr_scheduler", "dataloader", "train_state")
#: ``model.factory`` of torchtitan's own models, of its registry (:func:`osdpipe.layout.models.torchtitan_model`).
TORCHTITAN_FACTORY = "torchtitan"

_DP_RANK = re.compile(r"dp_rank_(\d+)")
_ORDER = {"model": 0, "optimizer": 1, "other": 2}


def _part(name: str) -> str:
    return "model" if name.startswith("model.") else "optimizer" if name == OPTIMIZER else "other"


def _flat_state_keys(items: list) -> list[tuple[str, str, str]]:
    """A flattened optimizer entry's ``state.<fqn>.<name>`` keys as ``(fqn, ".", name)``: the state name is the last
    part (FQNs have dots, state names do not)."""
    return [
        str(i.path[1]).removeprefix("state.").rpartition(".")
        for i in items
        if i.path[0] == OPTIMIZER and str(i.path[1]).startswith("state.")
    ]


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _flat_optimizer(items: list) -> str:
    """What a flattened optimizer entry holds, in a few words."""
    state = _flat_state_keys(items)
    names = sorted({name for _, _, name in state})
    return (
        f"optimizer flattened (flatten_optimizer_state_dict=True): state {', '.join(names)} "
        f"for {len({fqn for fqn, _, _ in state})} parameter(s)"
    )


@register
class Torchtitan(CheckpointLayout):
    """torchtitan's layout, read and written; written from another framework's
    checkpoint too (``output.checkpoint=torchtitan``) where its files say the step
    it was saved at (DeepSpeed's), as torchtitan names its step folders after it."""

    name = "torchtitan"
    one_dcp = True
    looks_like = (
        "a torchtitan step directory "
        "(one DCP checkpoint: the model's entries, optimizer, lr_scheduler, dataloader, train_state)"
    )
    saves_step = True
    needs_step = True
    made_as_written = True
    gpt_names = "torchtitan"

    def recognizes(self, path: Path) -> bool:
        """A DCP directory with a flattened ``optimizer`` or one of torchtitan's own
        top-level keys; or a ``step-<N>`` one of top-level tensors alone: a model-only
        save (``--checkpoint.last-save-model-only``, the seed checkpoint)."""
        if not is_dcp(path):
            return False
        items = dcp_items(path)
        tops = {i.path[0] for i in items}
        flat_optimizer = any(
            i.path[0] == OPTIMIZER and len(i.path) == 2 and str(i.path[1]).startswith("state.") for i in items
        )
        model_only = STEP_FOLDER.fullmatch(path.name) is not None and all(i.tensor and len(i.path) == 1 for i in items)
        return flat_optimizer or bool(tops & set(OWN)) or model_only

    def advice(self, path: str, target: dict[str, Any], output_format: str) -> list[str]:
        """torchtitan keeps its data loader's position per data-parallel rank and loads it only on the same dp degree
        (torchtitan 0.3: a larger degree misses a key, a smaller one fails its assertion); on another,
        ``--checkpoint.exclude-from-loading dataloader`` loads the rest."""
        target_dp = (target.get("world_size") or 1) // (target.get("tp_size") or 1)
        source_dp = sum(1 for e in self.read(as_path(path)).entries if e.name.startswith("dataloader.dp_rank_"))
        if source_dp in (0, target_dp):
            return []
        fails = (f'"Missing key in checkpoint state_dict: dataloader.dp_rank_{source_dp}"' if target_dp > source_dp
                 else '"dp_degree is inconsistent before and after checkpoint"')
        return [
            f"{path} holds torchtitan's data-loader positions for {source_dp} data-parallel rank(s), "
            f"the target has {target_dp}: they are carried "
            f"as they are, and torchtitan refuses to load them on another dp degree ({fails}); start it with "
            "--checkpoint.exclude-from-loading dataloader (its data loader then starts afresh)"
        ]

    def foreign_advice(self, source: str, target: dict[str, Any]) -> list[str]:
        """A step folder written from another framework's checkpoint holds the model
        and the optimizer, none of torchtitan's own entries: torchtitan 0.3 loads it
        only with those left out of loading, and then counts its steps from 0."""
        return [
            f"the {source} checkpoint has none of torchtitan's own dataloader, lr_scheduler and train_state "
            f"(its own entries are carried under '{source}', which torchtitan does not read): "
            "start torchtitan with --checkpoint.exclude-from-loading dataloader,lr_scheduler,train_state; "
            "it then loads the model and the optimizer, and its step counter and learning-rate schedule start from 0"
        ]

    def model_naming(self, path: Path) -> ModelNaming:
        """torchtitan's own model whose ``state_dict()`` has the step folder's model names and
        shapes (where torchtitan is installed), and whose parameters are the ones the optimizer
        holds state for: a model of the user's own with the same state dict (llama3 with
        ``fuse_qkv=False`` saves ``wq``, ``wk``, ``wv`` as the fused one does) is not it."""
        from osdpipe.layout.models import torchtitan_model_of  # imports torchtitan: only where a command is suggested

        items = dcp_items(path)
        nested = model_key(i.path for i in items) is not None
        shapes = {
            str(i.path[-1]): i.shape
            for i in items
            if i.tensor and (len(i.path) == 2 and i.path[0] == NESTED_MODEL if nested else len(i.path) == 1)
        }
        found = torchtitan_model_of(shapes)
        if found is None:
            return ModelNaming.users_own()
        name, flavor, parameters = found
        optimized = {fqn for fqn, _, _ in _flat_state_keys(items)}
        if optimized and optimized != parameters:
            model = f"torchtitan's {name} {flavor}"
            unknown, stateless = sorted(optimized - parameters), sorted(parameters - optimized)
            differ = (f"its optimizer holds state for parameters {model} does not have ({_few(unknown)})" if unknown
                      else f"{model} has parameters its optimizer holds no state for ({_few(stateless)})")
            return ModelNaming.users_own(
                f"the model's state dict is {model}'s, but {differ}: give model.factory, the function that builds the "
                "model that saved it"
            )
        return ModelNaming((f"checkpoint.model={name}", f"checkpoint.flavor={flavor}"))

    def read(self, path: Path) -> WholeCheckpoint:
        items = dcp_items(path)
        where = f"{path.name}/ (DCP)"
        nested = model_key(i.path for i in items) is not None
        groups: dict[str, list] = defaultdict(list)
        for item in items:
            top = str(item.path[0])
            # each data-parallel rank's position, and the world that saved them
            if top == "dataloader" and len(item.path) > 1:
                groups[f"dataloader.{item.path[1]}"].append(item)
            elif (nested and top == NESTED_MODEL) or (
                not nested and item.tensor and len(item.path) == 1 and top not in (OPTIMIZER, *OWN)
            ):
                groups[f"{_MODEL_ENTRY}{item.path[-1]}" if nested else f"{_MODEL_ENTRY}{top}"].append(item)
            else:
                groups[top].append(item)
        entries = []
        for name, members in sorted(groups.items(), key=lambda kv: (_ORDER[_part(kv[0])], kv[0])):
            part = _part(name)
            rank = _DP_RANK.fullmatch(name.partition(".")[2])
            entries.append(Entry(name, part, where, sum(i.size for i in members), sum(i.tensor for i in members),
                                 int(rank[1]) if name.startswith("dataloader.") and rank else None))
        flat = any(i.path[0] == OPTIMIZER and len(i.path) == 2 for i in items)
        notes = ["the model's entries are nested under 'model' (torchtitan v0.1 and earlier)"] if nested else []
        if OPTIMIZER not in groups:
            notes.append(
                "model only: no optimizer state (torchtitan's last save by default, or its seed checkpoint); "
                "it converts to a model-only step"
            )
        if flat:
            notes.append(_flat_optimizer(items))
        return WholeCheckpoint(
            self.name,
            str(path),
            tuple(entries),
            str(path) if OPTIMIZER in groups else None,
            OPTIMIZER if OPTIMIZER in groups else None,
            "flat" if flat else "nested",
            tuple(notes),
        )

    # ------------------------------------------------------------------ conversion

    def generated_name(self, steps: int) -> str:
        return f"step-{steps}"

    def refuses_source_kind(self, kind: Any) -> str | None:
        if kind.dtensor_state:
            return None
        return (
            "checkpoint=torchtitan: osdpipe trains the source as torchtitan does, with FSDP2; "
            "set source.kind=fsdp2 (or give input.path)"
        )

    def save(self, model: Any, optim: Any, scheduler: Any, path: Path, steps: int) -> None:
        """One ``dcp.save`` of the model's state dict at the top level,
        the optimizer flattened, and torchtitan's own entries.

        The model's entries are its own ``model.state_dict()``, hooks and all,
        as torchtitan's ``ModelWrapper`` takes them (PyTorch's
        ``get_model_state_dict`` refuses keys a hook makes, such as the
        ``wq`` of a fused ``wqkv``).

        ``dataloader`` holds each data-parallel rank's position (bytes, as
        torchtitan pickles its data loader's state; here a small JSON) and
        the world size, ``train_state`` the step and tokens seen.
        """
        import json

        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp  # DCP: only where a checkpoint is saved
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        rank, world = dist.get_rank(), dist.get_world_size()
        state: dict[str, Any] = dict(model.state_dict())
        state[OPTIMIZER] = get_optimizer_state_dict(
            model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
        state["lr_scheduler"] = scheduler.state_dict()
        state["dataloader"] = {
            f"dp_rank_{rank}": json.dumps({"sample_index": steps * 8 + rank}).encode(), "world_size": world
        }
        state["train_state"] = {"step": steps, "ntokens_seen": steps * 4096}
        dcp.save(state, checkpoint_id=str(path))

    def model_from_files(
        self, path: str, written_in: CheckpointLayout | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """torchtitan's llama3 or qwen3 of the ``model_args.json`` beside the checkpoint folder (or in it), which
        osdpipe writes with a Megatron GPT converted for torchtitan (the keywords of ``osdpipe.layout.models``'
        ``torchtitan_llama3`` or ``torchtitan_qwen3``: :func:`osdpipe.layout.llama_titan.family_of` says which);
        ``None`` without one: a job of torchtitan's registry is named by ``checkpoint.model`` and
        ``checkpoint.flavor``."""
        import json

        from osdpipe.layout.llama_titan import family_of

        for folder in (as_path(path), as_path(path).parent):
            if (folder / MODEL_ARGS).is_file():
                try:
                    args = dict(json.loads((folder / MODEL_ARGS).read_text()))
                except ValueError:
                    return None  # not osdpipe's: the user names the model
                return family_of(args).factory, args
        return None

    def gpt_config(self, path: str, named: NamedModel | None = None) -> dict[str, Any] | None:
        """The Hugging Face ``config.json`` of the llama3 or qwen3 the command names (``named``: torchtitan's own of
        its registry, :meth:`named_by`), else of the ``model_args.json`` beside the checkpoint
        (:func:`osdpipe.layout.llama_titan.hf_config`: the transformers model it computes the function of); ``None``
        without either.

        Raises:
            InputError: a model of torchtitan's registry that osdpipe does not map to a Hugging Face one.
        """
        from osdpipe.io.formats.base import InputError  # torch: only where a checkpoint is read
        from osdpipe.layout import llama_titan
        from osdpipe.layout.models import torchtitan_flavor_args

        if named is not None:
            try:
                return llama_titan.hf_config(torchtitan_flavor_args(**named[1]))
            except ValueError as exc:
                raise InputError(f"{path}: torchtitan's {named[1]}: {exc}") from None
        files = self.model_from_files(path)
        return None if files is None else llama_titan.hf_config(files[1])

    def named_by(self, checkpoint: Mapping[str, Any]) -> NamedModel | None:
        """torchtitan's own model of its registry that ``checkpoint.model`` and ``checkpoint.flavor`` name."""
        if checkpoint.get("model") is None or checkpoint.get("flavor") is None:
            return None
        return TORCHTITAN_FACTORY, {"name": checkpoint["model"], "flavor": checkpoint["flavor"]}

    def naming_of(self, model: Mapping[str, Any]) -> dict[str, Any] | None:
        """``checkpoint.model`` and ``checkpoint.flavor`` of a ``model=torchtitan`` section (its ``name`` and
        ``flavor``)."""
        if model.get("factory") != TORCHTITAN_FACTORY:
            return None
        kwargs = model.get("kwargs") or {}
        return {
            "checkpoint.model": kwargs.get("name", "llama3"),
            "checkpoint.flavor": kwargs.get("flavor", "debugmodel"),
        }

    def newest_in(self, path: str) -> str | None:
        """torchtitan's ``--checkpoint.folder``:
        the ``step-<N>`` folder with the highest N that holds a ``.metadata``, as torchtitan resumes."""
        if is_dcp(as_path(path)):
            return None
        steps = [
            (int(m[1]), p)
            for p in as_path(path).iterdir()
            if (m := STEP_FOLDER.fullmatch(p.name)) and (p / ".metadata").is_file()
        ]
        return str(max(steps)[1]) if steps else None

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part | None:
        """The flattened ``optimizer`` entry;
        none in a model-only save (``--checkpoint.last-save-model-only``, the seed checkpoint)."""
        return Part(path, "dcp", OPTIMIZER) if any(i.path[0] == OPTIMIZER for i in dcp_items(as_path(path))) else None

    def _model(self, path: str, tree: ModuleTree) -> Any:
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.checkpoints.dcp_weights import DcpWeights
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint

        checkpoint = DcpCheckpoint(as_path(path), None)
        return DcpWeights(checkpoint, model_key(checkpoint.paths.values()), tree)

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        return self._model(path, tree)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """Every item that is neither the model's nor the optimizer's: torchtitan's own entries and the user's."""
        model = self._model(path, tree)
        checkpoint = model.checkpoint
        items, planned, tensors = carried_items(checkpoint, set(model.items.values()), (OPTIMIZER,))
        entries = _with_the_models_names(self.read(as_path(path)).entries, model.items)
        has_optimizer = any(p[0] == OPTIMIZER for p in checkpoint.paths.values())
        step = self.step_of(checkpoint, path)
        return Carrying(
            path,
            items,
            planned,
            tensors,
            (),
            entries,
            model.key,
            step_folder(step),
            has_optimizer,
            layout=self.name,
            step=step,
        )

    def step_of(self, checkpoint: Any, path: str) -> int:
        """The step a step folder was saved at: its name's ``step-<N>``, else its ``train_state.step``.

        Raises:
            InputError: neither says (name the folder ``step-<N>``).
        """
        named = STEP_FOLDER.fullmatch(as_path(path).name)
        if named:
            return int(named[1])
        flat = next((f for f, p in checkpoint.paths.items() if tuple(p) == ("train_state", "step")), None)
        if flat is not None:
            return int(checkpoint.read_item(flat))
        from osdpipe.io.formats.base import InputError  # torch: only where a checkpoint is read

        raise InputError(
            f"{path}: neither its name (step-<N>) nor a train_state.step says which step it was saved at; "
            "rename it step-<N>"
        )

    def read_carried(self, carrying: Carrying) -> CarriedData:
        """Each carried item's stored bytes (a tensor item's value), read from the step folder."""
        # torch.distributed.checkpoint: only where a whole checkpoint is read
        from osdpipe.io.checkpoints.output import read_carried
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint

        return read_carried(DcpCheckpoint(as_path(carrying.source), None), carrying)

    def adopt(self, carrying: Carrying) -> Carrying:
        """Another framework's checkpoint as a torchtitan step folder: the model at the top level, in ``step-<N>`` of
        the step the source was saved at, the source's own entries under its framework's name (:attr:`Carrying.under`).
        A torchtitan checkpoint stays as it is.

        Raises:
            InputError: the source's files do not say at which step it was saved.
        """
        if carrying.layout == self.name:
            return carrying
        if carrying.step is None:
            from osdpipe.io.formats.base import InputError  # torch: only where a conversion is written

            raise InputError(
                f"{carrying.source}: its files do not say at which step it was saved, "
                "which names torchtitan's step-<N>; set output.checkpoint=pytorch"
            )
        return replace(carrying, model_key=None, folder=step_folder(carrying.step), under=carrying.layout)

    def write(
        self,
        parts: Any,
        staging: Path,
        rank: int,
        *,
        world_size: int,
        tree: ModuleTree,
        shared: dict[str, Any],
        fmt: Format,
        target: LayoutSpec | None = None,
        output_config: Any = None,
    ) -> RankFiles:
        """A rank file (``rank_local``), or this rank's pieces of one
        DCP directory laid out as torchtitan saves it (``dcp``)."""
        # torch.distributed.checkpoint: only where a whole checkpoint is written
        from osdpipe.io.checkpoints import output
        from osdpipe.io.formats.base import RankFiles

        if fmt.keyed_by_id:  # each rank's own file
            return output.write_rank_file(parts, staging, rank, tree)
        key = parts.carrying.model_key

        def state_of(r: int, local: bool) -> dict[str, Any]:
            mine = local and r == rank
            model = output.model_pieces(parts if mine else None, tree, world_size, r)
            state: dict[str, Any] = {key: model} if key is not None else dict(model)
            if parts.carrying.optimizer:  # a model-only checkpoint stays one
                state[OPTIMIZER] = output.flattened(
                    output.dcp_writer.rank_state(parts.optimizer, tree, world_size, r, local=mine)
                )
            if r == 0:  # carried items are kept by one rank, as dcp.save keeps a replicated item once
                state.update(output.carried_state(parts.carrying, parts.carried if mine else None))
            return state

        folder = parts.carrying.folder
        results, files, storages = output.write_dcp(staging, folder, state_of, rank, world_size, shared)
        where = next(iter(files), folder)
        # taken as they were written
        tensors = {
            **output.optimizer_digests(parts.optimizer, where, storages),
            **output.model_digests(output.model_pieces(parts, tree, world_size, rank), where, storages),
        }
        return RankFiles(files, tensors, results)

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[RankFiles], fmt: Format, carrying: Carrying,
        target: LayoutSpec | None = None,
    ) -> dict[str, str]:
        """The step folder's ``.metadata`` (``dcp``), and the files the source carries, where it has any, beside it."""
        # torch.distributed.checkpoint: only where a whole checkpoint is written
        from osdpipe.io.checkpoints import output

        done = (
            {}
            if fmt.keyed_by_id
            else output.finish_dcp(staging, carrying.folder, shared, [r.results for r in per_rank])
        )
        return {**done, **output.copy_files(carrying, staging)}

    def load_output(self, model: Any, optim: Any, directory: Path, rank: int, fmt: Format) -> None:
        """As torchtitan loads a step folder: one ``dcp.load`` of the model's own state dict (where the folder has it)
        and the flattened optimizer, then each set into the job: the model by its own ``load_state_dict``, which runs
        its hooks (a fused ``wqkv`` merged again)."""
        if fmt.keyed_by_id:  # each rank's own file
            return super().load_output(model, optim, directory, rank, fmt)
        import torch.distributed.checkpoint as dcp  # DCP: only a live job loads
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = str(step_folder_in(directory))
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd = dict(model.state_dict())
        items = dcp_items(Path(path))
        key = model_key(i.path for i in items)
        state: dict[str, Any] = {key: model_sd} if key is not None else dict(model_sd)
        # a model-only save loads the model alone, as torchtitan's initial load does
        with_optimizer = any(i.path[0] == OPTIMIZER for i in items)
        if with_optimizer:
            state[OPTIMIZER] = get_optimizer_state_dict(model, optim, options=flat)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state[key] if key is not None else {k: state[k] for k in model_sd})
        if with_optimizer:
            set_optimizer_state_dict(model, optim, state[OPTIMIZER], options=flat)

    def differences(
        self,
        directory: Path,
        parts: Any,
        rank: int,
        *,
        world_size: int,
        tree: ModuleTree,
        fmt: Format,
        opened: dict[str, Any],
        target: LayoutSpec | None = None,
    ) -> list[str]:
        """A rank file as it should be (``rank_local``); else this rank's rows of the model and the optimizer in the
        step folder, and on rank 0 every carried item as stored; on rank 0 every carried file, byte for byte."""
        from osdpipe.io.checkpoints import output  # torch.distributed.checkpoint: only where a whole checkpoint is read

        files = output.file_differences(directory, parts.carrying) if rank == 0 else []
        if fmt.keyed_by_id:  # each rank's own file
            return output.rank_file_differences(directory, parts, rank, tree) + files
        return output.one_dcp_differences(directory, parts, rank, world_size, tree, opened, OPTIMIZER) + files


#: How torchtitan names the folder of each checkpoint under ``--checkpoint.folder``; it resumes from the highest N.
STEP_FOLDER = re.compile(r"step-(\d+)")
#: What a torchtitan checkpoint folder osdpipe wrote from a Megatron GPT holds beside its step folders: the keywords
#: of ``osdpipe.layout.models.torchtitan_llama3`` or ``torchtitan_qwen3`` (torchtitan's own config of the model's
#: dimensions).
MODEL_ARGS = "model_args.json"


def step_folder(step: int) -> str:
    """The folder torchtitan saves step ``step`` in, and resumes from:
    what a torchtitan output holds under ``output.path``."""
    return f"step-{step}"


def step_folder_in(directory: Path) -> Path:
    """The one ``step-<N>`` folder of a conversion's output ``directory``."""
    found = [p for p in directory.iterdir() if STEP_FOLDER.fullmatch(p.name) and p.is_dir()]
    if len(found) != 1:
        raise FileNotFoundError(f"{directory} holds {len(found)} step-<N> folders; a torchtitan output holds one")
    return found[0]


#: Where torchtitan v0.1 and earlier nested the model's state dict; v0.2 and later save it at the top level.
NESTED_MODEL = "model"
#: How :meth:`Torchtitan.read` names each entry of the model, nested or not: ``model.<its name in the model>``.
_MODEL_ENTRY = "model."


def model_key(paths: Iterable[tuple[Any, ...]]) -> str | None:
    """Where the model's state dict sits among a step folder's saved item paths:
    under :data:`NESTED_MODEL`, or at the top level (``None``)."""
    return NESTED_MODEL if any(len(p) > 1 and p[0] == NESTED_MODEL for p in paths) else None


def _with_the_models_names(entries: tuple[Entry, ...], model_items: dict[str, str]) -> tuple[Entry, ...]:
    """The entries :meth:`Torchtitan.read` found,
    each top-level tensor that is not the model's (a user's own) called what it is.

    Without the model, :meth:`~Torchtitan.read` takes every top-level tensor for
    the model's (a buffer is one too); a conversion knows the model's names
    (``model_items``), so its report says which of them are carried over.
    """
    return tuple(
        replace(e, name=e.name.removeprefix(_MODEL_ENTRY), part="other")
        if e.part == "model" and e.name.removeprefix(_MODEL_ENTRY) not in model_items
        else e
        for e in entries
    )
