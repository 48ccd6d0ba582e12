"""What a whole training checkpoint is made of, and the registry of the layouts frameworks save them in.

A training job saves more than its optimizer: the model's weights, a
learning-rate scheduler, its step counter, data-loader positions, RNG states,
entries of its own. Frameworks lay these out in fixed ways (torchtitan: one
DCP directory per step; accelerate: a folder of DCP directories and files).
A :class:`CheckpointLayout` reads such a folder's *metadata* (never a
tensor's bytes) into a :class:`WholeCheckpoint`: where the model and the
optimizer are, and every other entry with its size, so that nothing in it
goes unnamed. ``osdpipe inspect`` shows it. A conversion reads the optimizer
part today; the model and the other entries are not carried over yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

#: What an entry is to a conversion: model weights and optimizer state are converted; anything else is carried over.
PARTS = ("model", "optimizer", "other")


@dataclass(frozen=True)
class Entry:
    """One named thing in a checkpoint.

    Attributes:
        name: as the framework names it (``lr_scheduler``, ``dataloader.dp_rank_3``, ``scheduler.bin``).
        part: ``model``, ``optimizer`` or ``other``.
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
    #: Where the optimizer state is, as ``input.path`` / ``input.key`` would name it; ``None``: the checkpoint holds none.
    optimizer_path: str | None = None
    optimizer_key: str | None = None
    #: How the optimizer state is keyed: ``nested`` (``state.<fqn>.<name>`` as a tree) or ``flat`` (``flatten_optimizer_state_dict``).
    optimizer_keys: str = "nested"
    notes: tuple[str, ...] = field(default_factory=tuple)

    def part(self, name: str) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.part == name)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class CheckpointLayout:
    """One framework's way of laying out a whole checkpoint. Subclasses set :attr:`name` and implement both methods."""

    name: ClassVar[str]
    #: What a checkpoint of this layout is, in a few words.
    looks_like: ClassVar[str]

    def recognizes(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this layout, from names and metadata alone."""
        raise NotImplementedError

    def read(self, path: Path) -> WholeCheckpoint:
        """Every entry of the checkpoint at ``path`` (metadata only).

        Raises:
            InputError: naming the file that is missing or damaged.
        """
        raise NotImplementedError


LAYOUTS: dict[str, CheckpointLayout] = {}


def register(cls: type[CheckpointLayout]) -> type[CheckpointLayout]:
    if cls.name in LAYOUTS:
        raise ValueError(f"checkpoint layout {cls.name!r} is registered twice")
    LAYOUTS[cls.name] = cls()
    return cls
