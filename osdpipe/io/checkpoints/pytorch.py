"""pytorch: PyTorch's own distributed state-dict layout, one DCP directory of ``{"model": ..., "optim": ...}``.

What a job that uses nothing but PyTorch saves and loads:
``dcp.save({"model": get_model_state_dict(model), "optim":
get_optimizer_state_dict(model, optim)})`` and ``dcp.load`` of the same
structure, then ``set_model_state_dict`` and ``set_optimizer_state_dict``.
The model's state dict is nested under ``model`` (FQN keys, buffers
included), the optimizer's under ``optim`` (FQN keyed, not flattened). Any
other top-level entry is the user's, carried over as it is stored.

It is also what any other whole checkpoint converts to with
``output.checkpoint=pytorch``, and what a DeepSpeed save, which osdpipe reads
but does not write, converts to unless told (:mod:`osdpipe.io.checkpoints.deepspeed`):
every job PyTorch runs loads it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io.checkpoints.base import (
    DCP_DIR,
    CarriedData,
    Carrying,
    CheckpointLayout,
    Entry,
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

#: Where PyTorch's layout keeps the model's and the optimizer's state dicts.
MODEL, OPTIM = "model", "optim"


@register
class Pytorch(CheckpointLayout):
    """PyTorch's own layout, read and written;
    written from a checkpoint of any layout too (``output.checkpoint=pytorch``).

    Written: each rank's own file (``rank_local``; ``plain``: the one process's ``rank_0.pt``, what a plain job
    ``torch.save``s), or one DCP directory of ``model`` and ``optim``, every carried item beside them at the top level
    and every carried file (accelerate's ``scheduler.bin``...) beside ``dcp/``.
    """

    name = "pytorch"
    one_dcp = True
    looks_like = (
        "a DCP directory of PyTorch's state dicts: model (get_model_state_dict) and optim (get_optimizer_state_dict)"
    )
    output_formats = ("dcp", "rank_local", "plain")

    def recognizes(self, path: Path) -> bool:
        """A DCP directory with tensors nested under ``model`` and nothing of torchtitan's
        (its v0.1 nests the model there too)."""
        if not is_dcp(path):
            return False
        tops = {i.path[0] for i in dcp_items(path) if len(i.path) > 1}
        return MODEL in tops and not tops & {"optimizer", "lr_scheduler", "dataloader", "train_state"}

    def read(self, path: Path) -> WholeCheckpoint:
        items = dcp_items(path)
        where = f"{path.name}/ (DCP)"
        groups: dict[str, list] = defaultdict(list)
        for item in items:
            name = f"{MODEL}.{item.path[1]}" if item.path[0] == MODEL and len(item.path) > 1 else str(item.path[0])
            groups[name].append(item)
        part = {OPTIM: "optimizer"}
        entries = tuple(
            Entry(
                name,
                "model" if name.startswith(f"{MODEL}.") else part.get(name, "other"),
                where,
                sum(i.size for i in members),
                sum(i.tensor for i in members),
            )
            for name, members in groups.items()
        )
        notes = () if OPTIM in groups else ("model only: no optimizer state; it converts to a model-only checkpoint",)
        return WholeCheckpoint(
            self.name,
            str(path),
            entries,
            str(path) if OPTIM in groups else None,
            OPTIM if OPTIM in groups else None,
            "nested",
            notes,
        )

    def save(self, model: Any, optim: Any, scheduler: Any, path: Path, steps: int) -> None:
        """``dcp.save`` of the model's and the optimizer's distributed state dicts,
        as a PyTorch job saves them (no scheduler: the layout has none)."""
        import torch.distributed.checkpoint as dcp  # DCP: only where a checkpoint is saved
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save(
            {MODEL: get_model_state_dict(model), OPTIM: get_optimizer_state_dict(model, optim)}, checkpoint_id=str(path)
        )

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part | None:
        return Part(path, "dcp", OPTIM) if any(i.path[0] == OPTIM for i in dcp_items(as_path(path))) else None

    def _model(self, path: str, tree: ModuleTree) -> Any:
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.checkpoints.dcp_weights import DcpWeights
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint

        return DcpWeights(DcpCheckpoint(as_path(path), None), MODEL, tree)

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        return self._model(path, tree)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """Every top-level entry besides ``model`` and ``optim``: the user's own, carried over as stored."""
        model = self._model(path, tree)
        items, planned, tensors = carried_items(model.checkpoint, set(model.items.values()), (OPTIM,))
        has_optimizer = any(p[0] == OPTIM for p in model.checkpoint.paths.values())
        entries = self.read(as_path(path)).entries
        return Carrying(path, items, planned, tensors, (), entries, MODEL, DCP_DIR, has_optimizer, layout=self.name)

    def read_carried(self, carrying: Carrying) -> CarriedData:
        # torch.distributed.checkpoint: only where a whole checkpoint is read
        from osdpipe.io.checkpoints.output import read_carried
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint

        return read_carried(DcpCheckpoint(as_path(carrying.source), None), carrying)

    # ------------------------------------------------------------------ writing

    def adopt(self, carrying: Carrying) -> Carrying:
        """The model under ``model`` of one DCP directory, ``dcp/``, whatever layout the input had;
        its carried items keep their names.

        Raises:
            InputError: a carried item is named ``model`` or ``optim``, which this layout holds.
        """
        clash = next(
            (flat for flat, path in zip(carrying.items, carrying.item_paths) if path[0] in (MODEL, OPTIM)), None
        )
        if clash is not None:
            from osdpipe.io.formats.base import InputError  # torch: only where a conversion is written

            raise InputError(
                f"{carrying.source}: its entry {clash} would take the place of PyTorch's {MODEL} or {OPTIM}; "
                "write the input's own layout (leave output.checkpoint out)"
            )
        return replace(carrying, model_key=MODEL, folder=DCP_DIR)

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
        # torch.distributed.checkpoint: only where a whole checkpoint is written
        from osdpipe.io.checkpoints import output
        from osdpipe.io.formats.base import RankFiles

        if fmt.keyed_by_id:  # each rank's own file
            return output.write_rank_file(parts, staging, rank, tree)

        def state_of(r: int, local: bool) -> dict[str, Any]:
            mine = local and r == rank
            state: dict[str, Any] = {MODEL: output.model_pieces(parts if mine else None, tree, world_size, r)}
            if parts.carrying.optimizer:  # a model-only checkpoint stays one
                state[OPTIM] = output.dcp_writer.rank_state(parts.optimizer, tree, world_size, r, local=mine)
            if r == 0:  # carried items are kept by one rank, as dcp.save keeps a replicated item once
                state.update(output.carried_state(parts.carrying, parts.carried if mine else None))
            return state

        results, files, storages = output.write_dcp(staging, DCP_DIR, state_of, rank, world_size, shared)
        where = next(iter(files), DCP_DIR)
        tensors = {
            **output.optimizer_digests(parts.optimizer, where, storages),
            **output.model_digests(output.model_pieces(parts, tree, world_size, rank), where, storages),
        }
        return RankFiles(files, tensors, results)

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[RankFiles], fmt: Format, carrying: Carrying,
        target: LayoutSpec | None = None,
    ) -> dict[str, str]:
        """The ``.metadata`` (``dcp``), and every carried file
        (accelerate's) beside the output's DCP directory or rank files."""
        # torch.distributed.checkpoint: only where a whole checkpoint is written
        from osdpipe.io.checkpoints import output

        done = {} if fmt.keyed_by_id else output.finish_dcp(staging, DCP_DIR, shared, [r.results for r in per_rank])
        return {**done, **output.copy_files(carrying, staging)}

    def load_output(self, model: Any, optim: Any, directory: Path, rank: int, fmt: Format) -> None:
        """As a PyTorch job loads it: ``dcp.load`` of
        ``{"model": get_model_state_dict, "optim": get_optimizer_state_dict}``, then each set into the job."""
        if fmt.keyed_by_id:  # each rank's own file
            return super().load_output(model, optim, directory, rank, fmt)
        import torch.distributed.checkpoint as dcp  # DCP: only a live job loads
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = directory / DCP_DIR
        # a model-only checkpoint loads the model alone
        with_optimizer = any(i.path[0] == OPTIM for i in dcp_items(path))
        state: dict[str, Any] = {MODEL: dict(get_model_state_dict(model))}
        if with_optimizer:
            state[OPTIM] = get_optimizer_state_dict(model, optim)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state[MODEL])
        if with_optimizer:
            set_optimizer_state_dict(model, optim, state[OPTIM])

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
        """A rank file as it should be (``rank_local``); else this rank's rows of the model and the optimizer,
        and on rank 0 every carried item as stored; on rank 0 every carried file, byte for byte."""
        from osdpipe.io.checkpoints import output  # torch.distributed.checkpoint: only where a whole checkpoint is read

        files = output.file_differences(directory, parts.carrying) if rank == 0 else []
        if fmt.keyed_by_id:  # each rank's own file
            return output.rank_file_differences(directory, parts, rank, tree) + files
        return output.one_dcp_differences(directory, parts, rank, world_size, tree, opened, OPTIM) + files
