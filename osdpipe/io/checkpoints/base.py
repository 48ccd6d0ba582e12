"""What a whole training checkpoint is made of, and the registry of the layouts frameworks save them in.

A training job saves more than its optimizer: the model's weights, a
learning-rate scheduler, its step counter, data-loader positions, RNG states,
entries of its own. Frameworks lay these out in fixed ways (torchtitan: one
DCP directory per step; accelerate: a folder of DCP directories and files).
A :class:`CheckpointLayout` says where a checkpoint of its framework keeps
each part, for ``osdpipe inspect`` and for a conversion:

* its *metadata* (never a tensor's bytes) as a :class:`WholeCheckpoint`:
  where the model and the optimizer are, and every other entry with its size,
  so that nothing in it goes unnamed (:meth:`~CheckpointLayout.read`);
* where the optimizer is, in a form today's readers take (:meth:`~CheckpointLayout.optimizer_part`);
* a reader of the model's weights (:meth:`~CheckpointLayout.open_model`), which
  travel through the stages as one more state of each parameter (:mod:`osdpipe.io.weights`);
* what is carried over unchanged (:meth:`~CheckpointLayout.carried`), and how
  a target rank's output is laid out (:meth:`~CheckpointLayout.write`).

The ``optimizer`` layout is the default: an input that is the optimizer's
state alone, converted as it always was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # annotations only: the layouts import torch where they read or write
    from osdpipe.io.formats.base import Format, RankFiles
    from osdpipe.io.formats.mapped import ModelMap
    from osdpipe.layout.ranges import LayoutSpec
    from osdpipe.layout.tree import ModuleTree

#: Where a whole checkpoint's ``dcp`` output goes under ``output.path``:
#: the folder the framework loads (a step folder, a ``save_state`` folder).
DCP_DIR = "dcp"

#: What an entry is to a conversion: model weights and optimizer state are converted; what describes how the saving
#: framework laid out its own files (DeepSpeed's ``param_shapes``) is left out, as the output has another layout;
#: anything else is carried over.
PARTS = ("model", "optimizer", "framework", "other")

#: A model as a config names it: its ``model.factory`` and ``model.kwargs``.
NamedModel = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class ModelNaming:
    """How ``osdpipe inspect``'s command names the model of a whole checkpoint: ``overrides``, and ``why`` where a model
    that the files seemed to name was refused (its parameters are not the optimizer's)."""

    overrides: tuple[str, ...]
    why: str | None = None

    @classmethod
    def users_own(cls, why: str | None = None) -> ModelNaming:
        """The user's own ``model.factory``, a placeholder to fill in."""
        from osdpipe.io.file_facts import USER_FACTORY  # the placeholders inspect prints; torch: not at --help

        return cls((f"model.factory={USER_FACTORY}",), why)


@dataclass(frozen=True)
class Entry:
    """One named thing in a checkpoint.

    Attributes:
        name: as the framework names it (``lr_scheduler``, ``dataloader.dp_rank_3``, ``scheduler.bin``).
        part: one of :data:`PARTS`.
        where: where it is stored, relative to the checkpoint: ``step-2/ (DCP)``, ``scheduler.bin``.
        size: its stored bytes.
        tensors: how many tensors it holds (0 for bytes and files).
        source_rank: the rank of the saving world it describes (a data loader's position, an RNG state), else ``None``;
            such an entry is kept as it is and says nothing of the target world.
    """

    name: str
    part: str
    where: str
    size: int
    tensors: int = 0
    source_rank: int | None = None


@dataclass(frozen=True)
class WholeCheckpoint:
    """A whole training checkpoint, as its layout reads it: every entry, and where the model and the optimizer are."""

    layout: str
    path: str
    entries: tuple[Entry, ...]
    #: Where the optimizer state is, as ``input.path`` / ``input.key`` would name it;
    #: ``None``: the checkpoint holds none.
    optimizer_path: str | None = None
    optimizer_key: str | None = None
    #: How the optimizer state is keyed:
    #: ``nested`` (``state.<fqn>.<name>`` as a tree) or ``flat`` (``flatten_optimizer_state_dict``).
    optimizer_keys: str = "nested"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def part(self, name: str) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.part == name)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Part:
    """Where a whole checkpoint keeps its optimizer, as ``input.path``,
    ``input.format`` and ``input.key`` would name it."""

    path: str
    format: str
    key: str


