"""``deepspeed``: a DeepSpeed ZeRO save (stage 1, 2 or 3, any world size), read as each parameter's full, FQN-keyed
state; an input only.

A ZeRO save folder holds ``latest`` (the newest tag) and one folder per tag,
``global_step<N>/``: ``mp_rank_00_model_states.pt`` (stage 3:
``zero_pp_rank_<r>_mp_rank_00_model_states.pt``), whose ``param_shapes``
name every optimized parameter and its shape in the order of the flat
buffers, and one optimizer file per data-parallel rank,
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (``bf16_`` first for
DeepSpeed's bf16 optimizer): that rank's partition of the fp32 master
weights and of the optimizer's state, one flat tensor per group
(:mod:`osdpipe.layout.zero` says where each element is).

The optimizer files pickle DeepSpeed's own objects, so they are read with
:func:`~osdpipe.io.formats.inert_load.load_inert`: DeepSpeed need not be
installed, and nothing in a file runs. Everything is read from the files:
the stage, the world size, the param groups and their hyperparameters, the
parameters' names and shapes, the step. The reader serves each parameter's
state as :class:`~osdpipe.io.formats.base.SourceReader` ranges cut from the
memory-mapped flat partitions, so a target rank reads only what it holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from osdpipe.io import fetched_memory
from osdpipe.io.formats.base import (
    Format,
    IdGroups,
    InputError,
    SourceMeta,
    SourceReader,
    TensorRef,
    describe_value,
    mapped_range,
    release_mapped,
)
from osdpipe.io.formats.inert_load import Record, load_inert
from osdpipe.io.formats.state_facts import describe_meta
from osdpipe.io.remote_input import as_path
from osdpipe.layout.flat_buffer import Held, held_in
from osdpipe.layout.ranges import LayoutSpec
from osdpipe.layout.tree import ModuleTree
from osdpipe.layout.zero import pieces_by_parameter, saved_lengths

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts

#: The file of a save folder that names its newest tag.
LATEST = "latest"
_OPTIMIZER_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
#: The packages whose pickled objects come out as records (:class:`~osdpipe.io.formats.inert_load.Record`).
DESCRIBED = ("deepspeed",)
WHAT = "a DeepSpeed ZeRO checkpoint file"
#: The state name :class:`ZeroReader` serves the fp32 master weights under, beside the optimizer's own (the model's
#: weights of a whole conversion).
MASTER_WEIGHTS = "fp32"


def tag_folder(path: str | Path) -> Path:
    """The ``global_step<N>`` folder of a save: ``path`` itself, or the one its ``latest`` file names.

    Raises:
        InputError: neither.
    """
    p = as_path(path)
    if not p.is_dir():
        raise InputError(
            f"{p} is not a directory; point input.path at a DeepSpeed save folder (with {LATEST}) "
            "or one of its global_step<N> folders"
        )
    if any(_OPTIMIZER_FILE.fullmatch(c.name) for c in p.iterdir()):
        return p
    latest = p / LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        if (p / tag).is_dir():
            return p / tag
        raise InputError(
            f"{latest} names {tag!r}, which is not a folder of {p}; "
            "point input.path at the global_step<N> folder to convert"
        )
    raise InputError(
        f"{p} holds no zero_pp_rank_<r>_mp_rank_00_optim_states.pt and no {LATEST} file; "
        "point input.path at a DeepSpeed ZeRO save folder"
    )


#: Files only a model- (tensor-) or pipeline-parallel DeepSpeed job writes.
_PARALLEL_FILE = re.compile(r"(?:.*mp_rank_0*[1-9]\d*_.*|layer_\d+-model_\d+-model_states)\.pt")


def optimizer_files(folder: Path) -> list[Path]:
    """Each rank's optimizer file, by rank; every rank of the saving world must be there.

    Raises:
        InputError: a rank's file is missing, or the save is of a model- or pipeline-parallel job.
    """
    parallel = sorted(c.name for c in folder.iterdir() if _PARALLEL_FILE.fullmatch(c.name))
    if parallel:
        raise InputError(
            f"{folder / parallel[0]}: a DeepSpeed job with tensor (mp_rank_01 and up) or pipeline (layer_<i>) "
            "parallelism saved this folder; osdpipe reads data-parallel ZeRO saves only, not yet these: "
            "convert it with DeepSpeed's ds_to_universal, or save from a data-parallel job"
        )
    found = {int(m[1]): c for c in folder.iterdir() if (m := _OPTIMIZER_FILE.fullmatch(c.name))}
    missing = sorted(set(range(max(found, default=-1) + 1)) - set(found))
    if not found or missing:
        raise InputError(
            f"{folder} lacks the optimizer file of rank(s) {missing or [0]} "
            f"({optimizer_file_pattern(found.values())}); re-copy the whole folder"
        )
    return [found[r] for r in range(len(found))]


def optimizer_file_pattern(files: Iterable[Path]) -> str:
    """The optimizer files' name as this save names them, rank left open: a bf16 save's carry ``bf16_`` first
    (DeepSpeed's BF16_Optimizer), so that an error names the files the user will look for."""
    bf16 = any(f.name.startswith("bf16_") for f in files)
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_<r>_mp_rank_00_optim_states.pt"


def model_states(folder: Path) -> dict[str, Any]:
    """The folder's model-states file (rank 0's, in stage 3): the module's state dict, ``param_shapes`` and
    DeepSpeed's own entries."""
    for name in _MODEL_STATES:
        if (folder / name).is_file():
            return load_inert(folder / name, DESCRIBED, what=WHAT)
    raise InputError(
        f"{folder} holds neither {' nor '.join(_MODEL_STATES)}, which name the parameters; re-copy the whole folder"
    )


def _value(x: Any) -> Any:
    return x.value if isinstance(x, Record) else x


@dataclass
class ZeroSave:
    """What a ZeRO save's files say of its layout (no tensor bytes read).

    Attributes:
        folder: the ``global_step<N>`` folder.
        stage: 1, 2 or 3.
        world_size: the data-parallel ranks that saved it (one optimizer file each).
        flat_groups: per flat tensor (stage 1/2: a param group; stage 3: a sub group), each parameter's name and numel,
            in flat order.
        paddings: stage 1/2 with ``parameter_alignment``: the padding after each parameter of each flat group (else
            empty).
        shapes: each optimized parameter's shape.
        groups: each param group's hyperparameters (its ``params``: the flat groups it holds).
        files: each rank's optimizer file, by rank.
    """

    folder: Path
    stage: int
    world_size: int
    flat_groups: list[list[tuple[str, int]]]
    paddings: list[list[int]]
    shapes: dict[str, tuple[int, ...]]
    groups: list[dict[str, Any]]
    files: list[Path]

    def group_fqns(self) -> list[list[str]]:
        """Each param group's parameters, by name, in flat order."""
        return [[name for flat in g["params"] for name, _ in self.flat_groups[flat]] for g in self.groups]


def base_state(osd: dict[str, Any], where: Path) -> tuple[dict[str, Any], list[torch.Tensor], int]:
    """From one rank's optimizer file: the wrapped torch optimizer's ``state_dict()``, the fp32 partition per flat
    group, and the stage."""
    inner = osd.get("optimizer_state_dict") if isinstance(osd, dict) else None
    if not isinstance(inner, dict):
        raise InputError(
            f"{where} holds no 'optimizer_state_dict'; it is not a ZeRO optimizer file: "
            "point input.path at a DeepSpeed save folder"
        )
    if "fp32_flat_groups" in inner:  # stage 3
        return inner["optimizer_state_dict"], list(inner["fp32_flat_groups"]), 3
    base = inner.get("base_optimizer_state")
    if not isinstance(base, dict):
        raise InputError(
            f"{where} keeps its optimizer state per group as a list (ZeRO's elastic_checkpoint), "
            "which records no parameter's place; save with zero_optimization.elastic_checkpoint=false, "
            "or convert it with DeepSpeed's ds_to_universal first"
        )
    # ZeroStageEnum's value is the stage; DeepSpeed's bf16 optimizer (stage 1) records none
    stage = int(_value(inner.get("zero_stage")) or 1)
    return base, list(inner["single_partition_of_fp32_groups"]), stage


def saved_world_size(osd: dict[str, Any]) -> int | None:
    """The data-parallel world that saved an optimizer file, as the file records it (``partition_count``: per group
    in stage 1/2, one in stage 3)."""
    count = osd["optimizer_state_dict"].get("partition_count")
    counts = (
        {int(c) for c in count}
        if isinstance(count, (list, tuple))
        else {int(count)} if count is not None else set()
    )
    return counts.pop() if len(counts) == 1 else None


def read_save(path: str | Path) -> ZeroSave:
    """The layout of the ZeRO save at ``path`` (a save folder or a ``global_step<N>`` folder), from rank 0's files.

    Raises:
        InputError: a file is missing, damaged, unsafe, or not what a ZeRO save holds.
    """
    folder = tag_folder(path)
    files = optimizer_files(folder)
    model = model_states(folder)
    shapes_per_flat = model.get("param_shapes")
    if not isinstance(shapes_per_flat, list):
        raise InputError(
            f"{folder}: its model states file holds no param_shapes list; it is not a ZeRO save osdpipe can place"
        )
    first = load_inert(files[0], DESCRIBED, what=WHAT)
    base, fp32, stage = base_state(first, files[0])
    world = saved_world_size(first)
    if world is not None and world != len(files):
        raise InputError(
            f"{folder}: {files[0].name} records a world of {world} rank(s), but the folder holds {len(files)} "
            f"optimizer file(s) ({optimizer_file_pattern(files)}, r = 0..{world - 1}); re-copy the whole folder"
        )
    if len(shapes_per_flat) != len(fp32):
        raise InputError(
            f"{folder}: param_shapes lists {len(shapes_per_flat)} groups, "
            f"{files[0].name} {len(fp32)} flat partitions; re-copy the whole folder"
        )
    flat_groups = [
        [(name, int(torch.Size(shape).numel())) for name, shape in group.items()] for group in shapes_per_flat
    ]
    shapes = {name: tuple(shape) for group in shapes_per_flat for name, shape in group.items()}
    paddings: list[list[int]] = []
    if stage < 3:
        paddings = [list(p) for p in first["optimizer_state_dict"].get("param_alignment_paddings") or []]
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in base["param_groups"]
    ]
    return ZeroSave(folder, stage, len(files), flat_groups, paddings, shapes, groups, files)


