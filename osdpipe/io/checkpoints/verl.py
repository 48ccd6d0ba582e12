"""verl: a veRL FSDP checkpoint as a whole training checkpoint, read only: written in PyTorch's layout
(:mod:`osdpipe.io.checkpoints.pytorch`) or another framework's (``output.checkpoint=accelerate``, ...).

veRL's ``FSDPCheckpointManager`` saves an actor (or critic) as one folder, every rank's files in it:

* ``model_world_size_<W>_rank_<r>.pt``: the rank's ``model.state_dict()``, each parameter a DTensor shard of dim 0;
* ``optim_world_size_<W>_rank_<r>.pt``: its ``optimizer.state_dict()`` (:mod:`osdpipe.io.formats.verl`);
* ``extra_state_world_size_<W>_rank_<r>.pt``: its learning-rate scheduler's state and its RNG states;
* ``fsdp_config.json``: ``{"FSDP_version", "world_size"}``;
* ``huggingface/``: the model's ``config.json`` (and its tokenizer), which the model is built from.

The run keeps ``global_step_<N>/actor/`` per save and names the newest in ``latest_checkpointed_iteration.txt``.
veRL loads only the world size it saved at (it opens ``..._world_size_<its own W>_...``), so a job moved to another
number of GPUs cannot resume; osdpipe reads the folder at any world size, without veRL's code, and writes what a
PyTorch job of any world size loads. What each part becomes: the model's weights and the optimizer's state convert;
``huggingface/`` is copied beside the output; ``fsdp_config.json`` describes veRL's own files and is left out; each
rank's extra state (its scheduler's and RNG states) is left out, and the report says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from osdpipe.io.checkpoints.base import (
    Carrying,
    CheckpointLayout,
    Entry,
    ModelNaming,
    Part,
    WholeCheckpoint,
    register,
)
from osdpipe.io.remote_input import as_path

if TYPE_CHECKING:  # annotations only: reading imports torch
    from osdpipe.layout.tree import ModuleTree

#: What says which FSDP and how many ranks saved the folder.
FSDP_CONFIG = "fsdp_config.json"
#: The run folder's file naming the newest ``global_step_<N>``.
LATEST = "latest_checkpointed_iteration.txt"
#: The folder of the model's Hugging Face config (and tokenizer).
HF_DIR = "huggingface"
#: A veRL Megatron backend's folder holds this instead.
MEGATRON_CONTENTS = "ckpt_contents.json"
_FILE = re.compile(r"(model|optim|extra_state)_world_size_([1-9]\d*)_rank_(0|[1-9]\d*)\.pt")
#: Which role's folder of a ``global_step_<N>`` is read where the command names the step (or the run).
ROLES = ("actor", "critic")


def _error(message: str) -> Exception:
    from osdpipe.io.formats.base import InputError  # torch: only where a checkpoint is read

    return InputError(message)


def _rank_files(folder: Path) -> dict[str, dict[int, dict[int, Path]]]:
    """The folder's rank files: by kind (``model``, ``optim``, ``extra_state``), world size, rank."""
    out: dict[str, dict[int, dict[int, Path]]] = {}
    for p in folder.iterdir():
        if found := _FILE.fullmatch(p.name):
            kind, world, rank = found.group(1), int(found.group(2)), int(found.group(3))
            out.setdefault(kind, {}).setdefault(world, {})[rank] = p
    return out


