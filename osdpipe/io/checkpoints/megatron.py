"""Megatron-LM's layout of a whole checkpoint, as ``osdpipe inspect`` names it and ``checkpoint=megatron`` reads it.

A save folder (``latest_checkpointed_iteration.txt``, ``iter_<7 digits>/``), its iteration folder one DCP checkpoint
beside ``common.pt`` and ``metadata.json`` (:mod:`osdpipe.io.formats.megatron` names its files). It says every entry
with its size, the parallelism and sharding type that saved it, the model's dimensions from ``args``, and what osdpipe
cannot lay out yet.

Every conversion of or into one runs through the stage loop, which asks this layout what it asks every framework's
(:meth:`optimizer_part`, :meth:`open_model`, :meth:`carried`, :meth:`write`):

* to another Megatron grid: the save read by ranges by its sharded keys, each target rank's items written;
* to a Hugging Face folder or a PyTorch-native framework's layout (``output.checkpoint=hf|pytorch|accelerate|
  torchtitan``): the save read through the map to its Hugging Face model's (``LlamaForCausalLM``,
  ``GPT2LMHeadModel``...) or torchtitan model's names (:meth:`model_map`), the model built from ``args``
  (:meth:`model_from_files`), ``config.json`` (or torchtitan's ``model_args.json``) written beside, and common.pt's
  plain entries carried;
* from another framework's checkpoint of a GPT (a Hugging Face model's, torchtitan's, a Hugging Face folder): read
  through the inverse map (:meth:`map_into`), Megatron's GPT built of its ``config.json`` for the target's grid
  (:meth:`model_into`), what only a Megatron save holds made (:mod:`osdpipe.io.checkpoints.megatron_foreign`).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from osdpipe.io import hf_folder
from osdpipe.io.checkpoints.base import (
    DCP_DIR,
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
from osdpipe.io.checkpoints.dcp_entries import dcp_items
from osdpipe.io.checkpoints.torchtitan import MODEL_ARGS
from osdpipe.io.errors import ModelRefused
from osdpipe.io.formats import megatron as files
from osdpipe.io.formats.base import InputError
from osdpipe.io.formats.megatron_maps import gpt_map, model_named
from osdpipe.io.hf_folder import RECORD
from osdpipe.io.remote_input import as_path
from osdpipe.layout.megatron import dtype_args, position_embedding_type, query_groups
from osdpipe.layout.ranges import WEIGHTS

if TYPE_CHECKING:  # annotations only: reading imports torch
    import torch

    from osdpipe.io.formats.mapped import ModelMap
    from osdpipe.layout.tree import ModuleTree


class SavedWeights:
    """A Megatron-LM save's model weights (each sharded key's item, in the job's ``params_dtype``), as a whole
    checkpoint's model part (:class:`~osdpipe.io.weights.WeightsReader`)."""

    def __init__(self, files: Any, tree: ModuleTree) -> None:
        self.files, self.tree = files, tree

    def model_meta(self) -> Any:
        from osdpipe.io.weights import model_meta_of

        stored = {key: self.files.checkpoint.ref(key) for key in self.files.shapes
                  if key in self.files.checkpoint.metadata.state_dict_metadata}
        return model_meta_of(stored, {}, self.tree, str(self.files.folder))

    def stored_name(self, name: str) -> str | None:
        return name if name in self.files.shapes else None

    def read_weights(self, name: str, start: int, stop: int) -> torch.Tensor:
        import torch  # reading a save: torch is loaded

        parts = self.files.checkpoint.read_parts(name, start, stop)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_parts(self, name: str, start: int, stop: int) -> list[torch.Tensor]:
        return self.files.checkpoint.read_parts(name, start, stop)

    def release(self, name: str, start: int, stop: int) -> None:
        self.files.checkpoint.release(name, start, stop)