class ZeroReader:
    """Reads a ZeRO save as each parameter's full state: ranges cut from every rank's memory-mapped flat partitions."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.save = read_save(path)
        self.pieces: dict[str, list[Held]] = pieces_by_parameter(
            self.save.flat_groups, self.save.world_size, self.save.stage, self.save.paddings
        )
        self._opened: dict[int, tuple[dict[str, Any], list[torch.Tensor]]] = {}
        self._checked = False

    def _open(self, rank: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Rank ``rank``'s optimizer state and fp32 partitions, read (memory-mapped) and checked against rank 0's
        layout.

        Raises:
            InputError: the file is damaged, or of another save: another stage, world size, or partitions of other
                sizes.
        """
        path = self.save.files[rank]
        osd = load_inert(path, DESCRIBED, what=WHAT)
        base, fp32, stage = base_state(osd, path)
        world = saved_world_size(osd)
        if stage != self.save.stage or world not in (None, self.save.world_size):
            raise InputError(
                f"{path}: rank {rank}'s file records ZeRO stage {stage} on {world} rank(s), "
                f"rank 0's stage {self.save.stage} on {self.save.world_size}: "
                "the folder mixes files of different saves; re-copy it from one save"
            )
        for flat, master in enumerate(fp32):
            numels = [n for _, n in self.save.flat_groups[flat]]
            paddings = self.save.paddings[flat] if self.save.paddings else ()
            padded, unpadded = saved_lengths(numels, self.save.world_size, self.save.stage, rank, paddings)
            held = {MASTER_WEIGHTS: (master, {padded, unpadded})}
            held.update(
                {n: (v, {padded}) for n, v in base["state"].get(flat, {}).items() if torch.is_tensor(v) and v.dim() > 0}
            )
            wrong = [(n, v.numel(), want) for n, (v, want) in held.items() if v.numel() not in want]
            if wrong:
                name, numel, want = wrong[0]
                raise InputError(
                    f"{path}: its {name} partition of group {flat} holds {numel} elements, "
                    f"where the parameters rank 0's files name take {' or '.join(map(str, sorted(want)))}: "
                    "the file is not of this save; re-copy the whole folder from one save"
                )
        return base, [t.detach() for t in fp32]  # saved as the parameters of DeepSpeed's inner optimizer: requires_grad

    def _rank(self, rank: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if rank not in self._opened:
            self._opened[rank] = self._open(rank)
        return self._opened[rank]

    def check_files(self) -> None:
        """Open every rank's file once and check it (:meth:`_open`), keeping none open but rank 0's: a damaged or
        foreign file is said before the conversion starts, not by the rank that reads it later."""
        if not self._checked:
            for rank in range(1, self.save.world_size):
                if rank not in self._opened:
                    self._open(rank)
            self._checked = True

    def _flat(self, rank: int, flat: int, name: str) -> torch.Tensor:
        base, fp32 = self._rank(rank)
        return fp32[flat] if name == MASTER_WEIGHTS else base["state"][flat][name]

    def _flat_of(self, fqn: str) -> int:
        return self.pieces[fqn][0].where[1]

    def meta(self) -> SourceMeta:
        """The state and param groups, from rank 0's file; every other rank's file is checked first
        (:meth:`check_files`)."""
        base, _ = self._rank(0)
        self.check_files()
        state: dict[str, dict[str, Any]] = {}
        for fqn, shape in self.save.shapes.items():
            if fqn not in self.pieces:  # a parameter of no element (numel 0)
                continue
            entry = base["state"].get(self._flat_of(fqn), {})
            state[fqn] = {
                name: (
                    TensorRef(shape, str(value.dtype).removeprefix("torch."))
                    if torch.is_tensor(value) and value.dim() > 0
                    else describe_value(value)
                )
                for name, value in entry.items()
            }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
            for g, fqns in zip(self.save.groups, self.save.group_fqns())
        ]
        return SourceMeta(state=state, param_groups=groups)

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        return {
            (fqn, name): self.read_range(fqn, name, 0, math.prod(self.save.shapes[fqn]))
            .clone()
            .view(self.save.shapes[fqn])
            for fqn, name in items
        }

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        parts = [
            mapped_range(self._flat(*p.where, name), p.offset, p.offset + p.length)
            for p in held_in(self.pieces[fqn], start, stop)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        for p in held_in(self.pieces[fqn], start, stop):
            release_mapped(self._flat(*p.where, name), p.offset, p.offset + p.length)

    def expect(self, reads: list[tuple[str, str, int, int]]) -> None:
        """The reads to come, told ahead: files in object storage fetch their pages ahead."""
        fetched_memory.plan(
            [
                (self._flat(*p.where, name), p.offset, p.offset + p.length)
                for fqn, name, start, stop in reads
                for p in held_in(self.pieces[fqn], start, stop)
            ]
        )


class DeepSpeed(Format):
    """A DeepSpeed ZeRO save folder: read, never written (a DeepSpeed job continues as another layout or framework)."""

    name = "deepspeed"
    keyed_by_id = False
    directory = True
    generated_name = "global_step0"
    looks_like = "a DeepSpeed ZeRO save (zero_pp_rank_<r>_mp_rank_00_optim_states.pt files)"
    written = False
    universal_converter = "deepspeed.checkpoint.ds_to_universal"

    def output_path(self, directory: Path, rank: int) -> Path:
        raise NotImplementedError("osdpipe reads DeepSpeed checkpoints; it does not write them")

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        return ZeroReader(path)

    def found_in(self, directory: Path) -> bool:
        return any(_OPTIMIZER_FILE.fullmatch(c.name) for c in directory.iterdir()) or (
            (directory / LATEST).is_file() and (directory / (directory / LATEST).read_text().strip()).is_dir()
        )

    def files_per_rank(self, world_size: int) -> str | None:
        return f"zero_pp_rank_<r>_mp_rank_00_optim_states.pt, r = 0..{world_size - 1}"

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        """The stage, world size, optimizer and param groups (by name), from rank 0's optimizer file and the model
        states."""
        reader = ZeroReader(str(path))
        describe_meta(facts, reader.meta())
        save = reader.save
        facts.world_size = save.world_size
        facts.notes.append(
            f"DeepSpeed ZeRO stage {save.stage} on {save.world_size} rank(s), {save.folder.name}: "
            "the fp32 master weights and the optimizer's state per parameter"
        )
