"""What every checkpoint format shares: the metadata model, the reader protocol, and errors about input.

Kept apart from :mod:`osdpipe.io.formats` (the registry, which imports every
format) so that a format module imports this and never its own package: no
import cycle.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from osdpipe.core.compare import diff
from osdpipe.core.memory import drop_mapped_pages
from osdpipe.io import fetched_memory
from osdpipe.io.digest import save_hashed
from osdpipe.io.errors import InputError
from osdpipe.io.store import is_remote
from osdpipe.layout.ranges import WEIGHTS, LayoutSpec, LocalTensor
from osdpipe.layout.tree import ModuleTree

if TYPE_CHECKING:  # annotations only: osdpipe.io.file_facts imports the formats
    from osdpipe.io.file_facts import Facts


#: Param groups of the optimizer that saved a param-ID keyed checkpoint, as FQN patterns per group.
IdGroups = list[list[str]] | None


class OtherLayout(InputError):
    """An intact checkpoint that another ``checkpoint=`` layout converts (a Megatron-LM save given as an optimizer's):
    said as it is, with the keys that convert it, before any other rule of the config speaks of its files."""


@dataclass(frozen=True)
class TensorRef:
    """A positive-dimension state tensor, described without its bytes."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class SourceMeta:
    """What every rank needs to know about the source: small, broadcast from rank 0.

    Attributes:
        state: FQN -> state name -> :class:`TensorRef` for positive-dimension
            tensors, or the value itself (0-dim tensors such as Adam's ``step``,
            floats, ``None``).
        param_groups: the FQN-keyed param groups, or ``None`` when absent.
        extra: top-level ``state`` entries that name no parameter (user state).
        buffers: a whole checkpoint's model buffers by canonical name, read whole (no layout cuts them);
            the model's weights are state of each parameter (:data:`osdpipe.io.weights.WEIGHTS`).
    """

    state: dict[str, dict[str, Any]]
    param_groups: list[dict[str, Any]] | None
    extra: dict[str, Any] = field(default_factory=dict)
    #: canonical FQN -> the name the checkpoint uses for it,
    #: where they differ (``module.x``, ``_orig_mod.x``, a tied alias).
    names: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    #: A whole checkpoint's entries besides the model and the optimizer,
    #: as read (:class:`osdpipe.io.weights.WholeSource`); ``None``: an optimizer checkpoint.
    carried: Any = None
    #: What reading the source found that the run's report should say (a warning each): a state the conversion
    #: cannot carry two of, say, and the one it kept.
    notes: list[str] = field(default_factory=list)
    #: The dtype the optimizer keeps its floating state in where that is not each parameter's own: a mixed-precision
    #: optimizer's fp32 master weights and moments beside 16-bit parameters (Megatron's distributed optimizer);
    #: ``None``: the parameter's.
    state_dtype: str | None = None


def describe_value(value: Any) -> Any:
    """A state value as metadata: positive-dim tensors become :class:`TensorRef`, the rest stays."""
    if torch.is_tensor(value) and value.dim() > 0:
        return TensorRef(tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return value


def local_part(value: Any) -> Any:
    """This rank's piece of a DTensor (FSDP2's state and parameters), else the value itself."""
    return value.to_local() if hasattr(value, "to_local") else value


def own_copy(value: Any) -> Any:
    """``value`` with no storage in common with it: a tensor cloned, anything else deep-copied.

    How a parameter gets state of its own from a source that shares one
    object across parameters (FSDP1's FULL state: one ``step`` per unit).
    """
    return value.clone() if torch.is_tensor(value) else copy.deepcopy(value)


class SourceReader(Protocol):
    """A source checkpoint, read lazily."""

    def meta(self) -> SourceMeta:
        """The checkpoint's metadata (called on one rank, then broadcast)."""
        ...

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        """The full tensors of state ``name`` of parameter ``fqn`` for each ``(fqn, name)``."""
        ...

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened state ``name`` of parameter ``fqn``,
        as a 1-D tensor not to be written to.

        A memory-mapped reader gives a view of the file; the others read no
        more than the stored pieces that hold the range.
        """
        ...

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        """Done with that range: a memory-mapped reader lets its pages go
        (see :func:`~osdpipe.core.memory.drop_mapped_pages`)."""
        ...


class RenamedReader:
    """A reader asked by canonical FQN for a checkpoint that names some parameters otherwise
    (see :attr:`SourceMeta.names`)."""

    def __init__(self, reader: SourceReader, names: dict[str, str]) -> None:
        self.reader, self.names = reader, names

    def meta(self) -> SourceMeta:
        return self.reader.meta()

    def read(self, items: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
        got = self.reader.read([(self.names.get(fqn, fqn), name) for fqn, name in items])
        return {(fqn, name): got[(self.names.get(fqn, fqn), name)] for fqn, name in items}

    def read_range(self, fqn: str, name: str, start: int, stop: int) -> torch.Tensor:
        return self.reader.read_range(self.names.get(fqn, fqn), name, start, stop)

    def read_parts(self, fqn: str, name: str, start: int, stop: int) -> list[torch.Tensor]:
        return read_parts(self.reader, self.names.get(fqn, fqn), name, start, stop)

    def release(self, fqn: str, name: str, start: int, stop: int) -> None:
        self.reader.release(self.names.get(fqn, fqn), name, start, stop)

    def expect(self, reads: Iterable[tuple[str, str, int, int]]) -> None:
        expect(self.reader, [(self.names.get(fqn, fqn), name, a, b) for fqn, name, a, b in reads])


def read_parts(reader: Any, fqn: str, name: str, start: int, stop: int) -> list[torch.Tensor]:
    """Elements ``[start, stop)`` of the flattened state ``name`` of parameter ``fqn`` as the pieces the reader
    stores them in hold them, in order: joined, what ``read_range`` gives; not to be written to.

    A reader whose range can span stored pieces (DCP's chunks: every range of a 4 -> 2 conversion spans two) gives
    them apart (its ``read_parts``): joining them writes every element once more, into a tensor made for the range
    and first touched then, only for the caller to copy it where it goes. Any other reader's range is one part.
    """
    parts = getattr(reader, "read_parts", None)
    return parts(fqn, name, start, stop) if parts is not None else [reader.read_range(fqn, name, start, stop)]


def expect(reader: Any, reads: Iterable[tuple[str, str, int, int]]) -> None:
    """Tell ``reader`` the ranges ``(fqn, name, start, stop)`` it is about to be asked for, in that order, where it
    can use them: a reader of object storage fetches them ahead as few requests
    (:meth:`osdpipe.io.formats.dcp_reader.DcpCheckpoint.expect`); empty: it lets go of what it fetched and was not
    asked for. Readers of local files read as they are asked: nothing happens."""
    told = getattr(reader, "expect", None)
    if told is not None:
        told(list(reads))


def mapped_range(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a tensor's flattened view:
    a view when it is contiguous, else a copy of just that range.

    A tensor of a file in object storage has its bytes fetched first (:func:`osdpipe.io.fetched_memory.fetch`).
    """
    fetched_memory.fetch(tensor, start, stop)
    if tensor.is_contiguous():
        return tensor.view(-1)[start:stop]
    return tensor.reshape(-1)[start:stop].clone()  # reshape copies the whole tensor: rare (a file of strided views)


def release_mapped(tensor: torch.Tensor, start: int, stop: int) -> None:
    """Drop the file pages under ``[start, stop)`` of a memory-mapped tensor
    (nothing for a strided one, which was copied); a remote file's are given back (fetched again if asked for)."""
    if fetched_memory.let_go(tensor, start, stop):
        return
    if tensor.is_contiguous():
        drop_mapped_pages(tensor.view(-1)[start:stop])


def full_state(reader: SourceReader, meta: SourceMeta) -> dict[str, Any]:
    """The whole checkpoint ``reader`` reads (described by ``meta``)
    as a full FQN-keyed optimizer state dict, every tensor read.

    The optimizer's alone: a whole checkpoint's model weights (:data:`WEIGHTS`) are not optimizer state.
    """
    optimizer = {f: {n: v for n, v in entries.items() if n != WEIGHTS} for f, entries in meta.state.items()}
    optimizer = {f: entries for f, entries in optimizer.items() if entries}
    items = [(f, n) for f, entries in optimizer.items() for n, v in entries.items() if isinstance(v, TensorRef)]
    tensors = reader.read(items)
    # Scalars the source shares across parameters (FSDP1's one step per unit) are each parameter's own here.
    state = {
        f: {n: tensors[(f, n)] if (f, n) in tensors else own_copy(v) for n, v in entries.items()}
        for f, entries in optimizer.items()
    }
    out: dict[str, Any] = {"state": {**state, **meta.extra}}
    if meta.param_groups is not None:
        out["param_groups"] = meta.param_groups
    return out


@dataclass(frozen=True)
class Shown:
    """A config key the input's files settle (:mod:`osdpipe.spec.reconcile`):
    it takes ``value`` unless the user gave it.

    Given and different, it contradicts the files, which ``shows`` says in
    words (``<path> is ...``). Without ``shows`` the value is only what the
    files imply of a key the user left out, and a given one stands.
    """

    key: str
    value: Any
    shows: str | None = None


@dataclass
class RankFiles:
    """What one target rank wrote: each file's digest, each tensor's sha256,
    and what its format needs to finish (DCP's write results)."""

    files: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, str] = field(default_factory=dict)
    results: list[Any] = field(default_factory=list)


class Format:
    """One checkpoint format: how it is named on disk, keyed, read and written. Subclasses set the class attributes.

    Everything osdpipe does differently per format is asked of its ``Format``
    (see the registry, :mod:`osdpipe.io.formats`); nothing else names a format.
    """

    name: ClassVar[str]
    #: State keyed by the target optimizer's param IDs (``rank_local``, ``plain``), else by canonical FQN.
    keyed_by_id: ClassVar[bool]
    #: The checkpoint is a directory (``input.path`` must be one), else one file.
    directory: ClassVar[bool]
    #: What a generated source of this format is called under ``source/``.
    generated_name: ClassVar[str]
    #: What a checkpoint of this format is, in a few words (``<path> is ...``).
    looks_like: ClassVar[str]

    def output_path(self, directory: Path, rank: int) -> Path:
        """What target rank ``rank`` loads, under an output directory."""
        raise NotImplementedError

    #: Whether osdpipe writes this format
    #: (``False``: an input only, DeepSpeed's, whose jobs continue as another layout).
    written: ClassVar[bool] = True
    #: A hybrid-sharded job's checkpoint holds each replica group's copy of the state (``rank_local``: a file per rank).
    holds_replicas: ClassVar[bool] = False
    #: The target job reads it with ``dcp.load``, which places each rank's piece by PyTorch's own offset helper
    #: (see :meth:`osdpipe.layout.kinds.base.LayoutKind.dcp_load_problem`).
    loaded_by_dcp: ClassVar[bool] = False

    def replica_mismatches(self, path: str, source: Any, ranks: list[int]) -> list[str]:
        """Where each of ``ranks``' files at ``path`` differs from the first replica group's copy of its shard, for a
        format that :attr:`holds_replicas` (``source``: the layout that saved them)."""
        raise NotImplementedError(f"input.format={self.name} holds no replicas")

    #: The saving framework's own converter of this format to a universal checkpoint, as ``python -m`` runs it: the
    #: ``universal`` check holds what osdpipe read against it (``None``: there is none).
    universal_converter: ClassVar[str | None] = None

    #: Its files are written through :mod:`osdpipe.io.torchfile`, storage by storage, so a rank's output can be made as
    #: it is written (:mod:`osdpipe.run.streamed_output`), under ``runtime.memory_budget``.
    made_as_written: ClassVar[bool] = False
    #: Its files hold a model's weights alone, no optimizer (a Hugging Face folder's safetensors): one process's model,
    #: whatever kind of job loads it.
    weights_alone: ClassVar[bool] = False

    def refuses_source(self, kind: Any) -> str | None:
        """Why a checkpoint in this format cannot come from a job of layout ``kind`` (``None``: it can);
        the message names the keys to set."""
        return None

    def refuses_target(self, kind: Any) -> str | None:
        """Why a job of layout ``kind`` cannot load this format (``None``: it can);
        the message names the keys to set."""
        return None

    # What a checkpoint's files show of themselves (osdpipe.io.file_facts)
    # and settle of a user's description of it (osdpipe.spec.reconcile).

    #: Its files hold each rank's own optimizer's local tensors,
    #: which only the source's exact layout places (down to ``source.use_orig_params``).
    local_state: ClassVar[bool] = False
    #: The kind of job that saved a checkpoint of this format unless the user says otherwise
    #: (``None``: the files do not tell).
    source_kind: ClassVar[str | None] = None

    @property
    def found_by(self) -> str:
        """What :meth:`found_in` looks for, in a few words (``<dir> holds neither ... nor ...``):
        by default what a checkpoint of it looks like."""
        return self.looks_like

    def found_in(self, directory: Path) -> bool:
        """Whether ``directory`` holds a checkpoint of this format (never, for a format of one file)."""
        return False

    def read_facts(self, facts: Facts, path: Path, key: str | None) -> None:
        """Fill in what the checkpoint at ``path`` shows of itself,
        from metadata and headers (``key``: a top-level key to read under).

        By default nothing beyond its format: a format whose files say more reads it here.

        Raises:
            InputError: the files cannot be read as this format.
        """

    def refuses_saved_by(self, kind: Any, path: str) -> str | None:
        """Why the files at ``path`` show that a job of ``kind`` did not save them
        (``kind`` ``None``: a name no kind has), as ``<path> is ...: set ...``.

        ``None``: as far as the files show, it may have.
        """
        return None

    def files_per_rank(self, world_size: int) -> str | None:
        """The files a checkpoint of this format saved by ``world_size`` ranks has,
        one per rank, in a few words (``None``: no file per rank)."""
        return None

    def shows(self, facts: Facts, kind: Any) -> list[Shown]:
        """The ``source.*`` keys the files' ``facts`` settle,
        ``kind`` being the source's (``None``: a name no kind has).

        By default the world size, where the files are one per rank.
        """
        files = self.files_per_rank(facts.world_size) if facts.world_size is not None else None
        if files is None:
            return []
        return [
            Shown(
                "source.world_size", facts.world_size, f"{facts.path} was saved by {facts.world_size} rank(s) ({files})"
            )
        ]

    def writes(self, rank: int) -> bool:
        """Whether target rank ``rank`` writes files of its own (else its state is in another rank's)."""
        return True

    @property
    def one_writer(self) -> bool:
        """Rank 0 alone writes the whole checkpoint (one file)."""
        return not self.writes(1)

    def output_layout(
        self, tree: ModuleTree, target: LayoutSpec, rank: int, optimizer_layout: Callable[[], tuple[LocalTensor, ...]]
    ) -> tuple[LocalTensor, ...]:
        """The local tensors target rank ``rank`` holds in this format, for a target job laid out as ``target``
        (``optimizer_layout``: the target optimizer's own)."""
        return optimizer_layout()

    def open(self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups) -> SourceReader:
        """A reader of the checkpoint at ``path`` (see :func:`osdpipe.io.formats.open_source`)."""
        raise NotImplementedError

    def describe(
        self, path: str, key: str, *, tree: ModuleTree, source: LayoutSpec, id_groups: IdGroups
    ) -> SourceReader:
        """A reader of the checkpoint at ``path`` for its metadata alone: what the checks before any process starts
        ask (:func:`osdpipe.io.formats.inspect_source`, :func:`osdpipe.run.stages.load.inspect_input`), whose
        :meth:`~SourceReader.meta` must equal :meth:`open`'s. A format that reads lazily opens it (no tensor is read
        before one is asked for); one that reads its source whole when it opens (Megatron's) describes it without
        the tensors' bytes instead, so a run reads it once."""
        return self.open(path, key, tree=tree, source=source, id_groups=id_groups)

    def id_groups(self, given: IdGroups, configured: IdGroups, generated: bool) -> IdGroups:
        """The param groups a param-ID keyed input's IDs follow
        (``given``: ``input.param_groups``; ``configured``: ``optim.param_groups``)."""
        return given

    def write(
        self,
        result: dict[str, Any],
        staging: Path,
        rank: int,
        *,
        key: str,
        tree: ModuleTree,
        world_size: int,
        shared: dict[str, Any],
    ) -> RankFiles:
        """Write target rank ``rank``'s state into the staged conversion
        (``shared``: what every rank of this process shares)."""
        raise NotImplementedError

    def finish(self, staging: Path, shared: dict[str, Any], per_rank: list[RankFiles]) -> dict[str, str]:
        """After every rank wrote: the files that complete the checkpoint, and their sha256 (none by default)."""
        return {}

    def read_written(self, path: Path, key: str) -> dict[str, Any]:
        """The state dict a target rank's file (:meth:`output_path`) holds, read whole (a job loads and steps it)."""
        return torch.load(path, map_location="cpu", weights_only=True)

    def differences(
        self,
        directory: Path,
        key: str,
        rank: int,
        expected: dict[str, Any],
        *,
        tree: ModuleTree,
        world_size: int,
        opened: dict[str, Any],
    ) -> list[str]:
        """Where what target rank ``rank`` finds under ``directory`` differs from ``expected``,
        bitwise (``opened``: kept across ranks)."""
        if not self.writes(rank):
            return []
        path = self.output_path(directory, rank)
        if not path.is_file():
            return [f"{path} is missing"]
        return [f"{path}: {p.removeprefix('state_dict')}" for p in diff(load_written(path), expected, limit=3)]

    def load_as_a_user_does(self, model: Any, optim: Any, path: Path, written: dict[str, Any], kind: Any) -> None:
        """Load target rank's file into a live target job the way the README tells a resuming job to
        (FQN-keyed: the kind's full load)."""
        kind.load_full(model, optim, written)


def load_written(path: Any) -> Any:
    """A ``torch.save`` file osdpipe wrote, loaded to be compared: memory-mapped on the local disk; in object storage
    (``osdpipe check s3://...``) by its records, every tensor's bytes fetched (the comparison reads them all)."""
    if is_remote(str(path)):
        from osdpipe.io.formats.safe_load import load_remote

        return fetched_memory.fetch_all(load_remote(str(path)))
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def write_torch_file(osd: dict[str, Any], path: Path) -> RankFiles:
    """``torch.save`` the state, with its digests taken as it is written, then check the file's structure.

    The bytes were checked by verify while in memory, and hashed on their way
    to disk; reading them back would be a second full pass. The check reads
    the file's index only (``mmap``): the zip structure, every key, dtype
    and shape, and the small values.
    """
    from osdpipe.io.formats.safe_load import meshes_quiet  # imports this module

    digest, per_tensor = save_hashed(osd, path)
    with meshes_quiet():  # a DTensor's mesh, read back as data
        problems = diff(torch.load(path, map_location="cpu", weights_only=True, mmap=True), osd, tensor_bytes=False)
    if problems:
        raise OSError(f"{path} does not read back as written: {problems[0]}")
    return RankFiles({path.name: digest}, {f"{path.name}:{k}": v for k, v in per_tensor.items()})