#: Entries by what their flat keys start with, and the part of a conversion each is.
#: (An expert-parallel job's two optimizers prefix their ``dp_reshardable`` items with ``chained_<i>.``.)
_OPTIMIZER = re.compile(
    r"(?:chained_\d+\.)?optimizer\.(state\.(\w+)\..+|distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_\(.+\)"
    r"\.bucket_idx_\d+\.(\w+))"
)
_BUCKET_SIZES = re.compile(
    r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.per_bucket_numel(_unpadded)?/.*"
)
_GROUPS = re.compile(r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.optimizer/.*")


@register
class Megatron(CheckpointLayout):
    """A Megatron-LM ``torch_dist`` save, as inspect and the command name it."""

    name = "megatron"
    looks_like = "a Megatron-LM save folder (latest_checkpointed_iteration.txt and iter_<N>/) or one iter_<N> folder"
    whole = True
    input_formats: ClassVar[tuple[str, ...]] = ("megatron",)
    output_formats: ClassVar[tuple[str, ...]] = ("megatron",)
    made_as_written = True
    gpt_names = "megatron"
    builds_own_model = True
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
        return str(files.iteration_folder(where)) if files.megatron_folder(where) == where else None

    def model_naming(self, path: Path) -> ModelNaming:
        """No model to name: Megatron's ``args`` give every dimension."""
        return ModelNaming(())

    def output_format_of(self, input_format: str) -> str | None:
        """A Megatron-LM save is written as one (its DCP checkpoint beside ``common.pt``)."""
        return "megatron"

    def refuses_keys(self, path: str, given: Any, raw: dict[str, Any]) -> str | None:
        """A sharding type for the optimizer (``output.megatron_optim_format``) of a save that holds the weights alone:
        there is no optimizer to save so."""
        said = (raw.get("output") or {}).get("megatron_optim_format")
        folder = files.iteration_folder(path)
        if "output.megatron_optim_format" in given and said and files.optimizer_sharding(files.read_common(folder),
                                                                                         folder) is None:
            return (f"output.megatron_optim_format={said}, but {folder} holds the model's weights alone, no optimizer "
                    "state; leave output.megatron_optim_format out")
        return None

    def model_from_files(self, path: str, written_in: CheckpointLayout | None = None) -> tuple[str, dict[str, Any]]:
        """The model of the GPT ``args`` describe, as the job that resumes the output builds it: Megatron's own GPT, its
        sharded keys, for a Megatron save (``written_in`` this layout); else the model whose names the layout
        ``written_in`` gives it (:func:`osdpipe.io.formats.megatron_maps.model_named`)."""
        return model_named(path, _names_in(written_in))

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part | None:
        """The iteration folder; its ``key`` names the model an output in the layout ``written_in`` reads it as
        (its facts name the param groups' parameters so: :meth:`model_map`); ``None`` where the save holds the
        weights alone (a model-only checkpoint, which converts to one)."""
        folder = files.iteration_folder(path)
        if files.optimizer_sharding(files.read_common(folder), folder) is None:
            return None
        return Part(str(folder), "megatron", _names_in(written_in))

    def model_map(
        self, path: str, written_in: CheckpointLayout | None = None, dtype: str | None = None,
        named: NamedModel | None = None,
    ) -> ModelMap | None:
        """For a PyTorch job (an output whose layout names a GPT as its Hugging Face model, or as torchtitan's:
        :attr:`~osdpipe.io.checkpoints.base.CheckpointLayout.gpt_names`), the map of the save's GPT to that model
        (:meth:`map_to`)."""
        names = _names_in(written_in)
        if names == self.gpt_names:
            return None
        return self.map_to(path, names, weights_alone=written_in is not None and written_in.weights_alone, dtype=dtype)

    def map_to(self, path: str, naming: str, *, weights_alone: bool = False, dtype: str | None = None) -> ModelMap:
        """The map of the save's GPT to the model ``naming`` names (:func:`osdpipe.io.formats.megatron_maps.gpt_map`).

        Raises:
            InputError: the GPT is one the model cannot express (its refusals), or its args are not Megatron-LM's.
        """
        return gpt_map(path, naming, weights_alone=weights_alone, dtype=dtype)

    def map_into(
        self, source: CheckpointLayout, path: str, dtype: str | None = None, named: NamedModel | None = None,
    ) -> ModelMap:
        """The map of another framework's checkpoint of a GPT (a Hugging Face model's, torchtitan's: ``source``'s, at
        ``path``) into Megatron's GPT (:func:`osdpipe.layout.megatron_hf.model_map`, the vocabulary's padding rows
        zeros): its weights are the model's (in the job's ``params_dtype``: that of the checkpoint's weights,
        :meth:`~osdpipe.io.checkpoints.base.CheckpointLayout.weights_dtype`) and the fp32 masters both, Adam's
        moments and ``step`` as they are (each group's ``step`` written by
        :mod:`osdpipe.io.checkpoints.megatron_foreign`); a folder of weights alone, its weights. A source of one param
        group for all is warned of (:data:`~osdpipe.io.checkpoints.megatron_foreign.ONE_GROUP`).

        Raises:
            InputError: the checkpoint's files say no model (no ``config.json``), or one Megatron cannot express.
        """
        from osdpipe.io.checkpoints.megatron_foreign import ONE_GROUP
        from osdpipe.io.formats.mapped import ModelMap
        from osdpipe.io.formats.megatron import MOMENTS
        from osdpipe.layout import megatron_hf
        from osdpipe.layout.kinds.megatron import Megatron as Kind
        from osdpipe.layout.megatron import params_dtype

        config = source.gpt_config(path, named)
        own = named or source.model_from_files(path, source)
        if config is None or own is None:
            raise InputError(f"{path}: its files name no model (no config.json, no model_args.json), which a Megatron "
                             "GPT is made of; convert a checkpoint saved with its model's config")
        try:
            args = _job_args(source, path, config, {})  # the dimensions: every grid maps alike
            pieces = megatron_hf.model_map(args, source.gpt_names, megatron_hf.MEGATRON_NAMES)
        except ValueError as exc:
            raise InputError(f"{path}: {exc}") from None
        weights = {WEIGHTS: WEIGHTS}
        alone = source.weights_alone or source.optimizer_part(path, source.input_format_of(path), self) is None
        states = weights if alone else {**weights, Kind.master_state: WEIGHTS, **{m: m for m in MOMENTS},
                                        "step": "step"}
        cast = params_dtype(args)
        return ModelMap(pieces, states, own, dtypes={WEIGHTS: cast}, state_dtype=None if alone else "float32",
                        one_group=ONE_GROUP)

    def model_for(self, written: CheckpointLayout, path: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The model of the save's ``args`` as ``written``'s job builds it (:meth:`model_from_files`)."""
        return self.model_from_files(path, written)

    def model_into(self, source: CheckpointLayout, path: str, config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Megatron's GPT of another framework's checkpoint's ``config.json``
        (:func:`osdpipe.layout.megatron_hf.megatron_args`) for the target's grid (``target.tp_size`` x
        ``target.pp_size`` on ``target.world_size`` ranks, ``vpp_size`` model chunks a stage), its vocabulary padded
        for the target's TP.

        Raises:
            ModelRefused: no ``config.json``, a model Megatron cannot express, or a grid that does not split it.
        """
        from osdpipe.layout.kinds.megatron import FACTORY
        from osdpipe.layout.megatron import layout_args

        hf = source.gpt_config(path, source.named_by(config.get("checkpoint") or {}))
        if hf is None:
            raise ModelRefused(f"{path}: its files name no model (no config.json, no model_args.json), which a "
                               "Megatron GPT is made of; convert a checkpoint saved with its model's config")
        try:
            args = _job_args(source, path, hf, config.get("target") or {})
        except ValueError as exc:
            raise ModelRefused(f"{path}: {exc}") from None
        return FACTORY, {"args": layout_args(args)}

    def settles(self, source: CheckpointLayout, path: str) -> dict[str, Any]:
        """Another framework's checkpoint is written for a Megatron job (``target.kind=megatron``), with its optimizer
        ``fully_reshardable`` (each state global per key) unless ``output.megatron_optim_format`` says."""
        if source is self:
            return {}
        if source.weights_alone or source.optimizer_part(path, source.input_format_of(path), self) is None:
            return {"target.kind": self.name}
        return {"target.kind": self.name, "output.megatron_optim_format": "fully_reshardable"}

    def adopt(self, carrying: Carrying) -> Carrying:
        """A Megatron save's carrying as it is; another framework's (:mod:`osdpipe.io.checkpoints.megatron_foreign`)
        without its items and files, which a Megatron save has no place for (the report says so of each), its
        iteration folder named once the step is known (:meth:`write`)."""
        from osdpipe.io.checkpoints import megatron_foreign

        if carrying.layout == self.name:
            return carrying
        kept = (as_path(carrying.source) / hf_folder.CONFIG).is_file()  # kept for the way back (_made_common)
        return replace(carrying, items=(), item_paths=(), item_tensors={}, files=(), made={}, under=None, folder="",
                       left_out=megatron_foreign.LEFT_OUT if carrying.optimizer else megatron_foreign.NO_PLACE,
                       said=megatron_foreign.KEPT if kept else {},
                       warnings=(*carrying.warnings, *(() if carrying.optimizer else (megatron_foreign.FRESH,))))

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        """The model's items, by ranges (:class:`SavedWeights`)."""
        from osdpipe.io.formats.megatron_reader import MegatronFiles, SavedState

        return SavedWeights(optimizer.files if isinstance(optimizer, SavedState) else MegatronFiles(path), tree)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """common.pt's plain entries (the iteration, the scheduler's state, the FLOPs so far), each leaf under its own
        name, and ``config.json`` made for Hugging Face (``model_args.json`` for a torchtitan model); the rest
        describes Megatron's own job (``args``, the RNG states of its (PP, TP) ranks, the linears' ``_extra_state``) and
        is left out, the report says so."""
        import torch

        from osdpipe.core.state_paths import leaf_paths  # each leaf named as dcp.save names it
        from osdpipe.layout.megatron_hf import HF_NAMES, MEGATRON_NAMES, TORCHTITAN

        folder = files.iteration_folder(path)
        if _names_in(written_in) == MEGATRON_NAMES:
            return self._carried_for_megatron(folder)
        common = files.read_common(folder)
        flat, paths = leaf_paths(_carried_values(common))
        tensors = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in flat.items()
                   if torch.is_tensor(v)}
        titan = _names_in(written_in) == TORCHTITAN
        _, config = model_named(str(folder), TORCHTITAN if titan else HF_NAMES)
        record = None if titan else common.get(RECORD)
        made = {MODEL_ARGS if titan else HF_CONFIG: _json(hf_folder.config_back(record, config))}
        if record and record.get("generation_config") is not None:
            made[hf_folder.GENERATION_CONFIG] = record["generation_config"].encode()
        entries = [
            e if e.part in ("model", "optimizer") else Entry(e.name, "framework", e.where, e.size, e.tensors)
            for e in self.read(folder).entries if not e.name.startswith(files.COMMON)
        ]
        entries += [Entry(f"{files.COMMON} {key}", _COMMON_PARTS.get(key, "other"), files.COMMON, len(repr(value)))
                    for key, value in common.items()]
        return Carrying(
            str(folder), tuple(flat), tuple(paths[k] for k in flat), tensors, (), tuple(entries),
            layout=self.name, step=int(common.get("iteration", 0)),
            made=made, warnings=() if titan or record else (_no_token_ids(folder),),
        )

    def _carried_for_megatron(self, folder: Path) -> Carrying:
        """What a Megatron save carries into another grid's: each (PP, TP) rank's RNG states and the linears'
        ``_extra_state`` items, as stored, and ``common.pt`` (rewritten for the target: :meth:`finish`); the model and
        the optimizer convert. Its iteration folder's name is the output's (``iter_<N>``, or ``release``)."""
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint

        checkpoint = DcpCheckpoint(str(folder), None)
        items = tuple(flat for flat in checkpoint.metadata.state_dict_metadata
                      if files.RNG.fullmatch(flat) or "._extra_state/shard_" in flat)
        common = files.read_common(folder)
        return Carrying(str(folder), items, tuple((flat,) for flat in items), {}, (),
                        self.read(folder).entries, layout=self.name, step=int(common.get("iteration", 0)),
                        folder=folder.name, optimizer=files.optimizer_sharding(common, folder) is not None)

    def write(
        self,
        parts: Any,
        staging: Path,
        rank: int,
        *,
        world_size: int,
        tree: ModuleTree,
        shared: dict[str, Any],
        fmt: Any,
        target: Any = None,
        output_config: Any = None,
    ) -> Any:
        """Target rank ``rank``'s items of the save (:func:`osdpipe.io.formats.megatron_items.rank_items`: its chunks
        of the model and the optimizer, its (PP, TP) rank's byte items) into a file of its own of the iteration
        folder's DCP checkpoint; the checkpoint's plan made once per process, from every rank's items."""
        from osdpipe.io.checkpoints import output
        from osdpipe.io.digest import tensor_sha256
        from osdpipe.io.formats.base import RankFiles

        grid, save = target.grid, _save_of(parts, tree, target.grid)
        folder = save.carrying.folder
        # what finish writes common.pt of, kept in the process that commits
        shared[_SHARED_COMMON], shared[_SHARED_GROUPS] = save.common, save.groups
        shared[_SHARED_FOLDER] = (folder, save.carrying.step)
        written = _written(save.carrying, tree)

        def items_of(r: int, local: bool) -> dict[str, Any]:
            return written.items(grid, r, save.raw if local else None, save.groups,
                                 _state(parts) if local and r == rank else None)

        results, digests, storages = output.write_dcp(staging, folder, items_of, rank, world_size, shared)
        where = next(iter(digests), folder)
        tensors = {f"{where}:{key}@{','.join(str(a) for a, _ in box)}": tensor_sha256(local, storages)
                   for key, value in items_of(rank, True).items() if getattr(value, "boxes", None)
                   for box, local in zip(value.boxes, value.local or ())}
        return RankFiles(digests, tensors, results)

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[Any], fmt: Any, carrying: Carrying,
        target: Any = None,
    ) -> dict[str, str]:
        """The ``.metadata`` of the iteration folder, its ``common.pt`` for the target's grid
        (:func:`osdpipe.io.formats.megatron_items.target_common`: the source's, its ``args`` and optimizer part
        rewritten), ``metadata.json`` and the save folder's ``latest_checkpointed_iteration.txt``."""
        from osdpipe.io import torchfile
        from osdpipe.io.checkpoints import output
        from osdpipe.io.digest import file_sha256
        from osdpipe.io.formats import megatron_items

        folder, step = shared[_SHARED_FOLDER]
        done = output.finish_dcp(staging, folder, shared, [r.results for r in per_rank])
        common = _Save(carrying, {}, None, shared[_SHARED_COMMON]).common_of()
        made = megatron_items.target_common(common, target.grid, shared[_SHARED_GROUPS], int(step or 0))
        written, _ = torchfile.save(made, staging / folder / files.COMMON, sync=False)  # the same bytes every run
        (staging / folder / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}))
        (staging / files.LATEST).write_text(files.RELEASE if folder == files.RELEASE else str(step or 0))
        small = [f"{folder}/metadata.json", files.LATEST]
        return {**done, f"{folder}/{files.COMMON}": written, **{name: file_sha256(staging / name) for name in small}}

    def differences(
        self,
        directory: Path,
        parts: Any,
        rank: int,
        *,
        world_size: int,
        tree: ModuleTree,
        fmt: Any,
        opened: dict[str, Any],
        target: Any = None,
    ) -> list[str]:
        """Where target rank ``rank``'s items of the save under ``directory`` differ from what it should hold
        (``parts``, derived from the source again), bitwise: each chunk of the model and the optimizer, each byte item
        as stored; on rank 0 ``common.pt``'s ``args``, iteration and optimizer part (``opened``: the save, opened
        once for every rank)."""

        from osdpipe.core.compare import bits_equal
        from osdpipe.io.formats import megatron_items
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint
        from osdpipe.io.formats.dcp_writer import BoxShard

        save = _save_of(parts, tree, target.grid)
        folder, groups = directory / save.carrying.folder, save.groups
        if "save" not in opened:
            opened["save"] = DcpCheckpoint(str(folder), None)
        saved: DcpCheckpoint = opened["save"]
        problems: list[str] = []
        items = _written(save.carrying, tree).items(target.grid, rank, save.raw, groups, _state(parts))
        for item, value in items.items():
            try:
                if isinstance(value, BoxShard):
                    for box, want in zip(value.boxes, value.local or ()):
                        got = saved.read_chunk(item, tuple(a for a, _ in box))
                        if got.dtype != want.dtype or not bits_equal(got.reshape(-1), want.reshape(-1)):
                            problems.append(f"{folder}: {item} at {tuple(a for a, _ in box)} differs from the source's")
                elif saved.stored(item) != value.raw:
                    problems.append(f"{folder}: {item} differs from the source's")
            except InputError as exc:
                problems.append(str(exc))
        if rank == 0:
            common = files.read_common(folder)
            made = megatron_items.target_common(save.common_of(), target.grid, groups, int(save.carrying.step or 0))
            made["args"] = vars(made["args"])
            for key in ("args", "iteration", "optimizer", "content_metadata"):  # plain data: equal as written out
                if repr(common.get(key)) != repr(made.get(key)):
                    problems.append(f"{folder / files.COMMON}: {key} is not what the target's grid makes of the "
                                    "source's")
        return problems

    def advice(self, path: str, target: dict[str, Any], output_format: str) -> list[str]:
        """Into another grid, what the target's RNG states are: Megatron-LM loads them once its ``args`` match the
        grid, so a target (PP, TP) rank with no source rank of its own carries another's, which draws the same dropout
        masks."""
        folder = files.iteration_folder(path)
        args = files.read_common(folder)["args"]
        tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
        t, p = int(target.get("tp_size") or 1), int(target.get("pp_size") or 1)
        if (t, p) == (tp, pp) or not any(files.RNG.fullmatch(i.name) or i.name.startswith("rng_state")
                                         for i in self.read(folder).entries):
            return []
        return [f"RNG states: the target's (PP, TP) grid {p}x{t} differs from the source's {pp}x{tp}; target rank "
                "(p, t) carries source rank (p mod PP, t mod TP)'s states, so ranks that share a source rank draw the "
                "same random numbers (dropout masks) where the source's drew different ones"]

    def read_carried(self, carrying: Carrying) -> CarriedData:
        """The carried leaves' values (common.pt read inertly: plain data); into another Megatron grid, the RNG states'
        and ``_extra_state``'s stored bytes and ``common.pt``'s own (:data:`COMMON_BYTES`)."""
        from osdpipe.core.state_paths import leaf_paths

        if _into_megatron(carrying):
            from osdpipe.io.formats.dcp_reader import DcpCheckpoint

            checkpoint = DcpCheckpoint(carrying.source, None)
            raw = {flat: checkpoint.stored(flat) for flat in carrying.items}
            if missing := [flat for flat, data in raw.items() if data is None]:
                raise InputError(f"{carrying.source}: {missing[0]} is stored transformed (compressed): not supported "
                                 "yet")
            raw[COMMON_BYTES] = (as_path(carrying.source) / files.COMMON).read_bytes()
            return CarriedData(raw=raw)

        flat, _ = leaf_paths(_carried_values(files.read_common(as_path(carrying.source))))
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
#: Where a Megatron output's carried data keeps the source's ``common.pt`` bytes, and what every process that writes
#: keeps of the conversion for :meth:`Megatron.finish` (in the world's shared dict).
COMMON_BYTES = "common.pt"
_SHARED_COMMON, _SHARED_GROUPS = "megatron common.pt", "megatron param groups"
#: The iteration folder and step every rank writes into, kept for the commit (another framework's: named by its step).
_SHARED_FOLDER = "megatron iteration folder"