def saved_world(folder: Path) -> tuple[int, int]:
    """``(world size, FSDP version)`` of the veRL checkpoint ``folder``, once its files agree.

    Raises:
        InputError: one line naming the file: a Megatron backend's folder, no ``fsdp_config.json`` or one that is not
            veRL's, files of two world sizes, a world size ``fsdp_config.json`` contradicts, FSDP1, a missing rank file.
    """
    if (folder / MEGATRON_CONTENTS).is_file():
        raise _error(
            f"{folder / MEGATRON_CONTENTS}: a veRL Megatron backend's checkpoint: not supported yet (its model/ and "
            "optimizer/ are Megatron-Core dist_checkpointing saves); convert the FSDP backend's actor/ folder"
        )
    config_path = folder / FSDP_CONFIG
    if not config_path.is_file():
        raise _error(f"{folder} has no {FSDP_CONFIG}; point input.path at a veRL checkpoint's actor/ or critic/ folder")
    try:
        config = json.loads(config_path.read_text())
        world, version = int(config["world_size"]), int(config["FSDP_version"])
    except (ValueError, KeyError, TypeError):
        raise _error(
            f"{config_path} is not veRL's (it holds no FSDP_version and world_size); is it a veRL checkpoint?"
        ) from None
    files = _rank_files(folder)
    worlds = sorted({w for by_world in files.values() for w in by_world})
    if len(worlds) > 1:
        raise _error(
            f"{folder} holds the files of world sizes {', '.join(map(str, worlds))} together: two saves mixed; keep "
            f"those of the one {FSDP_CONFIG} names (world_size={world})"
        )
    if worlds and worlds[0] != world:
        raise _error(
            f"{config_path} says world_size={world}, but the rank files are of world size {worlds[0]} "
            f"(model_world_size_{worlds[0]}_rank_0.pt ...): the folder is not one save; put back its own {FSDP_CONFIG}"
        )
    if version != 2:
        raise _error(
            f"{config_path}: FSDP_version={version}: a veRL FSDP1 checkpoint (ShardedTensor state) is not supported "
            "yet; FSDP2 (actor.strategy=fsdp2) is"
        )
    # the optimizer's files may be absent altogether (checkpoint.save_contents without it): a model-only checkpoint
    for kind, required in (("model", True), ("optim", False)):
        held = files.get(kind, {}).get(world, {})
        if not held and not required:
            continue
        missing = [r for r in range(world) if r not in held]
        if missing:
            raise _error(
                f"{folder / f'{kind}_world_size_{world}_rank_{missing[0]}.pt'} is missing ({len(held)} of the "
                f"{world} ranks' {kind} files are there); copy every rank's files of the save"
            )
    return world, version


def _tensors(path: Path) -> int:
    """How many tensors one rank's file holds (loaded memory-mapped: its metadata alone is read)."""
    from osdpipe.io.formats.safe_load import load_torch_file  # torch: only where a checkpoint is read

    state = load_torch_file(path)
    values = state.get("state", {}).values() if isinstance(state.get("state"), dict) else [state]
    return sum(1 for v in values if isinstance(v, dict) for t in v.values() if hasattr(t, "shape") and t.dim() > 0)


def _step_of(folder: Path) -> int | None:
    """The step of ``global_step_<N>/<role>``, as the folder names it."""
    found = re.fullmatch(r"global_step_(\d+)", folder.parent.name)
    return int(found.group(1)) if found else None