@dataclass(frozen=True)
class Carrying:
    """What a conversion carries over from a whole checkpoint unchanged, and what every entry of it becomes.

    Attributes:
        source: the checkpoint's folder.
        items: DCP items of the checkpoint that are neither the model nor the
            optimizer, by flat key: each is written again as it is stored
            (``dcp`` output) or as its value (``rank_local``).
        item_paths: each item's path in the saved state dict.
        item_tensors: the items that are tensors, each with its shape and
            dtype name (re-stored from their values, not their bytes; a rank
            that only plans the output needs no more of them).
        files: files beside the checkpoint's DCP directories, relative to
            ``source``, copied byte for byte next to the output.
        entries: every entry of the checkpoint, for the report.
        model_key: where the model's state dict sits in the checkpoint's
            saved state dict (``None``: at the top level), kept so in the output.
        folder: the folder under ``output.path`` that the output's DCP checkpoint goes in: where the framework
            looks for it (torchtitan's ``step-<N>``; ``dcp`` where the framework is pointed at the folder itself).
        layout: the layout that read the checkpoint (``checkpoint=``).
        step: the training step the checkpoint was saved at, where its files say (torchtitan's ``step-<N>``,
            DeepSpeed's ``global_steps``): what names a torchtitan output's ``step-<N>`` folder.
        made: files the source's layout makes for the target beside the output, by path, with their bytes (a Megatron
            save's ``config.json``, which a Hugging Face model is built from and the save holds only as ``args``).
        under: the framework name another framework's carried items are kept under in the output (``None``: they are
            the output framework's own, kept where the source had them): torchtitan's layout nests them under it, where
            their own names (``lr_scheduler``) would be taken for torchtitan's and loaded into its job; accelerate's,
            which has no place for entries, keeps them in the file ``<under>.pt``.
        warnings: what the output cannot hold as the source's job had it, for the report (a Megatron save's folder
            has no token ids: Megatron's ``args`` do not hold them).
    """

    source: str
    items: tuple[str, ...] = ()
    item_paths: tuple[tuple[Any, ...], ...] = ()
    item_tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    entries: tuple[Entry, ...] = ()
    model_key: str | None = None
    folder: str = DCP_DIR
    #: Whether the checkpoint holds the optimizer's state;
    #: a model-only one (torchtitan's last save, its seed checkpoint) converts to a model-only one.
    optimizer: bool = True
    layout: str = ""
    step: int | None = None
    under: str | None = None
    made: dict[str, bytes] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    #: Why the output leaves out the entries that are neither the model nor the optimizer, where it does (another
    #: framework's, which a Megatron save has no place for); ``None``: they are carried.
    left_out: str | None = None
    #: What the output's layout says became of an entry, by its name, where it is not what its part says (a Hugging
    #: Face folder's ``config.json`` kept in a Megatron save's ``common.pt``).
    said: dict[str, str] = field(default_factory=dict)
    #: The Hugging Face ``config.json`` of the model the checkpoint holds, where the output's job builds another
    #: framework's model of it (:meth:`CheckpointLayout.gpt_config`): what a Megatron save's ``args`` are made of.
    gpt_config: dict[str, Any] | None = None

    def written_path(self, path: tuple[Any, ...]) -> tuple[Any, ...]:
        """Where a carried item saved at ``path`` in the source goes in the output's state dict."""
        return path if self.under is None else (self.under, *path)

    def written_flat(self, flat: str) -> str:
        """A carried item's flat key in the output (as ``dcp.save`` flattens :meth:`written_path`),
        from its flat key in the source."""
        return flat if self.under is None else f"{self.under}.{flat}"


@dataclass
class CarriedData:
    """The carried items of a whole checkpoint, read on the first reading rank:
    each non-tensor item's stored bytes, each tensor item's value."""

    raw: dict[str, bytes] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    #: Items whose stored bytes are transformed (compressed):
    #: carried as their values, loaded with ``weights_only=True``.
    values: dict[str, Any] = field(default_factory=dict)