def _into_megatron(carrying: Carrying) -> bool:
    """Whether ``carrying`` is a Megatron save's for another Megatron grid (its iteration folder is the output's)."""
    return carrying.folder != DCP_DIR


def _groups_of(optimizer: dict[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's param groups as a save keeps them: their hyperparameters and ``step``, no parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.get("param_groups") or []]


def _state(parts: Any) -> dict[str, dict[str, Any]]:
    """A rank's written tensors' states by layout key, the weights among them."""
    state = {key: dict(held) for key, held in parts.optimizer.get("state", {}).items() if isinstance(held, dict)}
    for key, weights in parts.weights.items():
        state.setdefault(key, {})[WEIGHTS] = weights
    return state


class _Written:
    """What a Megatron output's ranks write: their items (:func:`~osdpipe.io.formats.megatron_items.rank_items`),
    with the RNG states and ``_extra_state`` a conversion carries."""

    def __init__(self, weights_dtype: Any, carried_items: tuple[str, ...]) -> None:
        self.weights_dtype = weights_dtype
        self.rng_items = [f for f in carried_items if files.RNG.fullmatch(f)]
        self.extra_items = [f for f in carried_items if f not in self.rng_items]

    def items(self, grid: Any, rank: int, raw: dict[str, bytes] | None, groups: Any, state: Any) -> dict[str, Any]:
        from osdpipe.io.formats import megatron_items

        held = raw or {}
        rng = {(int(m[1]), int(m[2])): held.get(f, b"") for f in self.rng_items if (m := files.RNG.fullmatch(f))}
        source = _source_grid(self.rng_items)
        return megatron_items.rank_items(
            grid, rank, self.weights_dtype, state, groups=groups, rng=rng, source_grid=source,
            extra={f: held.get(f, b"") for f in self.extra_items})


def _written(carrying: Carrying, tree: ModuleTree) -> _Written:
    import torch

    return _Written(getattr(torch, tree.params[0].dtype), carrying.items)


def _job_args(source: CheckpointLayout, path: str, config: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's ``args`` of the job that resumes another framework's checkpoint (``source``'s, at ``path``,
    of the model ``config`` describes) on the grid ``target`` says (``tp_size``, ``pp_size``, ``world_size``,
    ``vpp_size``; one rank where unsaid): ``bf16``/``fp16`` as the checkpoint's weights are
    (:meth:`~osdpipe.io.checkpoints.base.CheckpointLayout.weights_dtype`).

    Raises:
        ValueError: what Megatron cannot express, or a grid that does not split the model (one line).
    """
    from osdpipe.layout import megatron_hf

    def size(key: str) -> int:
        return int(target.get(key) or 1)

    args = megatron_hf.megatron_args(config, size("tp_size"), size("pp_size"), size("world_size"),
                                     vpp=size("vpp_size"))
    return {**args, **dtype_args(source.weights_dtype(path))}


@dataclass(frozen=True)
class _Save:
    """What every target rank's part of a save is made of: the carrying (its iteration folder and step), the byte
    items each (PP, TP) rank writes, the param groups (``None``: the weights alone) and ``common.pt``'s source (the
    Megatron source's bytes, or what is made of another framework's checkpoint)."""

    carrying: Carrying
    raw: dict[str, bytes]
    groups: list[dict[str, Any]] | None
    common: bytes | dict[str, Any]

    def common_of(self) -> dict[str, Any]:
        """``common.pt`` before the target's grid is set in it, its ``args`` a plain dict."""
        from osdpipe.io.formats.inert_load import load_inert_bytes

        if not isinstance(self.common, bytes):
            return dict(self.common)
        common = load_inert_bytes(self.common, files.DESCRIBED, what=files.WHAT)
        common["args"] = dict(common["args"].state) if hasattr(common["args"], "state") else vars(common["args"])
        return common


def _save_of(parts: Any, tree: ModuleTree, grid: Any) -> _Save:
    """What a rank's part of the save for ``grid`` is made of (:class:`_Save`): a Megatron source's own items, groups
    and ``common.pt``; for another framework's checkpoint, what only a Megatron save holds, made
    (:mod:`osdpipe.io.checkpoints.megatron_foreign`): Megatron's param groups, the linears' ``_extra_state``, an
    ``iter_<step>`` folder (a folder of weights alone: ``release``) and ``common.pt``."""
    from osdpipe.io.checkpoints import megatron_foreign

    carrying = parts.carrying
    if carrying.layout == Megatron.name:
        groups = _groups_of(parts.optimizer) if carrying.optimizer else None
        return _Save(carrying, parts.carried.raw, groups, parts.carried.raw[COMMON_BYTES])
    step = _step_of(parts.optimizer, carrying.source) if carrying.optimizer else 0
    groups = None
    if carrying.optimizer:
        groups = megatron_foreign.megatron_groups(parts.optimizer.get("param_groups") or [], float(step),
                                                  carrying.source)
    raw = megatron_foreign.extra_state(grid.gpt.num_layers)
    folder = f"iter_{step:07d}" if carrying.optimizer else files.RELEASE
    carrying = replace(carrying, items=tuple(raw), folder=folder, step=step)
    return _Save(carrying, raw, groups, _made_common(carrying, grid, groups, step, tree.params[0].dtype))


def _step_of(optimizer: dict[str, Any], where: str) -> int:
    """The step every parameter of a rank's converted optimizer was taken to (the iteration of a Megatron save).

    Raises:
        InputError: parameters stepped unequally, or a step that is no whole number.
    """
    steps = {float(held["step"]) for held in optimizer.get("state", {}).values()
             if isinstance(held, dict) and "step" in held}
    if len(steps) > 1:
        raise InputError(f"{where}: the parameters were stepped {sorted(steps)} times; a Megatron save holds one step "
                         "for all of them")
    step = steps.pop() if steps else 0.0
    if not step.is_integer():
        raise InputError(f"{where}: step {step} is no whole number of steps")
    return int(step)


def _made_common(carrying: Carrying, grid: Any, groups: Any, step: int, dtype: str) -> dict[str, Any]:
    """``common.pt`` of another framework's checkpoint (:func:`osdpipe.io.checkpoints.megatron_foreign.made_common`):
    Megatron-LM's ``args`` of its model's ``config.json`` for ``grid`` and a job whose weights are ``dtype``, and the
    folder it was made of, where it has one, kept for the way back."""
    from osdpipe.io.checkpoints import megatron_foreign
    from osdpipe.layout import megatron_hf

    config = carrying.gpt_config
    assert config is not None, "the map read the same config (osdpipe.io.weights.open_whole)"
    args = megatron_hf.megatron_args(config, grid.tp, grid.pp, grid.world_size, iteration=step,
                                     sharding=grid.sharding or "fully_reshardable", vpp=grid.vpp)
    args.update(dtype_args(dtype))
    kept = (as_path(carrying.source) / hf_folder.CONFIG).is_file()  # a folder's own, not one made of torchtitan's
    record = hf_folder.record_of(carrying.source, config) if kept else None
    return megatron_foreign.made_common(args, groups, step, record)


def _source_grid(rng_items: list[str]) -> tuple[int, int]:
    """The source's (TP, PP), as its RNG items' keys name them (``rng_state/shard_<pp>.<tp>_<PP>.<TP>``)."""
    for flat in rng_items:
        pp, tp = flat.rsplit("_", 1)[1].split(".")
        return int(tp), int(pp)
    return 1, 1
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
    if experts := args.get("num_experts"):
        etp = args.get("expert_tensor_parallel_size") or tp
        notes.append(f"mixture of experts: {experts} experts in every layer (moe_layer_freq "
                     f"{args.get('moe_layer_freq', 1)}), top-{args.get('moe_router_topk')}, each of ffn "
                     f"{args.get('moe_ffn_hidden_size') or args.get('ffn_hidden_size')}; EP{ep}, expert TP{etp}; "
                     f"to keep EP{ep}, add target.ep_size={ep} to the command below (without it, EP1: the experts "
                     "dense on every DP rank)")
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


def _no_token_ids(folder: Path) -> str:
    """The warning for a Hugging Face model's ``config.json`` made of a save that keeps no folder's (osdpipe keeps one
    in ``common.pt`` only where it made the save of a folder): Megatron's ``args`` hold no token ids, and a Megatron
    save no ``generation_config.json``."""
    return (f"{folder}: the save holds no Hugging Face folder's config.json (osdpipe keeps one in common.pt's "
            f"{RECORD!r} only where it made the save of a folder): config.json's bos_token_id and eos_token_id are "
            "null and no generation_config.json is written; set the token ids from the model's tokenizer, and copy "
            "its generation_config.json beside the weights")


def _json(config: dict[str, Any]) -> bytes:
    """A ``config.json``'s bytes, as osdpipe writes every one (sorted keys, indent 2)."""
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _names_in(written_in: CheckpointLayout | None) -> str:
    """The names a GPT's parameters have in an output in the layout ``written_in`` (``None``: a Megatron save's):
    :attr:`~osdpipe.io.checkpoints.base.CheckpointLayout.gpt_names`."""
    return (written_in or Megatron).gpt_names