@register
class Verl(CheckpointLayout):
    name = "verl"
    looks_like = (
        "a veRL FSDP checkpoint folder (fsdp_config.json, model_/optim_/extra_state_world_size_<W>_rank_<r>.pt, "
        "huggingface/), written in PyTorch's layout"
    )
    input_formats = ("verl",)
    output_formats = ()
    written_as = "pytorch"
    saves_step = True  # the global_step_<N> folder its role's folder is in (a folder elsewhere says none)

    def recognizes(self, path: Path) -> bool:
        return path.is_dir() and (path / FSDP_CONFIG).is_file() and bool(_rank_files(path))

    def refuses_source_kind(self, kind: Any) -> str | None:
        return (
            "checkpoint=verl: osdpipe reads veRL's checkpoints but does not train a veRL job itself; "
            "give input.path=<the global_step_<N>/actor folder>"
        )

    def newest_in(self, path: str) -> str | None:
        """The run's folder: the ``global_step_<N>`` its ``latest_checkpointed_iteration.txt`` names; a step's folder:
        its actor's (else its critic's) folder."""
        folder = as_path(path)
        if (folder / LATEST).is_file():
            try:
                folder = folder / f"global_step_{int((folder / LATEST).read_text().strip())}"
            except ValueError:
                return None  # reading the folder then says what is wrong, in one line
        role = next((folder / r for r in ROLES if (folder / r / FSDP_CONFIG).is_file()), None)
        return str(role) if role is not None and role != as_path(path) else None

    def model_from_files(
        self, path: str, written_in: CheckpointLayout | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """transformers' model of ``huggingface/config.json``, as the HF Trainer's checkpoints are built
        (:func:`osdpipe.io.hf_folder.model_from_config`); ``None`` for a config of another model."""
        from osdpipe.io import hf_folder  # torch: only where a checkpoint is read

        config = as_path(path) / HF_DIR
        return (hf_folder.MODEL_FROM_CONFIG, {"path": str(config)}) if hf_folder.config_builds_a_model(config) else None

    def model_naming(self, path: Path) -> ModelNaming:
        """None where ``huggingface/config.json`` builds the model (:meth:`model_from_files`), else the user's own."""
        return ModelNaming(()) if self.model_from_files(str(path)) is not None else ModelNaming.users_own()

    def read(self, path: Path) -> WholeCheckpoint:
        world, version = saved_world(path)
        files = _rank_files(path)
        entries = []
        for kind, name, part in (("model", "model", "model"), ("optim", "optim", "optimizer")):
            held = files.get(kind, {}).get(world, {})
            if held:
                entries.append(Entry(name, part, f"{kind}_world_size_{world}_rank_<r>.pt x {world}",
                                     sum(p.stat().st_size for p in held.values()), _tensors(held[0])))
        for rank, p in sorted(files.get("extra_state", {}).get(world, {}).items()):
            entries.append(Entry(f"extra_state.rank_{rank}", "other", p.name, p.stat().st_size, source_rank=rank))
        entries.append(Entry(FSDP_CONFIG, "framework", FSDP_CONFIG, (path / FSDP_CONFIG).stat().st_size))
        entries += [Entry(name, "other", name, (path / name).stat().st_size) for name in self._carried_files(path)]
        optimizer = bool(files.get("optim"))
        notes = [f"veRL FSDP{version} checkpoint of {world} rank(s)"]
        if not optimizer:
            notes.append("model only: no optimizer state; it converts to a model-only checkpoint")
        return WholeCheckpoint(
            self.name, str(path), tuple(entries), str(path) if optimizer else None, None, "nested", tuple(notes)
        )

    @staticmethod
    def _carried_files(path: Path) -> list[str]:
        """``huggingface/``'s files, relative to the folder: copied beside the output."""
        hf = path / HF_DIR
        return sorted(str(p.relative_to(path)) for p in hf.rglob("*") if p.is_file()) if hf.is_dir() else []

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part | None:
        folder = as_path(path)
        saved_world(folder)  # the files agree, else one line says which
        return Part(str(folder), "verl", "") if _rank_files(folder).get("optim") else None

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        """Each rank's ``model.state_dict()`` file, laid out as the FSDP2 job of the world the folder says
        (:class:`~osdpipe.io.checkpoints.rank_weights.RankFileWeights`)."""
        from osdpipe.io.checkpoints.rank_weights import RankFileWeights  # torch: only where a checkpoint is read
        from osdpipe.io.formats.verl import MODEL_NAMING
        from osdpipe.layout.ranges import LayoutSpec

        world, _ = saved_world(as_path(path))
        source = getattr(optimizer, "source", None) or LayoutSpec(kind="fsdp2", world_size=world)
        return RankFileWeights(path, tree, source, MODEL_NAMING)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """``huggingface/``'s files, copied; each rank's extra state is left out (the report says why)."""
        folder = as_path(path)
        read = self.read(folder)
        left_out = (
            "left out: veRL's learning-rate scheduler state and RNG states of one rank of the saving world; the "
            "output's job starts its scheduler and RNG afresh (set its scheduler's step from the step you resume at)"
        )
        said = {e.name: left_out for e in read.entries if e.name.startswith("extra_state.")}
        return Carrying(
            str(folder), files=tuple(self._carried_files(folder)), entries=read.entries, layout=self.name,
            optimizer=read.optimizer_path is not None, step=_step_of(folder), said=said,
        )
