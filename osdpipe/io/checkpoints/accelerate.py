"""accelerate: ``Accelerator.save_state``'s folder, with FSDP.

SHARDED_STATE_DICT gives ``pytorch_model_fsdp_<i>/`` (DCP of
``{"model": model.state_dict()}``) and ``optimizer_<i>/`` (DCP of
``{"optimizer": FSDP.optim_state_dict(...)}``); FULL_STATE_DICT gives
``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (``input.format=fsdp_full``:
read as the full model and optimizer state, written out sharded). Beside them:
``scheduler.bin``, ``random_states_<r>.pkl`` per process,
``custom_checkpoint_<i>.pkl``, and when used ``sampler.bin``,
``dl_state_dict.bin``, ``scaler.pt``. Every other file is listed too.

A conversion reads the model and the optimizer through the same stages as
any checkpoint and copies every other file byte for byte. The ``dcp``
output is the folder as ``save_state`` writes it (``pytorch_model_fsdp_0/``
and ``optimizer_0/`` cut for the target world, every other file beside
them), which ``load_state`` reads on the target world; ``rank_local`` writes
each rank's file with the other files beside them.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io.checkpoints.base import (
    DCP_DIR,
    Carrying,
    CheckpointLayout,
    Entry,
    ModelNaming,
    Part,
    WholeCheckpoint,
    register,
)
from osdpipe.io.checkpoints.dcp_entries import dcp_items, is_dcp
from osdpipe.io.remote_input import as_path

if TYPE_CHECKING:  # annotations only: reading and writing import torch
    from osdpipe.io.formats.base import Format, RankFiles
    from osdpipe.layout.ranges import LayoutSpec
    from osdpipe.layout.tree import ModuleTree

_MODEL_DIR = re.compile(r"pytorch_model_fsdp_(\d+)")
_OPTIMIZER_DIR = re.compile(r"optimizer_(\d+)")
#: The FULL_STATE_DICT variant's two files.
FULL_MODEL, FULL_OPTIMIZER = "pytorch_model_fsdp.bin", "optimizer.bin"
_FULL_FILES = {FULL_MODEL: "model", FULL_OPTIMIZER: "optimizer"}
#: The SHARDED_STATE_DICT variant's DCP directories, as ``save_state`` names them for the first model and optimizer.
MODEL_DIR, OPTIMIZER_DIR = "pytorch_model_fsdp_0", "optimizer_0"
#: Files that describe one process of the saving world: accelerate's RNG states, and the HF Trainer's (its
#: ``checkpoint-<N>`` is this layout too).
_PER_RANK = re.compile(r"(?:random_states_(\d+)\.pkl|rng_state_(\d+)\.pth)")


@register
class Accelerate(CheckpointLayout):
    """accelerate's layout, read and written; written from another framework's checkpoint too
    (``output.checkpoint=accelerate``): its model and optimizer in accelerate's files, its own entries in
    ``<framework>.pt`` beside them, which accelerate does not read."""

    name = "accelerate"
    #: Its DCP directories by range, its full files (torch.save) by their records' ranges, the rest whole.
    looks_like = (
        "an accelerate save_state folder "
        "(pytorch_model_fsdp_0/, optimizer_0/, scheduler.bin, random_states_<r>.pkl, ...)"
    )

    def recognizes(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        return any(
            (_MODEL_DIR.fullmatch(p.name) or _OPTIMIZER_DIR.fullmatch(p.name)) and is_dcp(p)
            for p in path.iterdir()
        ) or any((path / name).is_file() for name in _FULL_FILES)

    def read(self, path: Path) -> WholeCheckpoint:
        entries: list[Entry] = []
        optimizer: tuple[str, str] | None = None
        for child in sorted(path.iterdir()):
            if (
                child.is_dir()
                and is_dcp(child)
                and (_MODEL_DIR.fullmatch(child.name) or _OPTIMIZER_DIR.fullmatch(child.name))
            ):
                part = "model" if _MODEL_DIR.fullmatch(child.name) else "optimizer"
                items = dcp_items(child)
                size, tensors = sum(i.size for i in items), sum(i.tensor for i in items)
                entries.append(Entry(child.name, part, f"{child.name}/ (DCP)", size, tensors))
                if part == "optimizer" and optimizer is None:
                    optimizer = (str(child), "optimizer")
            elif child.is_file():
                part = _FULL_FILES.get(child.name, "other")
                rank = _PER_RANK.fullmatch(child.name)
                source_rank = int(rank[1] or rank[2]) if rank else None
                entries.append(Entry(child.name, part, child.name, child.stat().st_size, 0, source_rank))
                if part == "optimizer" and optimizer is None:
                    optimizer = (str(child), "")
            else:
                size = sum(f.stat().st_size for f in child.rglob("*") if f.is_file())
                entries.append(Entry(child.name, "other", f"{child.name}/", size))
        return WholeCheckpoint(
            self.name,
            str(path),
            tuple(entries),
            optimizer[0] if optimizer else None,
            optimizer[1] or None if optimizer else None,
        )

    # ------------------------------------------------------------------ conversion

    #: SHARDED_STATE_DICT (its two DCP directories), or FULL_STATE_DICT (``pytorch_model_fsdp.bin`` and
    #: ``optimizer.bin``).
    input_formats = ("dcp", "fsdp_full")
    #: The same two, and each rank's own file.
    output_formats = ("dcp", "fsdp_full", "rank_local")

    def advice(self, path: str, target: dict[str, Any], output_format: str) -> list[str]:
        """What accelerate 1.x's ``load_state`` does with the output on the target world (read from its own code, held
        by the tests):

        * FSDP1 SHARDED_STATE_DICT into an optimizer that has not stepped loads
          no optimizer state: its DCP load template is ``FSDP.optim_state_dict``
          of that optimizer, empty before the first step;
        * process r restores its RNG from ``random_states_<r>.pkl``, and one with
          no such file keeps its own (it logs "Could not load random states");
        * a prepared scheduler steps once per process per optimizer step, so
          ``scheduler.bin`` counts the saving world's processes per step.
        """
        said = []
        world = target.get("world_size") or 1
        from osdpipe.io import formats  # the registries: torch, only where a conversion is planned
        from osdpipe.layout import kinds

        kind = kinds.find(target.get("kind"))
        if (
            formats.get(output_format).loaded_by_dcp
            and kind is not None
            and kind.sharded_load_needs_a_stepped_optimizer
        ):
            said.append(
                "accelerate's load_state of an FSDP1 SHARDED_STATE_DICT folder into an optimizer that has not stepped "
                "loads no optimizer state (its load template is FSDP.optim_state_dict of the empty optimizer): "
                "the model and the scheduler load, the moments do not; write output.format=fsdp_full "
                "(FULL_STATE_DICT, set the job to it) or take one optimizer step before load_state"
            )
        saved = sorted(int(m[1] or m[2]) for p in as_path(path).iterdir() if (m := _PER_RANK.fullmatch(p.name)))
        if saved and len(saved) != world:
            kept = (f"processes {len(saved)}..{world - 1} find no file of their own and keep their own RNG state"
                    if world > len(saved) else f"the files of processes {world}..{len(saved) - 1} are not read")
            said.append(
                f"{path} holds the RNG states of {len(saved)} processes, the target has {world}: "
                "load_state (and the HF Trainer) restores process r's from its own file "
                f"(random_states_<r>.pkl, rng_state_<r>.pth), so {kept}; and the scheduler counted {len(saved)} "
                "scheduler steps per optimizer step (accelerate steps a prepared scheduler once per process), "
                f"which becomes {world} per step on the target"
            )
        return said

    def foreign_advice(self, source: str, target: dict[str, Any]) -> list[str]:
        """``load_state`` loads ``scheduler.bin`` for every scheduler the job prepared, and fails where there is none;
        another framework's checkpoint has none (its scheduler's state is its own, in ``<framework>.pt``), nor any
        process's RNG state."""
        return [
            f"the {source} checkpoint has no accelerate scheduler.bin or random_states_<r>.pkl "
            f"({source}'s own entries, its scheduler's among them, go in {source}.pt beside the model and optimizer, "
            "which accelerate does not read): call load_state before preparing a scheduler "
            "(load_state fails on a prepared scheduler with no scheduler.bin); each process keeps its own RNG state"
        ]

    def adopt(self, carrying: Carrying) -> Carrying:
        """Another framework's checkpoint as a ``save_state`` folder: its own entries go in ``<framework>.pt``
        (:func:`osdpipe.io.checkpoints.output.carried_file_name`); an accelerate checkpoint stays as it is."""
        if carrying.layout == self.name:
            return carrying
        return replace(carrying, under=carrying.layout)

    def output_format_of(self, input_format: str) -> str:
        """The source's state-dict type: a job set to FULL_STATE_DICT looks for ``pytorch_model_fsdp.bin``, one set to
        SHARDED for ``pytorch_model_fsdp_0/``."""
        return input_format

    def generated_name(self, steps: int) -> str:
        return "checkpoint_0"  # save_state's first automatic name

    def refuses_source_kind(self, kind: Any) -> str | None:
        if kind.has_use_orig_params:
            return None
        return (
            "checkpoint=accelerate: osdpipe trains the source as accelerate's FSDP plugin does, with FSDP1; "
            "set source.kind=fsdp1 (or give input.path)"
        )

    def save(self, model: Any, optim: Any, scheduler: Any, path: Path, steps: int) -> None:
        """``save_state`` with FSDP1 SHARDED_STATE_DICT: the model's and the optimizer's DCP directories, the
        scheduler, each rank's RNG state."""
        import random
        import warnings

        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp  # DCP and FSDP: only where a checkpoint is saved
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

        rank = dist.get_rank()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FSDP.state_dict_type(
                model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
            ):
                dcp.save({"model": model.state_dict()}, checkpoint_id=str(path / MODEL_DIR))
                dcp.save({"optimizer": FSDP.optim_state_dict(model, optim)}, checkpoint_id=str(path / OPTIMIZER_DIR))
        torch.save(
            {"step": steps, "random_state": random.Random(rank).getstate(), "torch_manual_seed": torch.get_rng_state()},
            path / f"random_states_{rank}.pkl",
        )
        if rank == 0:
            torch.save(scheduler.state_dict(), path / "scheduler.bin")

    def input_format_of(self, path: str) -> str:
        return "fsdp_full" if _full(path) else "dcp"

    def model_from_files(
        self, path: str, written_in: CheckpointLayout | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """transformers' model of the folder's ``config.json``, which the HF Trainer saves in every ``checkpoint-<N>``:
        a Llama, Qwen2, Qwen3 or GPT-2 is built from it, its parameters named and shaped as transformers names them
        (:func:`osdpipe.io.hf_folder.model_from_config`, without transformers); ``None`` for a folder without one
        (accelerate's own ``save_state``) or of another model: the user's ``model.factory`` names it."""
        from osdpipe.io import hf_folder  # torch: only where a checkpoint is read

        return (hf_folder.MODEL_FROM_CONFIG, {"path": str(path)}) if hf_folder.config_builds_a_model(path) else None

    def model_naming(self, path: Path) -> ModelNaming:
        """None where the folder's ``config.json`` builds the model (:meth:`model_from_files`), else the user's own."""
        return ModelNaming(()) if self.model_from_files(str(path)) is not None else ModelNaming.users_own()

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part:
        if _full(path):  # FULL_STATE_DICT: FSDP.optim_state_dict's full state in one file
            return Part(str(as_path(path) / FULL_OPTIMIZER), "fsdp_full", "optim")
        return Part(str(as_path(path) / OPTIMIZER_DIR), "dcp", "optimizer")

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        if _full(path):
            from osdpipe.io.checkpoints.file_weights import FileWeights  # torch: only where a checkpoint is read

            return FileWeights(as_path(path) / FULL_MODEL, tree)
        # torch.distributed.checkpoint: only where a DCP checkpoint is read
        from osdpipe.io.checkpoints.dcp_weights import DcpWeights
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint

        return DcpWeights(DcpCheckpoint(as_path(path) / MODEL_DIR, None), "model", tree)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """Every file of the folder but the model's and the optimizer's parts, copied as it is."""
        root = as_path(path)
        parts = (FULL_MODEL, FULL_OPTIMIZER) if _full(path) else (MODEL_DIR, OPTIMIZER_DIR)
        files = tuple(
            sorted(
                str(p.relative_to(root))
                for p in root.rglob("*")
                if p.is_file() and p.relative_to(root).parts[0] not in parts
            )
        )
        return Carrying(path, files=files, entries=self.read(root).entries, layout=self.name)

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
        """A rank file (``rank_local``); the two full files, on rank 0 (``fsdp_full``: FULL_STATE_DICT); or this rank's
        pieces of the folder's two DCP directories (``dcp``: SHARDED_STATE_DICT)."""
        # torch.distributed.checkpoint: only where a whole checkpoint is written
        from osdpipe.io.checkpoints import output
        from osdpipe.io.formats.base import RankFiles, write_torch_file
        from osdpipe.io.weights import model_state_dict

        if fmt.keyed_by_id:  # each rank's own file
            return output.write_rank_file(parts, staging, rank, tree)
        root = staging / DCP_DIR
        foreign = output.carried_file_name(parts.carrying)
        # as save_state writes FULL_STATE_DICT on rank 0: the unwrapped model's state dict, FSDP's full optimizer state
        if fmt.one_writer:
            if not fmt.writes(rank):
                return RankFiles()
            root.mkdir(parents=True, exist_ok=True)
            written = [
                write_torch_file(model_state_dict(parts.weights, parts.buffers, tree), root / FULL_MODEL),
                write_torch_file(parts.optimizer, root / FULL_OPTIMIZER),
            ]
            if foreign is not None:  # another framework's own entries, beside
                written.append(write_torch_file(output.carried_file_content(parts), root / foreign))
            return RankFiles(
                {f"{DCP_DIR}/{k}": v for w in written for k, v in w.files.items()},
                {f"{DCP_DIR}/{k}": v for w in written for k, v in w.tensors.items()},
            )

        def model_of(r: int, local: bool) -> dict[str, Any]:
            return {"model": output.model_pieces(parts if local and r == rank else None, tree, world_size, r)}

        def optimizer_of(r: int, local: bool) -> dict[str, Any]:
            state = output.dcp_writer.rank_state(parts.optimizer, tree, world_size, r, local=local and r == rank)
            return {"optimizer": state}

        model_results, model_files, model_storages = output.write_dcp(
            root, MODEL_DIR, model_of, rank, world_size, shared
        )
        optimizer_results, optimizer_files, optimizer_storages = output.write_dcp(
            root, OPTIMIZER_DIR, optimizer_of, rank, world_size, shared
        )
        files = {f"{DCP_DIR}/{name}": digest for name, digest in {**model_files, **optimizer_files}.items()}
        if foreign is not None and rank == 0:  # another framework's own entries, beside, once
            beside = write_torch_file(output.carried_file_content(parts), root / foreign)
            files.update({f"{DCP_DIR}/{k}": v for k, v in beside.files.items()})
        tensors = {
            **output.optimizer_digests(parts.optimizer, f"{DCP_DIR}/{OPTIMIZER_DIR}", optimizer_storages),
            **output.model_digests(
                output.model_pieces(parts, tree, world_size, rank), f"{DCP_DIR}/{MODEL_DIR}", model_storages
            ),
        }  # taken as they were written
        return RankFiles(files, tensors, [model_results, optimizer_results])

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[RankFiles], fmt: Format, carrying: Carrying,
        target: LayoutSpec | None = None,
    ) -> dict[str, str]:
        """The two ``.metadata`` files (``dcp``) and every carried file, beside them or beside the rank files."""
        # torch.distributed.checkpoint: only where a whole checkpoint is written
        from osdpipe.io.checkpoints import output

        if fmt.keyed_by_id:  # each rank's own file
            return output.copy_files(carrying, staging)
        root = staging / DCP_DIR
        if fmt.one_writer:  # the two full files are written; the carried ones go beside them
            return output.copy_files(carrying, staging, DCP_DIR)
        done = {}
        for index, name in enumerate((MODEL_DIR, OPTIMIZER_DIR)):
            finished = output.finish_dcp(root, name, shared, [r.results[index] for r in per_rank])
            done.update({f"{DCP_DIR}/{k}": v for k, v in finished.items()})
        return {**done, **output.copy_files(carrying, staging, DCP_DIR)}

    def load_output(self, model: Any, optim: Any, directory: Path, rank: int, fmt: Format) -> None:
        """As ``load_state`` loads the folder's two DCP directories: the model's state dict under ``model``, the
        optimizer's under ``optimizer``.

        Through PyTorch's own state-dict API (``get_``/``set_model_state_dict``,
        ``get_``/``set_optimizer_state_dict``), which loads an FSDP1 job the way
        accelerate's SHARDED_STATE_DICT path does, and an FSDP2 job as well.
        """
        if fmt.keyed_by_id:  # each rank's own file
            return super().load_output(model, optim, directory, rank, fmt)
        import torch
        import torch.distributed.checkpoint as dcp  # DCP: only a live job loads
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        root = directory / DCP_DIR
        if fmt.one_writer:  # FULL_STATE_DICT: every rank reads the two files whole, as PyTorch's full load takes them
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, torch.load(root / FULL_MODEL, weights_only=True), options=full)
            set_optimizer_state_dict(model, optim, torch.load(root / FULL_OPTIMIZER, weights_only=True), options=full)
            return
        state = {"model": dict(get_model_state_dict(model))}
        dcp.load(state, checkpoint_id=str(root / MODEL_DIR))
        set_model_state_dict(model, state["model"])
        osd = {"optimizer": get_optimizer_state_dict(model, optim)}
        dcp.load(osd, checkpoint_id=str(root / OPTIMIZER_DIR))
        set_optimizer_state_dict(model, optim, osd["optimizer"])

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
        """A rank file as it should be (``rank_local``); else this rank's rows of the two DCP directories; on rank 0
        every carried file byte for byte."""
        from osdpipe.io.checkpoints import output  # torch.distributed.checkpoint: only where a whole checkpoint is read
        from osdpipe.io.formats.dcp import optimizer_differences
        from osdpipe.io.formats.dcp_reader import DcpCheckpoint, DcpReader

        if fmt.keyed_by_id:  # each rank's own file, the carried files beside
            problems = output.rank_file_differences(directory, parts, rank, tree)
            return problems + (output.file_differences(directory, parts.carrying) if rank == 0 else [])
        root = directory / DCP_DIR
        foreign = output.carried_file_name(parts.carrying)
        beside = (
            output.full_file_differences(root, {foreign: output.carried_file_content(parts)})
            if foreign is not None and rank == 0
            else []
        )
        if fmt.one_writer:  # the two full files, on rank 0 (the only rank that holds anything)
            from osdpipe.io.weights import model_state_dict

            full_files = {
                FULL_MODEL: model_state_dict(parts.weights, parts.buffers, tree),
                FULL_OPTIMIZER: parts.optimizer,
            }
            return (
                output.full_file_differences(root, full_files)
                + output.file_differences(root, parts.carrying)
                + beside
            )
        if "model" not in opened:  # opened (metadata read, structure checked) once for every rank
            opened["model"] = DcpCheckpoint(str(root / MODEL_DIR), None)
            opened["optimizer"] = reader = DcpReader(str(root / OPTIMIZER_DIR), "optimizer")
            opened["optimizer meta"] = reader.meta()
        problems = output.model_differences(opened["model"], "model", parts, tree, world_size, rank)
        problems += optimizer_differences(
            opened["optimizer"], opened["optimizer meta"], parts.optimizer, tree=tree, world_size=world_size, rank=rank
        )
        return problems + (output.file_differences(root, parts.carrying) if rank == 0 else []) + beside


def _full(path: str) -> bool:
    """Whether the folder is the FULL_STATE_DICT variant (one file each for the model and the optimizer)."""
    root = as_path(path)
    return (root / FULL_OPTIMIZER).is_file() and not (root / OPTIMIZER_DIR).is_dir()