class CheckpointLayout:
    """One framework's way of laying out a whole checkpoint. Subclasses set :attr:`name` and implement the methods."""

    name: ClassVar[str]
    #: What a checkpoint of this layout is, in a few words.
    looks_like: ClassVar[str]
    #: Whether the checkpoint holds more than the optimizer's state:
    #: model weights that convert with it, entries carried over.
    whole: ClassVar[bool] = True
    #: Whether the checkpoint is one DCP directory of the model's and the optimizer's state dicts beside other entries
    #: (torchtitan's step, PyTorch's own): another such layout reads it too, whichever's own it looks like (a PyTorch
    #: layout converted from torchtitan keeps torchtitan's entries).
    one_dcp: ClassVar[bool] = False
    #: ``input.format`` of each variant this layout comes in (a sharded one is ``dcp``).
    input_formats: ClassVar[tuple[str, ...]] = ("dcp",)
    #: ``output.format`` this layout can be written in: its own (``dcp``) or each rank's files (``rank_local``).
    output_formats: ClassVar[tuple[str, ...]] = ("dcp", "rank_local")
    #: The layout a conversion of this one writes unless ``output.checkpoint`` says
    #: (``None``: this one; DeepSpeed's, which osdpipe only reads: PyTorch's).
    written_as: ClassVar[str | None] = None
    #: Whether this layout's files say at which training step the checkpoint was saved (:attr:`Carrying.step`).
    saves_step: ClassVar[bool] = False
    #: Whether this layout, written, is named after the step it was saved at (torchtitan's ``step-<N>``):
    #: only a source that says it converts to it.
    needs_step: ClassVar[bool] = False
    #: Whether this layout writes each state tensor of a rank whole, as one record, so that a rank's output can be made
    #: as it is written under ``runtime.memory_budget`` (:mod:`osdpipe.run.streamed_output`); else the whole
    #: checkpoint's model and optimizer are put together in memory first.
    made_as_written: ClassVar[bool] = False
    #: The names a GPT's parameters have in this layout's job (one of :data:`osdpipe.layout.megatron_hf.NAMINGS`):
    #: its Hugging Face model's (a PyTorch job's, accelerate's, a model folder's), torchtitan's, or Megatron's own. A
    #: checkpoint converts to a layout of other names through a map (:meth:`model_map`).
    gpt_names: ClassVar[str] = "hf"
    #: Whether this layout holds a model's weights alone, never an optimizer (a Hugging Face model folder).
    weights_alone: ClassVar[bool] = False
    #: Whether this layout's job builds a model of its own of another framework's checkpoint (Megatron's GPT of a
    #: Hugging Face Llama): the run's ``model`` is then that one, and a model the command names is the source's
    #: (:meth:`naming_of`).
    builds_own_model: ClassVar[bool] = False
    #: What ``osdpipe inspect``'s printed command leaves to fill in besides the target's world and the output's place
    #: (Megatron's grid: ``target.tp_size=T``).
    target_placeholders: ClassVar[tuple[str, ...]] = ()

    def refuses_keys(self, path: str, given: Any, raw: dict[str, Any]) -> str | None:
        """Why keys the user gave (``given``: their names; ``raw``: the config) cannot convert the checkpoint at
        ``path``, where only its files say so (``None``: they can); one line naming the key. None by default."""
        return None

    def refuses(self, given: Format, source_kind: Any, generated: bool) -> str | None:
        """Why a conversion of this layout cannot read ``given``
        (or generate a source of ``source_kind``) (``None``: it can); one line naming the keys to set."""
        if not self.whole:
            return None
        if generated and (why := self.refuses_source_kind(source_kind)) is not None:
            return why
        if not generated and given.name not in self.input_formats:
            return (
                f"checkpoint={self.name}: its input is input.format={' or '.join(self.input_formats)} "
                f"(the checkpoint's folder), not {given.name}"
            )
        return None

    def refuses_output(self, source: CheckpointLayout, written: Format, target_kind: Any) -> str | None:
        """Why this layout cannot be written from a checkpoint of layout ``source`` in ``written`` for ``target_kind``
        (``None``: it can); one line."""
        if not self.whole:
            return None
        if source.name != self.name and self.needs_step and not source.saves_step:
            return (
                f"output.checkpoint={self.name}: its folder is named after the step the checkpoint was saved at, "
                f"which the files of checkpoint={source.name} do not say; "
                "set output.checkpoint=pytorch (PyTorch's own layout, which any PyTorch job loads)"
            )
        said = f"checkpoint={self.name}" if source.name == self.name else f"output.checkpoint={self.name}"
        if written.name not in self.output_formats:
            return (
                f"{said}: a whole checkpoint is written as output.format={' or '.join(self.output_formats)}, "
                f"not {written.name}"
            )
        # each rank's own file, of a job whose optimizer may see flat parameters
        if written.keyed_by_id and target_kind.has_use_orig_params:
            return (
                f"{said} with output.format={written.name} and target.kind={target_kind.name}: "
                "an FSDP1 rank's model weights are a shard of its flat parameters, "
                "which no model.state_dict() a job loads holds; set output.format=dcp (FSDP1's SHARDED_STATE_DICT)"
            )
        return None

    def adopt(self, carrying: Carrying) -> Carrying:
        """What a conversion that writes this layout carries, from what the input's layout found (``carrying``):
        where this layout puts the model and its DCP directory. The input's own layout keeps it as it is."""
        return carrying

    def output_format_of(self, input_format: str) -> str | None:
        """The ``output.format`` a conversion of an input in
        ``input_format`` writes unless told (``None``: the config's)."""
        return None

    def generated_name(self, steps: int) -> str:
        """What a generated source of this layout, trained ``steps`` steps, is called under ``source/``:
        the framework's own name for the folder."""
        return "checkpoint"

    def refuses_source_kind(self, kind: Any) -> str | None:
        """Why this framework's job cannot be of ``kind``,
        where osdpipe trains and saves the source itself (``None``: it can)."""
        return None

    def save(self, model: Any, optim: Any, scheduler: Any, path: Path, steps: int) -> None:
        """Save the whole job as the framework does, on every rank of the source world (collective):
        what osdpipe converts with no ``input.path``."""
        raise NotImplementedError

    def advice(self, path: str, target: dict[str, Any], output_format: str) -> list[str]:
        """What the framework will do on the target (``target``: the config's ``target`` section)
        with the output of the checkpoint at ``path`` in ``output_format``, where it differs from
        what a user expects, and what to do: said in the run's output and in ``report.json``'s
        warnings (entries that describe the world that saved it, state its own load path drops)."""
        return []

    def foreign_advice(self, source: str, target: dict[str, Any]) -> list[str]:
        """What a job of this framework on the target (``target``: the config's ``target``
        section) will make of a checkpoint written in its layout from a ``source``
        checkpoint, which lacks this framework's own entries; said as :meth:`advice` is."""
        return []

    def model_naming(self, path: Path) -> ModelNaming:
        """The overrides that name the model which saved the checkpoint at ``path``, for ``osdpipe inspect``'s command.

        By default the files cannot tell: the user's own factory goes there.
        """
        return ModelNaming.users_own()

    def model_from_files(
        self, path: str, written_in: CheckpointLayout | None = None,
    ) -> tuple[str, dict[str, Any]] | None:
        """A ``model.factory`` and its ``model.kwargs`` that build the model the checkpoint at ``path`` names, where its
        files name every parameter and shape (``None``: they do not; the user's factory is needed), for an output in
        the layout ``written_in`` (the model the job that resumes it builds). What a conversion uses when the user
        names no model."""
        return None

    def newest_in(self, path: str) -> str | None:
        """Where ``path`` is the folder a framework keeps its checkpoints in,
        the newest of them (``None``: ``path`` is one checkpoint)."""
        return None

    def input_format_of(self, path: str) -> str:
        """The ``input.format`` the checkpoint at ``path`` is,
        as its folder shows it (by default the layout's first)."""
        return self.input_formats[0]

    def optimizer_part(self, path: str, input_format: str, written_in: CheckpointLayout | None = None) -> Part | None:
        """Where the optimizer is in the checkpoint at ``path``, as today's readers take it (``None``: a model-only
        checkpoint), for an output in the layout ``written_in`` (a save read for another framework's model: the
        reader's ``key`` names whose)."""
        raise NotImplementedError

    def model_map(
        self, path: str, written_in: CheckpointLayout | None = None, dtype: str | None = None,
        named: NamedModel | None = None,
    ) -> ModelMap | None:
        """How the model of the checkpoint at ``path`` becomes the model an output in the layout ``written_in`` holds,
        where that is another framework's model of the same network (a Hugging Face Llama as a Megatron GPT): the map
        the source is read through (:mod:`osdpipe.io.formats.mapped`); ``None``: the same model, read by its own
        names. ``dtype``: the weights' in the output, where the config says one (``output.dtype``); ``named``: the
        checkpoint's model as the command names it (:meth:`named_by`). By default the output's layout says
        (:meth:`map_into`)."""
        if written_in is None or written_in is self:
            return None
        return written_in.map_into(self, path, dtype, named)

    def map_into(
        self, source: CheckpointLayout, path: str, dtype: str | None = None, named: NamedModel | None = None,
    ) -> ModelMap | None:
        """The map a checkpoint of layout ``source`` at ``path`` is read into this layout's model through, where this
        layout's job builds another model of it (:meth:`model_map`); ``None`` (the default): the same model."""
        return None

    def named_by(self, checkpoint: Mapping[str, Any]) -> NamedModel | None:
        """The checkpoint's own model as the command's ``checkpoint`` section names it, where the files need not
        (torchtitan's ``checkpoint.model`` and ``checkpoint.flavor``); ``None`` (the default): its files say."""
        return None

    def naming_of(self, model: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``checkpoint`` keys that name the checkpoint's own model as the command's ``model`` section does,
        where the output's job builds a model of its own of it (:attr:`builds_own_model`) and the section names the
        source's; ``None`` (the default): this layout's model is not named so."""
        return None

    def model_for(
        self, written: CheckpointLayout, path: str, config: dict[str, Any]
    ) -> tuple[str, dict[str, Any]] | None:
        """The ``model.factory`` and ``model.kwargs`` of the job that resumes the checkpoint at ``path`` written in the
        layout ``written``, for the target ``config`` (the command's config, a plain dict) says: the model that
        layout's job builds of it (:meth:`model_into`), else the one this layout's files name
        (:meth:`model_from_files`); ``None``: the user's own is needed.

        Raises:
            ModelRefused: the files name a model that job cannot hold (one line).
        """
        return written.model_into(self, path, config) or self.model_from_files(path, written)

    def settles(self, source: CheckpointLayout, path: str) -> dict[str, Any]:
        """The config keys this layout's job settles where it writes a checkpoint of layout ``source`` at ``path``
        and the user gave none of them (a model folder is one process's model: ``target.kind=none``); none by
        default."""
        return {}

    def model_into(
        self, source: CheckpointLayout, path: str, config: dict[str, Any]
    ) -> tuple[str, dict[str, Any]] | None:
        """The model this layout's job builds of a checkpoint of layout ``source`` at ``path``, where it is another
        framework's model of it (:meth:`model_for`); ``None`` (the default): the checkpoint's own."""
        return None

    def gpt_config(self, path: str, named: NamedModel | None = None) -> dict[str, Any] | None:
        """The Hugging Face ``config.json`` of the GPT the checkpoint at ``path`` holds (``None``: its files do not
        say, nor ``named``, the model the command names for it: :meth:`named_by`): what another framework's model of
        it is made of. By default the folder's own ``config.json``.

        Raises:
            InputError: a ``config.json`` that is not JSON.
        """
        from osdpipe.io import hf_folder
        from osdpipe.io.remote_input import as_path

        return hf_folder.read_config(path) if (as_path(path) / hf_folder.CONFIG).is_file() else None

    def weights_dtype(self, path: str) -> str:
        """The dtype the job that saved the checkpoint at ``path`` computes in, where another framework's job is made
        of it: that of its weights where it holds them alone (a Hugging Face folder's), else float32 (its weights
        are the fp32 masters).

        Raises:
            InputError: weights of more than one dtype.
        """
        return "float32"

    def open_model(self, path: str, input_format: str, tree: ModuleTree, optimizer: Any) -> Any:
        """A reader of the model's weights in the checkpoint at ``path`` (:class:`osdpipe.io.weights.WeightsReader`);
        ``optimizer``: the optimizer part's reader, opened already, for a layout that keeps the weights in the same
        files (DeepSpeed's masters)."""
        raise NotImplementedError

    def carried(
        self, path: str, input_format: str, tree: ModuleTree, written_in: CheckpointLayout | None = None,
    ) -> Carrying:
        """What is neither the model nor the optimizer in the checkpoint at ``path`` (``tree``: its own model), for an
        output in the layout ``written_in``: what the conversion carries over."""
        raise NotImplementedError

    def read_carried(self, carrying: Carrying) -> CarriedData:
        """The carried items' bytes and values, read on the first reading rank;
        by default there are none (files are copied at the end)."""
        return CarriedData()

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
        """Write target rank ``rank``'s part of the output into ``staging``
        (``parts``: :class:`osdpipe.io.checkpoints.output.RankParts`), for a target job laid out as ``target``;
        ``output_config``: the config's ``output`` section (how its files are cut: ``max_shard_size``)."""
        raise NotImplementedError

    def finish(
        self, staging: Path, shared: dict[str, Any], per_rank: list[RankFiles], fmt: Format, carrying: Carrying,
        target: LayoutSpec | None = None,
    ) -> dict[str, str]:
        """After every rank wrote: the files that complete the output (carried files among them), and their sha256
        (``target``: how the target job is laid out)."""
        return {}

    def load_output(self, model: Any, optim: Any, directory: Path, rank: int, fmt: Format) -> None:
        """Load target rank ``rank``'s part of the output under ``directory`` into a live job,
        model and optimizer, as the framework loads it.

        Rank files load with :func:`osdpipe.load_rank_local`, the model given
        (what ``osdpipe check --load`` does with them).
        """
        from osdpipe.io.formats.rank_local import rank_file_name  # torch: only a live job loads
        from osdpipe.io.loading import load_rank_local

        if not fmt.keyed_by_id:
            raise NotImplementedError(f"checkpoint={self.name}: loading its {fmt.name} output")
        load_rank_local(optim, directory / rank_file_name(rank), model=model)

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
        """Where what target rank ``rank`` finds under ``directory`` differs from ``parts`` (what it should hold),
        bitwise (``opened``: kept across ranks).

        What ``osdpipe check`` compares a finished conversion's files with.
        """
        raise NotImplementedError

    def recognizes(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this layout, from names and metadata alone."""
        raise NotImplementedError

    def read(self, path: Path) -> WholeCheckpoint:
        """Every entry of the checkpoint at ``path`` (metadata only).

        Raises:
            InputError: naming the file that is missing or damaged.
        """
        raise NotImplementedError


def fates(carrying: Carrying, weights_alone: bool = False) -> list[dict[str, Any]]:
    """What a conversion did with each entry of a whole checkpoint, as ``report.json`` lists them:
    nothing in it goes unnamed (``carrying``: as the layout written adopted it; ``weights_alone``: written as a model's
    weights alone, the optimizer left out).

    Each is ``{"name", "part", "where", "size", "fate"}``; an entry that
    describes one rank of the world that saved it also has ``source_rank``.
    """
    said = {
        "model": "converted: the model's weights, laid out for the target",
        "optimizer": "converted: the optimizer's state, laid out for the target",
        "framework": (
            "left out: it describes how the saving framework laid out its own files, which the output does not have"
        ),
    }
    if weights_alone:
        said["optimizer"] = "left out: the output holds the model's weights alone"
    if carrying.left_out is not None:
        said["other"] = carrying.left_out
    if carrying.under is not None:
        said["other"] = (
            f"carried over unchanged, under {carrying.under!r}: "
            "the target framework's own entries of that name are another thing"
        )
    out = []
    for entry in carrying.entries:
        fate = carrying.said.get(entry.name) or said.get(entry.part, "carried over unchanged")
        row: dict[str, Any] = {
            "name": entry.name, "part": entry.part, "where": entry.where, "size": entry.size, "fate": fate
        }
        if entry.source_rank is not None:
            row["source_rank"] = entry.source_rank
            row["fate"] = (
                f"{fate}; it describes rank {entry.source_rank} of the world that saved the checkpoint, "
                "not the target's"
            )
        out.append(row)
    return out


LAYOUTS: dict[str, CheckpointLayout] = {}


def register(cls: type[CheckpointLayout]) -> type[CheckpointLayout]:
    if cls.name in LAYOUTS:
        raise ValueError(f"checkpoint layout {cls.name!r} is registered twice")
    LAYOUTS[cls.name] = cls()
    return cls
