"""verl: a veRL FSDP checkpoint as a whole training checkpoint, read and written for a job of another world size.

veRL's ``FSDPCheckpointManager`` saves an actor (or critic) as one folder, every rank's files in it:

* ``model_world_size_<W>_rank_<r>.pt``: the rank's ``model.state_dict()``, each parameter a DTensor shard of dim 0
  (FSDP1's, veRL's default ``actor.strategy=fsdp``: a ``ShardedTensor`` of the same chunk);
* ``optim_world_size_<W>_rank_<r>.pt``: its ``optimizer.state_dict()`` (:mod:`osdpipe.io.formats.verl`; FSDP1's: of
  its flat parameters);
* ``extra_state_world_size_<W>_rank_<r>.pt``: its learning-rate scheduler's state and its RNG states;
* ``fsdp_config.json``: ``{"FSDP_version", "world_size"}``;
* ``huggingface/``: the model's ``config.json`` (and its tokenizer), which the model is built from.

The run keeps ``global_step_<N>/actor/`` per save and names the newest in ``latest_checkpointed_iteration.txt``. veRL
loads only the world size it saved at (it opens ``..._world_size_<its own W>_...``), so a job moved to another number of
GPUs cannot resume. osdpipe reads the folder at any world size, without veRL's code, and writes it again for M ranks
(:mod:`osdpipe.io.checkpoints.verl_files`: each rank's DTensors on the M-rank job's mesh; an FSDP1 actor's as an FSDP2
one's), what veRL's own manager loads in that job; or in PyTorch's layout or another framework's
(``output.checkpoint=...``). What each part becomes: the model's weights and the optimizer's state convert;
``huggingface/`` is copied; written as veRL's, each target rank takes the extra state of its own rank of the saving
world, or of ``rank mod W`` beyond it, and ``fsdp_config.json`` names the new world size; written as another layout,
both are left out, and the report says so.
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
    if version not in (1, 2):
        raise _error(
            f"{config_path}: FSDP_version={version}: veRL saves FSDP_version 1 (actor.strategy=fsdp) or 2 (fsdp2); "
            "is it veRL's?"
        )
    # the optimizer's (and the extra state's) files may be absent altogether (checkpoint.save_contents without them)
    for kind, required in (("model", True), ("optim", False), ("extra_state", False)):
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


def _tensors(path: Path, fsdp_version: int) -> int:
    """How many tensors one rank's file holds (loaded memory-mapped: its metadata alone is read); an FSDP1 model
    file's ``ShardedTensor`` counted as one each."""
    # torch: only where a checkpoint is read
    from osdpipe.io.checkpoints.rank_weights import load_fsdp1_model_file
    from osdpipe.io.formats.safe_load import load_torch_file

    fsdp1_model = fsdp_version == 1 and path.name.startswith("model_")
    state = load_fsdp1_model_file(path) if fsdp1_model else load_torch_file(path)
    if fsdp1_model:
        return len(state)
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
        "huggingface/)"
    )
    input_formats = ("verl",)
    output_formats = ("verl",)
    saves_step = True  # the global_step_<N> folder its role's folder is in (a folder elsewhere says none)
    made_as_written = True  # each rank's tensors one record each, DTensors around the local tensors written

    def output_format_of(self, input_format: str) -> str | None:
        """veRL's folder is written as veRL's rank files."""
        return "verl"

    def refuses_keys(self, path: str, given: Any, raw: dict[str, Any]) -> str | None:
        """Written as veRL's own (``output.checkpoint`` unset or ``verl``): a source job whose meshes osdpipe cannot
        make DTensors on here, or of more than one dimension (:mod:`osdpipe.io.checkpoints.verl_files`)."""
        from osdpipe.io.checkpoints import verl_files
        from osdpipe.io.formats.base import InputError
        from osdpipe.io.formats.verl import MODEL_NAMING

        if (raw.get("output") or {}).get("checkpoint") not in (None, self.name):  # unset: its own (written_as)
            return None
        folder = as_path(path)
        world, version = saved_world(folder)
        try:
            spec = verl_files.source_mesh(folder / MODEL_NAMING.name(0, world), version)
        except InputError as exc:
            return str(exc)
        why = verl_files.refuses_device(spec)
        return None if why is None else f"{folder}: {why}"

    def advice(self, path: str, target: dict[str, Any], output_format: str) -> list[str]:
        """Into veRL's own folder: an FSDP1 actor's becomes an FSDP2 job's (the resuming job sets
        ``actor.strategy=fsdp2``); a world larger than the saving one repeats RNG streams."""
        folder = as_path(path)
        world, version = saved_world(folder)
        out = []
        if version == 1:
            out.append(f"{folder} is an FSDP1 actor's (actor.strategy=fsdp); the output is veRL's FSDP2 folder "
                       "(osdpipe writes no ShardedTensor files): resume it with actor.strategy=fsdp2 (and "
                       "critic.strategy=fsdp2 for a critic)")
        if int(target.get("world_size") or 0) > world:
            out.append(f"RNG states: target rank r takes saving rank r mod {world}'s, so the ranks beyond the {world} "
                       "that saved it draw the same random numbers as the rank they repeat")
        return out

    def refuses_output(self, source: CheckpointLayout, written: Any, target_kind: Any) -> str | None:
        """Written from a veRL checkpoint only, for an FSDP2 job: its files' DTensors lie on the source job's kind of
        mesh (:func:`~osdpipe.io.checkpoints.verl_files.source_mesh`), which another layout's files do not say."""
        if (why := super().refuses_output(source, written, target_kind)) is not None:
            return why
        if source is not self:
            return (
                f"output.checkpoint=verl is written from a veRL checkpoint (checkpoint=verl) only so far, not from "
                f"checkpoint={source.name}; write output.checkpoint=pytorch"
            )
        if not target_kind.dtensor_state:
            return (
                f"output.checkpoint=verl with target.kind={target_kind.name}: veRL's FSDP2 files hold DTensors; "
                "set target.kind=fsdp2"
            )
        return None

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

    def gpt_config(self, path: str, named: Any = None) -> dict[str, Any] | None:
        """``huggingface/config.json``: the GPT another framework's model of the checkpoint (Megatron's) is made of."""
        from osdpipe.io import hf_folder  # torch: only where a checkpoint is read

        config = as_path(path) / HF_DIR
        return hf_folder.read_config(str(config)) if (config / hf_folder.CONFIG).is_file() else None

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
                                     sum(p.stat().st_size for p in held.values()), _tensors(held[0], version)))
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
        (:class:`~osdpipe.io.checkpoints.rank_weights.RankFileWeights`): an FSDP1 job's ``SHARDED_STATE_DICT`` holds
        the same dim-0 chunks, as ``ShardedTensor``."""
        # torch: only where a checkpoint is read
        from osdpipe.io.checkpoints.rank_weights import RankFileWeights, load_fsdp1_model_file, load_model_file
        from osdpipe.io.formats.verl import MODEL_NAMING
        from osdpipe.layout.ranges import LayoutSpec

        world, version = saved_world(as_path(path))
        if version == 1:  # FSDP1's SHARDED_STATE_DICT: ShardedTensors of dim-0 chunks, FSDP2's placement
            return RankFileWeights(path, tree, LayoutSpec(kind="fsdp2", world_size=world), MODEL_NAMING,
                                   load_fsdp1_model_file)  # fmt: skip
        source = getattr(optimizer, "source", None) or LayoutSpec(kind="fsdp2", world_size=world)
        return RankFileWeights(path, tree, source, MODEL_NAMING, load_model_file)

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """``huggingface/``'s files, copied; each rank's extra state goes to the target ranks it becomes in veRL's own
        layout (:meth:`finish`), and is left out of another (the report says which)."""
        folder = as_path(path)
        read = self.read(folder)
        world, _ = saved_world(folder)
        if written_in is None or written_in is self:
            said = {
                e.name: (
                    f"copied: target rank r takes the extra state (scheduler, RNG states) of saving rank r, or of "
                    f"rank r mod {world} beyond the {world} that saved it (whose RNG streams it then repeats)"
                )
                for e in read.entries if e.name.startswith("extra_state.")
            }
            said[FSDP_CONFIG] = "written anew: the target's world size, FSDP_version 2 (the files written are FSDP2's)"
        else:
            left_out = (
                "left out: veRL's learning-rate scheduler state and RNG states of one rank of the saving world; the "
                "output's job starts its scheduler and RNG afresh (set its scheduler's step from the step you resume "
                "at)"
            )
            said = {e.name: left_out for e in read.entries if e.name.startswith("extra_state.")}
        return Carrying(
            str(folder), files=tuple(self._carried_files(folder)), entries=read.entries, layout=self.name,
            optimizer=read.optimizer_path is not None, step=_step_of(folder), said=said,
        )

    # ------------------------------------------------------------------ writing

    def _mesh(self, carrying: Carrying, shared: dict[str, Any]) -> Any:
        """The kind of mesh the source job's DTensors lie on, read once per process from its rank 0's model file."""
        from osdpipe.io.checkpoints import verl_files
        from osdpipe.io.formats.verl import MODEL_NAMING

        if _SHARED_MESH not in shared:
            folder = as_path(carrying.source)
            world, version = saved_world(folder)
            spec = verl_files.source_mesh(folder / MODEL_NAMING.name(0, world), version)
            if (why := verl_files.refuses_device(spec)) is not None:
                raise _error(f"{folder}: {why}")
            shared[_SHARED_MESH] = spec
        return shared[_SHARED_MESH]

    def _files(self, parts: Any, rank: int, world_size: int, tree: ModuleTree, spec: Any) -> dict[str, Any]:
        """Target rank ``rank``'s model and optimizer files, by name, as veRL's manager saves them."""
        from osdpipe.io.checkpoints import verl_files
        from osdpipe.io.formats.verl import MODEL_NAMING, NAMING
        from osdpipe.io.weights import model_state_dict

        mesh = verl_files.job_mesh(spec, world_size, rank)
        model = model_state_dict(parts.weights, parts.buffers, tree)
        shapes = {name: param.shape for name in model if (param := tree.resolve(name)) is not None}
        files = {MODEL_NAMING.name(rank, world_size): verl_files.model_file(model, shapes, mesh)}
        if parts.carrying.optimizer:  # a model-only checkpoint stays one
            files[NAMING.name(rank, world_size)] = verl_files.optim_file(parts.optimizer, mesh)
        return files

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
        """Target rank ``rank``'s ``model_...`` and ``optim_world_size_<M>_rank_<r>.pt``: DTensors on the M-rank job's
        mesh around the local tensors, each written as one record (the rank's output made as it is written)."""
        from osdpipe.io.formats.base import RankFiles, write_torch_file

        written = RankFiles()
        for name, content in self._files(parts, rank, world_size, tree, self._mesh(parts.carrying, shared)).items():
            done = write_torch_file(content, staging / name)
            written.files.update(done.files)
            written.tensors.update(done.tensors)
        return written

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[Any], fmt: Any, carrying: Carrying,
        target: Any = None,
    ) -> dict[str, str]:
        """``huggingface/`` copied, each target rank's extra state (:func:`~osdpipe.io.checkpoints.verl_files.
        extra_state_source`'s rank's file, byte for byte) and ``fsdp_config.json`` with the target's world size."""
        import hashlib

        from osdpipe.io.checkpoints import output, verl_files
        from osdpipe.io.formats.verl import EXTRA_NAMING

        folder, world = as_path(carrying.source), len(per_rank)
        saved, _ = saved_world(folder)
        done = output.copy_files(carrying, staging)
        extra = _rank_files(folder).get("extra_state", {}).get(saved, {})
        for rank in range(world) if extra else ():
            name = EXTRA_NAMING.name(rank, world)
            done[name] = output.copy_file(extra[verl_files.extra_state_source(rank, saved)], staging / name)
        config = json.loads((folder / FSDP_CONFIG).read_text()) | {"FSDP_version": 2, "world_size": world}
        data = json.dumps(config).encode()
        (staging / FSDP_CONFIG).write_bytes(data)
        done[FSDP_CONFIG] = hashlib.sha256(data).hexdigest()
        return done

    def load_output(self, model: Any, optim: Any, directory: Path, rank: int, fmt: Any) -> None:
        """Each of the rank's files read as veRL's manager reads them (``torch.load``), its DTensors taken apart and
        laid on the live job's own parameters (:func:`osdpipe.io.loading.load_rank_state`): what ``osdpipe check
        --load`` does, in a world whose meshes are osdpipe's, not the job's."""
        import torch

        from osdpipe.io.formats.safe_load import meshes_quiet
        from osdpipe.io.formats.verl import MODEL_NAMING, NAMING
        from osdpipe.io.loading import load_rank_state
        from osdpipe.io.whole_rank_file import MODEL_PART, OPTIMIZER_PART
        from osdpipe.layout.kinds.fsdp2 import to_rank_local

        world, _ = saved_world(directory)
        optim_path = directory / NAMING.name(rank, world)
        with meshes_quiet():  # the meshes are read as data: the live job's own are the ones it loads onto
            weights = torch.load(directory / MODEL_NAMING.name(rank, world), map_location="cpu", weights_only=True)
            optimizer = torch.load(optim_path, map_location="cpu", weights_only=True)
        loaded = {MODEL_PART: {k: getattr(v, "to_local", lambda v=v: v)() for k, v in weights.items()}}
        loaded[OPTIMIZER_PART] = to_rank_local(optimizer)
        load_rank_state(optim, loaded, str(optim_path), model)

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
        """Where rank ``rank``'s files differ from what they should hold: every local tensor bitwise, every DTensor's
        shape, placements and mesh; its extra state byte for byte; on rank 0, ``huggingface/``'s files."""
        import torch

        from osdpipe.core.compare import diff
        from osdpipe.io.checkpoints import output, verl_files
        from osdpipe.io.formats.safe_load import meshes_quiet
        from osdpipe.io.formats.verl import EXTRA_NAMING

        problems = output.file_differences(directory, parts.carrying) if rank == 0 else []
        files = self._files(parts, rank, world_size, tree, self._mesh(parts.carrying, opened))
        for name, content in files.items():
            if not (directory / name).is_file():
                problems.append(f"{directory / name} is missing")
                continue
            with meshes_quiet():
                got = torch.load(directory / name, map_location="cpu", weights_only=True)
            problems += [f"{directory / name}: {p}" for p in
                         diff(verl_files.local_view(got), verl_files.local_view(content), limit=3)]  # fmt: skip
        folder = as_path(parts.carrying.source)
        saved, _ = saved_world(folder)
        extra = _rank_files(folder).get("extra_state", {}).get(saved, {})
        name = EXTRA_NAMING.name(rank, world_size)
        if extra and (
            not (directory / name).is_file()
            or (directory / name).read_bytes() != extra[verl_files.extra_state_source(rank, saved)].read_bytes()
        ):
            which = verl_files.extra_state_source(rank, saved)
            problems.append(f"{directory / name} is not the saving job's rank {which}'s extra state")
        return problems


#: Where the kind of mesh of the source job is kept in a process's ``shared`` dict (:meth:`Verl._mesh`).
_SHARED_MESH = "verl.mesh"
