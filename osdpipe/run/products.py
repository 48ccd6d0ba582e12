"""What each stage makes, as frozen dataclasses: the stages' inputs and outputs, and nothing else.

A stage is a function ``(ctx, previous product, tally) -> product``: the
:class:`~osdpipe.run.context.Context` says where it runs (the plan, the world,
which rank), the previous stage's product is all it reads of the run so far,
and the :class:`Tally` takes what it measured and what the user should hear.
Each product holds the one before it, so the last one holds the whole story
of a rank; a stage can be unit-tested on a hand-made product with no process.

=========  ======================  =========================================
stage      makes                   what is new
=========  ======================  =========================================
load       :class:`Opened`         the reader; which rank reads for which
broadcast  :class:`Described`      the source's metadata, checked, shared
flatten    :class:`Flattened`      per target tensor, the state it carries
shard      :class:`Sharded`        this rank's tensors, cut from the source
rekey      :class:`Keyed`          the state dict the target loads
verify     :class:`Verified`       the checks' results
save       :class:`Staged`         the files this rank staged
=========  ======================  =========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from osdpipe.io.formats.base import RankFiles, SourceMeta, SourceReader
    from osdpipe.run.streamed_output import StreamedOutput

P = TypeVar("P")


@dataclass
class Tally:
    """What one stage on one rank measured and found worth saying; the loop adds it to the report."""

    #: Bytes this rank read or wrote.
    moved: int = 0
    #: Bytes this rank sent to others through the process group.
    sent: int = 0
    #: What the user should know though nothing failed.
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Opened:
    """load: the source opened where it is read.

    ``reading_ranks[r]`` is the rank that reads target rank ``r``'s ranges of
    the input (``None``: every rank reads its own); a rank another reads for
    has no ``reader``.
    """

    reader: SourceReader | None
    reading_ranks: tuple[int, ...] | None

    def reads_itself(self, rank: int) -> bool:
        """Whether ``rank`` reads its ranges of the input
        (else a reading rank sends them: ``runtime.transfer=scatter``)."""
        return self.reading_ranks is None or self.reading_ranks[rank] == rank

    @property
    def first_reader(self) -> int:
        """The lowest rank that reads the input: it describes the source to the others."""
        return 0 if self.reading_ranks is None else min(self.reading_ranks)

    def receivers(self, rank: int) -> list[int]:
        """The ranks ``rank`` reads for, besides itself, in rank order."""
        if self.reading_ranks is None:
            return []
        return [r for r, reader in enumerate(self.reading_ranks) if reader == rank and r != rank]


@dataclass(frozen=True)
class Described(Opened):
    """broadcast: the source's metadata, read by the first reading rank, checked against the model on every rank.

    The same for every rank a process plays: the loop makes it once per process.
    """

    meta: SourceMeta


@dataclass(frozen=True)
class Flattened:
    """flatten: per local tensor of this rank's target layout,
    ``{state name: TensorRef | value}`` (no bytes read yet)."""

    source: Described
    entries: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Sharded:
    """shard: this rank's state tensors, filled from the source (or to be, see ``streamed``):
    ``{layout key: {state name: tensor | value}}``."""

    flat: Flattened
    state: dict[str, dict[str, Any]]
    #: Per rank this one read for (``runtime.transfer=scatter``), each batch's fingerprint
    #: (:func:`osdpipe.io.digest.pieces_fingerprint`): ``(key, state name, batch) -> digest``.
    sent_digests: dict[int, dict[tuple[str, str, int], str]] = field(default_factory=dict)
    #: Each batch this rank read for itself, its fingerprint as read, where the source is in object storage and
    #: roundtrip will check (``(key, state name, batch) -> digest``): the check compares with them instead of fetching
    #: the source a second time. ``None``: the check reads the source again.
    read_digests: dict[tuple[str, str, int], str] | None = None
    #: Under ``runtime.memory_budget``, where the state's tensors are placeholders that save fills as it writes them
    #: (:mod:`osdpipe.run.streamed_output`); ``None``: they are filled here.
    streamed: StreamedOutput | None = None

    @property
    def source(self) -> Described:
        return self.flat.source

    def state_bytes(self) -> int:
        """The bytes of the tensors this rank converted: its own output, which a memory budget does not count."""
        return sum(
            v.numel() * v.element_size()
            for state in self.state.values()
            for v in state.values()
            if hasattr(v, "numel") and v.dim() > 0
        )


@dataclass(frozen=True)
class Keyed:
    """rekey: the state dict this rank's output holds, keyed as the target loads it."""

    sharded: Sharded
    state_dict: dict[str, Any]
    #: Layout key -> its key in ``state_dict["state"]`` (a param ID, or the FQN).
    keys: dict[str, Any]
    #: A whole checkpoint's model weights on this rank, by layout key (the canonical FQN);
    #: ``None``: the input is an optimizer's alone.
    weights: dict[str, Any] | None = None

    @property
    def source(self) -> Described:
        return self.sharded.source


@dataclass(frozen=True)
class CheckResult:
    """One verify check: its name, whether it passed, and what it saw."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class SkippedCheck:
    """A verify check that did not run on this conversion, and why (``report.json`` lists them)."""

    name: str
    why: str


@dataclass(frozen=True)
class Verified:
    """verify: this rank's result of every check that ran, and why the others did not."""

    keyed: Keyed
    checks: tuple[CheckResult, ...]
    skipped: tuple[SkippedCheck, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


@dataclass(frozen=True)
class Staged:
    """save: the files this rank wrote into the staged conversion (``None``: nothing, since a check failed)."""

    before: Keyed | Verified
    files: RankFiles | None


#: Each product's field holding the product it was made from.
_MADE_FROM = {Staged: "before", Verified: "keyed", Keyed: "sharded", Sharded: "flat", Flattened: "source"}


def find(product: Any, kind: type[P]) -> P | None:
    """The product of type ``kind`` that ``product`` is or was made from (``None``: that stage did not run)."""
    while product is not None and not isinstance(product, kind):
        made_from = _MADE_FROM.get(type(product))
        product = None if made_from is None else getattr(product, made_from)
    return product
